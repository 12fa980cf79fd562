"""Drafting the next step before the host has read this one (`EngineConfig.draft_ahead`).

Once a step's acceptance has run on the GPU, everything the drafter needs for the next step is on the device: each
session's accepted path (its taps are the next context rows), how many of its tokens will be emitted, the next
root and its position. So the engine queues the next draft right there (`Drafter.draft_ahead`), behind its own
read of the step's results, instead of after the host has read them, turned them into per-session bookkeeping and
asked again: the GPU goes from the acceptance straight into the next draft.

The device computes what the host will compute: `emitted_counts` applies `Session.emit`'s rules (EOS, unless
ignored, and max_new_tokens) to the accepted tokens and the bonus, so the rows appended are exactly the ones the
host would have sent; the engine checks the counts against the host's on every step. The draft is taken by the next
step if it drafts the same sessions, or some of them (others finished), in the same order at the same (budget,
top-k) with nothing else pending (`AheadDraft.take`); otherwise (a session joined, a turn was extended) its trees are
dropped (a wasted draft), while its appended rows stay: they are what the host would have sent anyway.

A drafter in another process that cannot draft from device values (over gRPC the values would have to cross the
wire before the host has them anyway; sessions at different budgets need more than one graph group) is asked early
instead (`ask_early`): right after the host's read, the next step's usual requests for the sessions that go on, so
the drafter works while the host finishes its step and starts the next; taken and dropped by the same rules.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter_service.api import DraftRequest
from drafter_service.device_copy import int64_to_device
from kernels.tree_build import TreeBatch
from verifier_service.session import Session
from verifier_service.tree_assembly import assemble_trees

NO_TOKEN = -2  # pads the EOS table: never a token id, never the path's -1 padding


@dataclass
class AheadDraft:
    """A draft queued before the host read its step (the trees of the step after). `begin` turns the drafted
    sessions' requests (`requests`, in `sids` order, made once the host has read the step: their roots and
    positions) into a function returning their trees; a drafter in another process waits for its answer there."""

    sids: list[str]
    params: list[tuple[int, int]]  # each session's (budget, top-k)
    begin: Callable[[list[DraftRequest]], Callable[[], TreeBatch]]
    requests: list[DraftRequest] | None = None
    sent_ns: int = 0  # time.time_ns() when it was queued (a traced step's spans start there: its draft did)
    early: bool = False  # the usual requests, sent right after the host read (`ask_early`), not device values

    def take(self, active: list[Session], drafting: list[int]) -> Callable[[], TreeBatch] | None:
        """The trees for the step drafting `drafting` of `active`, if this draft has them -> a function returning them
        in `drafting`'s order, else None. It has them when those sessions are among its own, in the same order, at
        the same (budget, top-k), with no rows pending: the same sessions, or fewer (some finished; their rows are
        dropped), never a session it did not draft or a turn extended since (new rows)."""
        at = {sid: j for j, sid in enumerate(self.sids)}
        rows = []
        for i in drafting:
            s = active[i]
            j = at.get(s.sid)
            if j is None or (s.params.budget, s.params.topk) != self.params[j] or (rows and j <= rows[-1]):
                return None
            if s.pending_ctx is not None and s.pending_ctx.shape[0]:
                return None
            rows.append(j)
        if not rows or self.requests is None:
            return None
        # the drafter's spans go under the traceparents of the step that takes the trees; none for the ones let go
        tp = {active[i].sid: active[i].traceparent for i in drafting}
        full = [dataclasses.replace(r, traceparent=tp.get(r.session_id, "")) for r in self.requests]
        trees = self.begin(full)
        if len(rows) == len(self.sids):
            return trees
        requests = [full[j] for j in rows]
        return lambda: assemble_trees(requests, self.sids, trees(), set(self.sids))

    def drop(self) -> None:
        """Not taken: let the drafter's answer go (a drafter in another process is waited for, so that the next
        step's request does not overwrite what it may still read). An early ask's trees may be queued on our GPU
        behind a wait for its answer (gRPC's landing): the stream is synchronized, so that its answer is in before the
        next request settles the stream's last step."""
        if self.requests is None:
            return
        trees = self.begin([dataclasses.replace(r, traceparent="") for r in self.requests])()  # no step verifies them
        if self.early and trees.tokens.device.type == "cuda":
            torch.cuda.current_stream(trees.tokens.device).synchronize()


def ask_early(drafter, requests: list[DraftRequest]) -> AheadDraft:
    """Send the next step's requests now (`draft_begin` of a drafter in another process: its answer is waited for
    once, whoever asks first) -> the draft for the next step to take. For a drafter that cannot draft from device
    values (gRPC): right after the host read, so its work overlaps the rest of the host's step and the next step's
    start, instead of waiting for them; untraced sessions only (the drafter's spans go under the request's
    traceparent, which names the step that verifies the trees)."""
    sent_ns = time.time_ns()
    trees = once(drafter.draft_begin(requests))
    return AheadDraft([r.session_id for r in requests], [(r.budget, r.topk) for r in requests], lambda _: trees,
                      requests, sent_ns, early=True)


def once(fn: Callable[[], TreeBatch]) -> Callable[[], TreeBatch]:
    """fn's result on every call, computed at the first."""
    box: list[TreeBatch] = []

    def get() -> TreeBatch:
        if not box:
            box.append(fn())
        return box[0]

    return get


def eligible(active: list[Session], drafting: list[int]) -> bool:
    """Whether a step's next draft can be queued ahead: every session drafts, all at one (budget, top-k) (one
    graph group)."""
    return len(drafting) == len(active) > 0 and len({(s.params.budget, s.params.topk) for s in active}) == 1


def emitted_counts(active: list[Session], path_tokens: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor,
                   committed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device, what each session's host loop will do with this step (`Session.emit`): path_tokens [S, D + 1]
    (the accepted path's tokens, the root first; past accept_len anything), accept_len, bonus, committed [S] ->
    (counts: tokens emitted, k >= 1; roots: the last of them, the next tree's root; root_pos: committed + k)."""
    S, P = path_tokens.shape
    dev = path_tokens.device
    a = accept_len.long()
    new = torch.cat((path_tokens[:, 1:], path_tokens[:, :1]), 1)  # [S, P]: the accepted tokens, then the bonus
    new = new.scatter(1, a[:, None], bonus.long()[:, None])
    eos = [[] if s.params.ignore_eos else list(s.params.eos_ids) for s in active]
    width = max(1, max(len(e) for e in eos))
    host = [[len(s.output) for s in active], [s.params.max_new_tokens for s in active]]
    host += [[e[j] if j < len(e) else NO_TOKEN for e in eos] for j in range(width)]
    table = int64_to_device(host, dev)
    remaining = table[1] - table[0]
    j = torch.arange(P, device=dev)[None, :]
    stops = (new[:, :, None] == table[2:].T[:, None, :]).any(-1) & (j <= a[:, None])
    first_stop = torch.where(stops, j, P).amin(1)
    counts = torch.minimum(torch.minimum(a + 1, remaining), first_stop + 1)
    roots = new.gather(1, (counts - 1)[:, None])[:, 0]
    return counts, roots, committed.long() + counts
