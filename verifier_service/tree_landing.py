"""Trees over gRPC into a verify step queued before they arrive (the gRPC transport on a GPU).

Co-located, the drafter's doorbell lets the verifier queue its whole verify step while the drafter still
drafts (`protos.doorbell`). Over gRPC the trees come as bytes after the drafter's GPU is done, and the verifier's
host would then decode, upload and check them and launch the step while its GPU idles. Instead, right after
a step's requests are sent, `TreeLandings.prepare` readies a landing: [6, R, M] trees in pinned host memory (M =
the largest full tree; every row starts as a root-only tree), a wait for a `HostBell` queued on the engine's
stream and behind it the one host-to-device copy of those trees, so the engine queues the check and its verify
step right away. The thread that reads the stream hands the answer to `Landing.deliver`, which writes each
answered session's tree into its row and rings the bell; a stream that breaks rings it (`release`), and so does
the deadline watch (`protos.doorbell_watch`) when no answer comes.

Whatever rings it, the step runs on what the landing holds, and it stays lossless: a row without its tree is a
root-only tree, which the device check refuses (an autoregressive step); such rows are `excused` (their
verdicts fail no session), and a landing released by the watch is `released` (the whole batch's verdicts are
dropped, as for a doorbell the drafter never rang). A tree is taken only when it has exactly the node count
the engine laid out (its cap: what a drafter sends unless it fails); other answers keep the root-only row and
say why (`refused`). What the engine learns from the answer (which sessions answered, the drafter's errors) is
read from the landing after the step has been read back (`settled`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.tree_build import TreeBatch
from protos.codec import WireError, answer_errors, inline_trees, trees_from_pb
from protos.ddtree.v1 import drafter_pb2
from protos.doorbell import HostBell
from telemetry import host_timeline

MAX_SHAPES = 32  # (R, M) landing buffers kept at once (their check graphs follow the address)


def root_only(host: np.ndarray, roots: list[int]) -> None:
    """Fill [6, R, M] int32 trees (TreeBatch._FIELDS order, logw's bits last) with root-only trees."""
    host[:5] = -1
    host[0, :, 0] = roots
    host[2, :, 0] = 0
    host[5] = np.float32(-np.inf).view(np.int32)
    host[5, :, 0] = 0  # logw 0.0 at the root


@dataclass
class Landing:
    """One step's trees on their way: written by the stream's reader thread, read by the engine after the step."""

    step_id: int
    ids: list[str]  # the step's sessions, in request (row) order
    roots: list[int]
    caps: list[int]  # each row's node count as laid out by the engine
    host: np.ndarray  # [6, R, M] int32 view of the pinned landing
    trees: TreeBatch  # on the engine's device: what the copy behind the wait fills
    bell: HostBell
    value: int  # what rings the bell for this step
    pinned: torch.Tensor | None = None  # the pinned [6, R, M] block behind `host`, and the GPU block behind `trees`
    block: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None  # recorded after the copy `queue` queues
    released: threading.Event = field(default_factory=threading.Event)  # set by the watch before it rings
    excused: set[str] = field(default_factory=set)  # rows verified without the drafter's tree
    answered: list[str] = field(default_factory=list)  # sessions that got a tree (valid or not)
    errors: dict[str, str] = field(default_factory=dict)  # drafter-side refusals: sid -> "CODE: message"
    refused: dict[str, str] = field(default_factory=dict)  # trees not taken on the host: sid -> why
    problem: str | None = None  # why no answer was taken at all (the stream is then unusable)
    compute_us: int = 0  # the drafter's own time, as it reported it
    t_answer: float = 0.0  # perf_counter when the answer was taken
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rung: bool = False

    def deliver(self, msg: drafter_pb2.DraftTrees) -> None:
        """The stream's answer to this step (reader thread): trees into their rows, then the bell. A wrong answer
        rings it too, with every row root-only and `problem` said."""
        with self._lock:
            if self._rung or self.released.is_set():
                return  # released already: the step runs (or ran) without it
            self.t_answer = time.perf_counter()
            try:
                self._take(msg)
            except WireError as e:
                root_only(self.host, self.roots)
                self.problem = str(e)
                self.excused.update(self.ids)
            self._ring()

    def release(self, reason: str) -> None:
        """Ring without an answer (the stream broke, or the client closed): every row stays root-only."""
        with self._lock:
            if self._rung:
                return
            self.problem = reason
            self.excused.update(self.ids)
            self._ring()

    def queue(self, stream: torch.cuda.Stream) -> None:
        """On the engine's stream: the wait for this step's bell, and behind it the copy of the landed trees to the
        GPU (`trees`). Whenever the engine takes the trees: the answer may have landed already (the wait then passes
        at once), and nothing of the engine's queued before stands behind a wait it does not need."""
        self.bell.wait(self.value, stream)
        self.block.copy_(self.pinned, non_blocking=True)
        self.copied.record(stream)

    def settled(self) -> bool:
        """Whether the bell has been rung by us (the watch rings it without telling: see `released`)."""
        return self._rung

    def _ring(self) -> None:
        self._rung = True
        self.bell.ring(self.value)

    def _take(self, msg: drafter_pb2.DraftTrees) -> None:
        decoded = inline_trees(msg)  # the usual bytes answer, numpy alone
        if decoded is None:  # any other layout: the general decoder (it names what is wrong)
            ids, trees = trees_from_pb(msg)
            decoded = ids, trees.n_nodes, trees.pack().numpy() if ids else None
        ids, n_nodes, packed = decoded  # packed: [6, R', M'] int32
        host_timeline.mark("answer_decoded")
        errors = answer_errors(msg, ids, self.ids)
        self.errors, self.answered, self.compute_us = errors, ids, msg.compute_us
        self.excused.update(errors)
        if not ids:
            return
        if ids == self.ids and n_nodes == self.caps and packed.shape == self.host.shape \
                and min(self.caps) == packed.shape[2]:
            self.host[...] = packed  # the usual answer (every row, in order, full width): the loop below in one copy
            return
        row = {sid: r for r, sid in enumerate(self.ids)}
        for j, sid in enumerate(ids):
            r, n = row[sid], n_nodes[j]
            if n != self.caps[r] or n > packed.shape[2]:
                self.refused[sid] = (f"n_nodes {n}, expected a full tree of {self.caps[r]} nodes"
                                     if n != self.caps[r] else f"n_nodes {n} but the arrays have {packed.shape[2]}")
                self.excused.add(sid)
                continue
            self.host[:, r, :n] = packed[:, j, :n]  # past n: the root-only fill's padding


class TreeLandings:
    """Per-client landing places for trees that came as bytes: per (R, M), [6, R, M] int32 in pinned host memory and
    on the engine's GPU, reused step after step at the same addresses (so the tree check replays from a CUDA graph
    keyed by the address, as it does for a co-located stream's region). Both are reused only after the copy that
    read the pinned one has run (its step has been read back since)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = {}

    def _place(self, R: int, M: int) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        buf = self._bufs.get((R, M))
        if buf is None:
            if len(self._bufs) >= MAX_SHAPES:
                self._bufs.clear()
            buf = self._bufs[(R, M)] = (torch.empty(6, R, M, dtype=torch.int32, pin_memory=True),
                                        torch.empty(6, R, M, dtype=torch.int32, device=self.device),
                                        torch.cuda.Event())
        buf[2].synchronize()  # the copy that read it last ran long ago
        return buf

    def put(self, trees: TreeBatch) -> TreeBatch:
        """Trees on the host (decoded from bytes) -> the same at their shape's place on the GPU: one copy queued
        now, no host wait."""
        host, dev, copied = self._place(*trees.tokens.shape)
        torch.stack([trees.tokens, trees.parent, trees.depth, trees.first_child, trees.next_sibling,
                     trees.logw.view(torch.int32)], out=host)
        dev.copy_(host, non_blocking=True)
        copied.record(torch.cuda.current_stream(self.device))
        return TreeBatch.from_packed(dev, trees.n_nodes)

    def prepare(self, step_id: int, ids: list[str], roots: list[int], caps: list[int], bell: HostBell,
                value: int) -> Landing:
        """Root-only trees for the step's rows, where the reader may land the answer from now on; the GPU part (the
        wait for `value` and the copy behind it) is `Landing.queue`'s."""
        host, dev, copied = self._place(len(ids), max(caps))
        host_np = host.numpy()
        root_only(host_np, roots)
        return Landing(step_id, list(ids), list(roots), list(caps), host_np, TreeBatch.from_packed(dev, list(caps)),
                       bell, value, host, dev, copied)
