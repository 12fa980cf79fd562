"""The stream client's steps whose verify work is queued before the drafter's answer is read (a mixin of
`verifier_service.transport_stream.DraftStreamClient`, which owns the stream, its regions and the answered steps).

- Landed steps (gRPC bytes to a GPU): the verify step is queued as soon as the request leaves, behind a host doorbell
  that the stream's reader thread rings once it has put the answer's trees in pinned memory
  (`verifier_service.tree_landing`); until then the trees are root-only placeholders, checked after the landing.
- In-place steps (co-located with the trees doorbell, `DraftStep.trees_in_place`): the drafter writes the trees where
  the verifier laid them out, so the doorbell's wait, their check and the verify step are queued right after the
  request (`verifier_service.in_place` decides when).

Both read the answer only once the step has been read back (`_settle`): the drafter's refusals, the timings, and a
missing or wrong answer, which fails that step's sessions to an autoregressive step and drops the stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from drafter_service.api import DraftRequest
from drafter_service.device_copy import host_to_device
from kernels.tree_build import TreeBatch
from protos.codec import WireError, answer_errors
from protos.doorbell import HostBell, host_supported
from protos.doorbell_watch import DoorbellWatch
from verifier_service.draft_call import DraftCall, DraftTimeout, StreamBroken
from verifier_service.in_place import BLOCK_FIELDS, InPlaceStep
from verifier_service.tree_assembly import assemble_trees

log = logging.getLogger(__name__)
REQUEST_REGION = 1  # the stream's request region (`transport_stream`): a step's context rows and ahead values
RESPONSE_REGION = 2  # the stream's response region: in-place trees sit at its start


class QueuedSteps:
    """Landed and in-place steps of a `DraftStreamClient` (whose attributes and helpers these methods use)."""

    def _landing_watch(self, s: DraftCall) -> DoorbellWatch | None:
        """The host doorbell's watch when this stream's trees land in a pre-queued step (gRPC bytes to a GPU
        that passes the self-test; made on first use), else None."""
        if not self._use_landing or s.regions or self._device.type != "cuda":
            return None
        if self._watch is None:
            if not host_supported(self._device):
                self._use_landing = False
                log.warning("no host doorbell on %s: trees from the drafter are waited for on the host", self._device)
                return None
            self._watch = DoorbellWatch(HostBell(self._device), self._bell_expired)
        return self._watch

    def _queue_landing(self, s: DraftCall, watch: DoorbellWatch, requests: list[DraftRequest], caps: list[int],
                       t_sent: float, deadline: float) -> Callable[[], TreeBatch]:
        """A landing for the step's trees (root-only until the answer lands; the watch keeps its deadline) -> a
        function (called once) that queues them behind the host doorbell, their check behind that, and returns them:
        the engine queues its verify step with no wait for the drafter. Until it is called nothing waits on our GPU
        (a step asked early, `draft_ahead.ask_early`, is taken by the next step), and this step is not yet the
        stream's last to settle."""
        ids, roots = [r.session_id for r in requests], [r.root_token for r in requests]
        self._bell_value += 1
        landing = self._landings.prepare(s.step_id, ids, roots, caps, watch.bell, self._bell_value)
        s.land(landing)
        watch.arm(s, landing.value, deadline, landing.released)
        self.stats["landed_steps"] += 1

        def trees() -> TreeBatch:
            self._checker.expect(ids, roots, caps, self._device)  # before the wait: nothing of it waits behind it
            landing.queue(torch.cuda.current_stream(self._device))
            t0 = time.perf_counter()
            checked, _ = self._checker.check(ids, landing.trees, roots, caps, fixed=True, void=landing.released,
                                             excused=landing.excused)
            self._landed = (s, landing, t_sent, (time.perf_counter() - t0) * 1e3)  # timed once it has landed
            return assemble_trees(requests, ids, checked, set(ids))

        return trees

    def _settle(self) -> None:
        """After a landing or in-place step was read back: what its answer said (or why there was none) -> the
        stream's bookkeeping, errors, metrics and the step's timings, as `_draft_end` does for the other paths."""
        if self._in_flight is not None:
            self._settle_in_place()
        if self._landed is None:
            return
        (s, landing, t_sent, check_ms), self._landed = self._landed, None
        n = len(landing.ids)
        if not landing.settled() or landing.released.is_set():  # the watch rang it: no answer in time
            self._step_failed(s, DraftTimeout(f"step {landing.step_id}: no answer within the deadline"), n)
            return
        if landing.problem is not None:
            self._step_failed(s, StreamBroken(landing.problem), n)
            return
        self._acknowledge(s, landing.answered, landing.errors)
        self._invalid(landing.refused)
        self._time_step(landing.compute_us, t_sent, landing.t_answer, landing.t_answer)
        self.last_step_ms["check"] = check_ms  # queued before the answer came: its host time only

    def _queue_in_place(self, s: DraftCall, requests: list[DraftRequest], caps: list[int], width: int, t_sent: float,
                        deadline: float) -> Callable[[], TreeBatch]:
        """A step whose trees the drafter writes where we asked (DraftStep.trees_in_place): -> a function that queues
        the doorbell's wait, the check of the region's block and (the caller) the verify step behind it, with no
        wait for the answer, which `_settle_in_place` reads once the step is back. Every row is laid out as a full
        tree (its cap): a session the drafter refuses has an all -1 row, which the check turns into an
        autoregressive step; its verdict is excused when the answer says so."""
        ids, roots = [r.session_id for r in requests], [r.root_token for r in requests]
        self._checker.expect(ids, roots, caps, self._device)  # queued before the wait: nothing of it waits behind it
        R = len(requests)
        block = s.regions[RESPONSE_REGION].view(0, BLOCK_FIELDS * R * width * 4).view(torch.int32).view(
            BLOCK_FIELDS, R, width)
        region_trees = TreeBatch.from_packed(block, caps)

        def trees() -> TreeBatch:
            if s.broken:  # it broke since the request left: no ring will come
                self._step_failed(s, StreamBroken(f"step {s.step_id}: the stream broke"), R)
                return assemble_trees(requests)
            self._watch.bell.wait(s.bell_value)
            self._watch.arm(s, s.bell_value, deadline, s.released)
            self.stats["doorbell_steps"] += 1
            self.stats["in_place_steps"] += 1
            self.stats["region_trees"] += 1
            t0 = time.perf_counter()
            excused: set[str] = set()
            safe, refused = self._checker.check(ids, region_trees, roots, caps, fixed=True, void=s.released,
                                                excused=excused)
            self._in_flight = InPlaceStep(s, ids, caps, excused, t_sent, deadline, (time.perf_counter() - t0) * 1e3,
                                          s.step_id)
            return assemble_trees(requests, ids, safe, set(ids) - set(refused))

        return trees

    def _settle_in_place(self) -> None:
        """An in-place step has been read back: its answer (there by now: the drafter sends it before its GPU work
        is done) -> which sessions got a tree, the drafter's refusals (their rows' verdicts excused), the timings."""
        f, self._in_flight = self._in_flight, None
        s, n = f.stream, len(f.ids)
        if f.stream.released.is_set():  # the watch released our wait: no ring in time, the stream was dropped
            self._step_failed(s, DraftTimeout(f"step {s.step_id}: no ring within the deadline"), n)
            return
        try:
            answer, _ = self._answer(s, f.deadline, f.step_id)  # an ahead step may have gone out since
            answered = list(answer.session_ids)
            if not answer.in_place or len(answer.n_nodes) != len(answered):
                raise WireError(f"step {s.step_id}: the answer is not the in-place block the step asked for")
            errors = answer_errors(answer, answered, f.ids)
        except Exception as e:  # noqa: BLE001 - the step ran on the region's block: only its verdicts are doubtful
            f.excused.update(f.ids)
            self._step_failed(s, e, n)
            return
        cap = dict(zip(f.ids, f.caps))
        refused = {sid: f"n_nodes {k}, expected a full tree of {cap[sid]} nodes"
                   for sid, k in zip(answered, answer.n_nodes) if k != cap[sid]}
        f.excused.update(errors)  # their rows are all -1: the check refused them, which is not their fault
        f.excused.update(refused)  # told below, once
        self._acknowledge(s, answered, errors)
        self._invalid(refused)
        # the answer was read after the step, so its round trip is not known: the drafter's own time and the check's
        self.last_step_ms = {"drafter": answer.compute_us * 1e-3, "check": f.check_ms}

    def _land(self, trees: TreeBatch) -> tuple[TreeBatch, bool]:
        """Trees decoded from bytes (host) -> (the same on the engine's device, whether they sit at a fixed place:
        on a GPU, `TreeLandings.put`). Trees already there (from a region on it) are returned as they are."""
        if trees.tokens.device == self._device:
            return trees, False
        if self._landings is None:
            return TreeBatch.from_packed(host_to_device(trees.pack(), self._device), trees.n_nodes), False
        return self._landings.put(trees), True
