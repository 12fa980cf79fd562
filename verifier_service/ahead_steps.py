"""The stream client's ahead steps (a mixin of `verifier_service.transport_stream.DraftStreamClient`): the next step's
request sent before the engine has read its step back (`EngineConfig.draft_ahead`, `verifier_service.draft_ahead`).

The engine hands over device values right after its acceptance: each session's candidate context rows (its accepted
path's taps), and how many are committed, the next root and its position. They go into the request region behind the
request event (`DraftStep.ahead_values`), with the step's message, while the verifier's GPU still works: the drafter
polls the event and drafts at once, so its GPU work follows the acceptance without the host round trip in between.
Once the engine has read its step, it tells the counts (`advance` -> `AheadCommitted`, which the drafter needs before
any other message about these sessions) and later takes the step's trees (or lets them go) through `_ahead_begin`,
which waits for them as any step's (in place behind the doorbell, or the answer). Only co-located streams whose
drafter announced `DrafterInfo.draft_ahead`, and only for sessions the stream already holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter_service.api import DraftRequest
from kernels.tree_build import TreeBatch, tree_size
from protos.codec import DTYPE_TO_PB
from protos.ddtree.v1 import drafter_pb2
from protos.shared_region import RegionArena
from verifier_service.draft_call import DraftCall, StreamBroken
from verifier_service.queued_steps import REQUEST_REGION, RESPONSE_REGION
from verifier_service.tree_assembly import assemble_trees


@dataclass
class AheadStep:
    """An ahead step on the wire, until the engine takes (or drops) its trees."""

    stream: DraftCall
    step_id: int
    sids: list[str]
    starts: list[int]  # where each session's candidate rows start
    rows: torch.Tensor  # [S, P, F] the candidate rows (the committed ones stay pending until the drafter answers)
    caps: list[int]
    width: int  # trees in place: the block's width (0: answered)
    t_sent: float
    deadline: float
    bell_value: int = 0  # the doorbell value its trees ring (0: no doorbell)
    counts: list[int] | None = None  # the committed rows, once the engine has read its step (`advance`)
    held: bool = False  # a wait for its ring is queued and watched already (`hold_for_ahead`)


class AheadSteps:
    """Ahead steps of a `DraftStreamClient` (whose attributes and helpers these methods use)."""

    @property
    def drafts_ahead(self) -> bool:
        """Whether the open stream takes ahead steps (the engine then offers them)."""
        s = self._stream
        return s is not None and not s.broken and s.draft_ahead

    def draft_ahead(self, sids: list[str], starts: list[int], rows: torch.Tensor, values: torch.Tensor, budget: int,
                    topk: int, projected: bool) -> Callable[[list[DraftRequest]], Callable[[], TreeBatch]] | None:
        """Send the next step now, its counts, roots and positions still on the GPU (`Drafter.draft_ahead`'s
        arguments) -> the function that takes its trees (`_ahead_begin`), or None when it cannot go ahead (no ahead
        stream, a session the stream does not hold, no room in the region, the send failed): the engine then asks the
        usual way."""
        s = self._stream
        if (s is None or s.broken or not s.draft_ahead or self._ahead is not None
                or any(sid not in s.synced for sid in sids)):
            return None
        S, P, F = rows.shape
        arena = RegionArena(s.regions[REQUEST_REGION])
        at_rows = arena.place_rows([rows.reshape(S * P, F)])
        at_values = arena.place_block(values.long().contiguous())
        if at_rows is None or at_values is None:
            return None
        caps = [tree_size(budget, topk, self.depth)] * S
        plan, response = s.in_place, s.regions.get(RESPONSE_REGION)
        width = plan.width(caps, response.nbytes) if plan is not None and response is not None else 0
        s.step_id += 1
        msg = drafter_pb2.DraftStreamRequest()
        step = msg.step
        step.step_id = s.step_id
        if width:
            step.trees_in_place = width
        for field, offset, dtype, shape in ((step.ctx_features, at_rows, rows.dtype, (S * P, F)),
                                            (step.ahead_values, at_values, torch.int64, (3, S))):
            field.dtype, field.region.region_id, field.region.offset = DTYPE_TO_PB[dtype], REQUEST_REGION, offset
            field.shape.extend(shape)
        step.sessions.extend(drafter_pb2.SessionDraftRequest(session_id=sid, ctx_start=start, budget=budget,
                                                             topk=topk, ctx_rows=P) for sid, start in zip(sids, starts))
        try:
            t_sent = self._hand_over_and_send(s, msg, arena)
        except StreamBroken as e:
            self._step_failed(s, e, S)
            return None
        self._ahead = AheadStep(s, s.step_id, list(sids), list(starts), rows, caps, width, t_sent,
                                time.monotonic() + self.cfg.draft_timeout_s, s.bell_value if s.doorbell else 0)
        return self._ahead_begin

    def wait_ahead(self) -> None:
        """Until the ahead step on the wire has its trees written (its doorbell rung; bounded by its deadline): for a
        benchmark that times each step with the drafter's GPU work it queued. A no-op without a doorbell. A GPU
        doorbell is waited for as a step waits (on the GPU, `Doorbell.wait_host`), never by reading it in a loop:
        each read is work of our context that the GPU time-slices with the drafter's."""
        a = self._ahead
        if a is None or not a.bell_value or self._watch is None:
            return
        if not self._watch.bell.wait_host(a.bell_value, max(0.0, a.deadline - time.monotonic()),
                                          abort=lambda: a.stream.broken):
            # what the watch does at a step's deadline: the wait released unless rung by now, the stream dropped
            self._watch.arm(a.stream, a.bell_value, time.monotonic(), a.stream.released)

    def hold_for_ahead(self) -> None:
        """Queue on the current stream a wait for the ahead step's ring, watched until its deadline (the watch rings it
        if the drafter never does), before the engine's next step queues any GPU work (`EngineConfig.ahead_gpu_wait`):
        work of ours queued while the drafter's GPU works is run by a switch of the GPU to our context mid-draft. The
        previous step's wait has been read back: its watch goes. A no-op without a GPU doorbell."""
        a = self._ahead
        if a is None or a.held or not a.bell_value or self._watch is None or a.stream.broken \
                or a.stream is not self._stream:
            return
        # what the trees' taking reads of the last step first (its checks' verdicts: a read on the current stream,
        # which would otherwise wait behind the wait queued here for the whole draft)
        self._settle()
        self._collect_verdicts()
        self._watch.disarm()
        self._watch.bell.wait(a.bell_value)
        self._watch.arm(a.stream, a.bell_value, a.deadline, a.stream.released)
        a.held = True

    def advance(self, sids: list[str], counts: list[int]) -> None:
        """The engine has read its step: the ahead step's committed row counts (what its GPU computed), told to the
        drafter when the step is taken (`AheadCommitted`, with the traceparents of the steps that verify its trees)."""
        a = self._ahead
        if a is None or a.sids != list(sids) or a.counts is not None:
            raise RuntimeError("advance() without the ahead step it counts")
        a.counts = list(counts)

    def _ahead_begin(self, requests: list[DraftRequest]) -> Callable[[], TreeBatch]:
        """The ahead step's trees for `requests` (its sessions in its order, with their roots, now known, and the
        traceparents of the steps that verify them: the drafter's spans go there) -> a function returning them, as
        `draft_begin`'s: the counts go to the drafter, the last step's answer is settled, the committed rows stay
        pending until the drafter answers (a new stream gets them), and a broken stream gives root-only trees."""
        a, self._ahead = self._ahead, None
        if a is None or a.counts is None or [r.session_id for r in requests] != a.sids:
            raise RuntimeError("an ahead step taken without its counts or with other sessions")
        if not a.stream.broken:  # before any other message about these sessions
            try:
                a.stream.send(drafter_pb2.DraftStreamRequest(ahead_committed=drafter_pb2.AheadCommitted(
                    step_id=a.step_id, rows=a.counts, traceparents=[r.traceparent for r in requests])))
            except StreamBroken:
                pass  # answered below as a broken stream
        self._settle()
        self._collect_verdicts()
        if self._watch is not None and not a.held:  # a held step's own wait stays watched
            self._watch.disarm()
        for r, start, rows, k in zip(requests, a.starts, a.rows, a.counts):
            self._pending.queue(DraftRequest(r.session_id, start, rows[:k], r.root_token, r.root_pos, r.budget,
                                             r.topk))
        self.stats["steps"] += 1
        self.stats["ahead_steps"] += 1
        s = a.stream
        if s.broken or s is not self._stream:
            self.stats["fallback_steps"] += 1
            self.metrics.record_fallback("stream_broken", len(requests))
            return lambda: assemble_trees(requests)
        if a.width:
            return self._queue_in_place(s, requests, a.caps, a.width, a.t_sent, a.deadline)
        self._checker.expect(a.sids, [r.root_token for r in requests], a.caps, self._device)

        def trees() -> TreeBatch:
            out = self._draft_end(s, requests, a.caps, a.t_sent, a.deadline)
            # its request left before the engine's own step was read back: no round trip or transport to tell
            self.last_step_ms.pop("round_trip", None)
            self.last_step_ms.pop("transport", None)
            return out

        return trees
