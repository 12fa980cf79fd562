"""Checking received draft trees where they live, without making the host wait for the GPU.

Trees from another process are untrusted (`verifier_service.tree_validation` lists the rules). The
host checks what it knows without reading a tensor (node counts against the session's budget, the
array width); everything else runs as one kernel on the trees' device (`kernels.tree_check`), queued
on the stream like the verify step that follows. A tree that fails is replaced in that same launch
by one whose nodes past the root carry token -1: the verify step runs over them, can never accept
them (a posterior token is never -1) and so takes an autoregressive step for that session, exactly
what a root-only tree would give. Which trees failed is read later (`verdicts`), once the step's own
host read has waited for the GPU anyway; the failing rows are then checked again on the host to say
what is wrong with them. The trees may be views of the peer's shared region (`fixed`): they are copied
on the GPU into the verifier's own memory and checked there (inside the check's CUDA graph when it has
one: the kernel reads a node more than once), and what is verified is the check's output (tokens, parent,
depth), never the region, which a faulty peer could rewrite at any time; the region's other fields are
only read to describe a failure.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from drafter_service.device_copy import int64_to_device
from kernels.tree_build import TreeBatch
from kernels.tree_check import CHECKS, MAX_NODES, check_packed
from verifier_service.tree_check_graphs import CheckGraphs
from verifier_service.tree_validation import validate_trees

log = logging.getLogger(__name__)


@dataclass
class _Checked:
    ids: list[str]
    trees: TreeBatch  # as received (the sanitized copy went to the engine)
    roots: list[int]
    codes: torch.Tensor  # [R] int32 on the trees' device, 0 = valid
    refused: set[str]  # told already (host checks)
    void: threading.Event | None  # set: the trees were read before their writer finished; no verdicts
    excused: set[str] | None = None  # rows verified without the peer's tree (filled in until read back)


class TreeChecker:
    """Checks batches of trees for one drafter model (vocabulary, depth); keeps the pending verdicts."""

    def __init__(self, vocab_size: int, max_depth: int, graphs: CheckGraphs | None = None):
        """graphs: replay the check from CUDA graphs where the trees come from one place every step (the
        co-located stream's region), `verifier_service.tree_check_graphs`; None: launch it every step."""
        self.vocab_size, self.max_depth = vocab_size, max_depth
        self.graphs = graphs
        self._pending: list[_Checked] = []
        self._expected: tuple[list[str], list[int], list[int], torch.Tensor] | None = None

    def expect(self, ids: list[str], roots: list[int], caps: list[int], device: torch.device) -> None:
        """Upload the next batch's node counts and roots ahead of it (while the drafter works): `check` then
        uses them when the trees come back for exactly these sessions with full trees (node count = cap, the
        usual answer), instead of uploading them on the step's critical path."""
        graphs = self.graphs
        out = graphs.counts(len(ids)) if graphs is not None and graphs.serves(device) else None
        self._expected = (list(ids), list(caps), list(roots), int64_to_device([caps, roots], device, out))

    def check(self, ids: list[str], trees: TreeBatch, roots: list[int], caps: list[int], fixed: bool = False,
              void: threading.Event | None = None, excused: set[str] | None = None
              ) -> tuple[TreeBatch, dict[str, str]]:
        """-> (the trees to verify, sessions refused on the host -> message). Host-refused rows (node count
        outside 1..cap) must not be verified from this batch; every other row is safe to verify as returned,
        its verdict read by `verdicts`. fixed: the trees are a view of the peer's shared region, where the next
        batches will live too: they are checked in a copy of our own, by a CUDA graph captured for that place
        when there is one. void: once set (before the trees are read back), this batch's verdicts are dropped: its
        trees were released to the verify step before the peer had written them (a doorbell the peer never rang),
        so their failures are the transport's, not the peer's, and fail no session. excused: sessions whose rows hold
        no tree of the peer's (a root-only placeholder, `verifier_service.tree_landing`): their verdicts are dropped;
        the set may grow until the batch is read back."""
        R, M = trees.tokens.shape
        refused: dict[str, str] = {}
        for sid, n, cap in zip(ids, trees.n_nodes, caps):
            if not 1 <= n <= min(cap, M):
                refused[sid] = f"n_nodes {n} is outside 1..{min(cap, M)} (budget allows {cap} nodes, arrays have {M})"
        if M > MAX_NODES:  # cannot be a valid tree: no row is verified from this batch
            return trees, {sid: refused.get(sid, f"trees have {M} columns, more than any budget allows")
                           for sid in ids}
        if R == 0:
            return trees, refused
        dev = trees.tokens.device
        expected, self._expected = self._expected, None
        if expected is not None and expected[0] == ids and expected[1] == trees.n_nodes and expected[2] == roots \
                and max(expected[1]) <= M and expected[3].device == dev:
            counts = expected[3]  # uploaded while the drafter worked
        else:
            counts = int64_to_device([[min(max(n, 0), M) for n in trees.n_nodes], roots], dev)
        packed = trees.pack()
        out = self.graphs.run(packed, counts) if self.graphs is not None and fixed else None
        if out is None:  # trees in the peer's region are checked in a copy of our own (see the module's note)
            out = check_packed(packed.clone() if fixed else packed, counts[0], counts[1], self.vocab_size,
                               self.max_depth)
        codes, tokens, parent, depth = out
        self._pending.append(_Checked(list(ids), trees, list(roots), codes, set(refused), void, excused))
        safe = TreeBatch(tokens, parent, depth, trees.first_child, trees.next_sibling, trees.logw,
                         list(trees.n_nodes))
        return safe, refused

    def verdicts(self) -> dict[str, str]:
        """Sessions whose tree failed a device check, over every batch checked since the last call ->
        what is wrong. Reads the codes: waits for the checks' GPU work (done when the verify step that
        used the trees has been read back)."""
        out: dict[str, str] = {}
        pending, self._pending = self._pending, []
        for c in pending:
            if c.void is not None and c.void.is_set():
                continue
            for r, code in enumerate(c.codes.tolist()):
                if code and c.ids[r] not in c.refused and (c.excused is None or c.ids[r] not in c.excused):
                    out[c.ids[r]] = self._describe(c, r, code)
        return out

    def _describe(self, c: _Checked, r: int, code: int) -> str:
        row = TreeBatch(**{f: getattr(c.trees, f)[r : r + 1].cpu() for f in TreeBatch._FIELDS},
                        n_nodes=[c.trees.n_nodes[r]])
        message = validate_trees(row, [c.roots[r]], [row.tokens.shape[1]], self.vocab_size, self.max_depth)[0]
        if message is None:  # the kernel and the host rules disagree: still refuse it, and say so
            log.error("tree check %r failed on the device but the host finds the tree valid", CHECKS[code - 1])
            message = f"check {CHECKS[code - 1]!r} failed"
        return message
