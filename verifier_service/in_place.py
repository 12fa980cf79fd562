"""Co-located steps whose trees are written where the verifier laid them out (DraftStep.trees_in_place).

Such a step's check and verify step are queued behind the trees doorbell right after the request leaves; the
answer is read once the step is back (`DraftStreamClient._settle_in_place`). That wins where the drafter's GPU step
is shorter than its answer's way back (kimi-mini on the H200) and loses ~0.1-0.2 ms where it is longer (K2.6 shapes:
our waiting stream delays the drafter's context on the GPU; docs/performance.md, nineteenth session). `InPlacePlan`
decides per step: "on" always, "auto" while the drafter's ring is seen to beat its decoded answer, with an answered
step now and then to look again. A stream's first step is always answered: it runs every kernel of the check
before any wait (a first launch behind a wait stalls, and in one process hangs).

Looking at the ring is a host wait for a read of the doorbell on the GPU while the drafter's kernels run there: on an
H200 at K2.6 shapes, "auto" (which never went in place there) measured 0.05-0.19 ms a step slower than "off", its
check 0.13-0.17 ms longer (the thirty-eighth session). So "auto" looks at the first VOTES answered steps, then at one
in OBSERVE_EVERY, and at every probe from in-place steps.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

VOTES = 4  # "auto": the answered steps remembered
QUORUM = 3  # "auto": in place once this many of them found the drafter's ring rung already
PROBE_EVERY = 16  # "auto", in place: one step in this many + 1 is answered, to see whether that still holds
OBSERVE_EVERY = 8  # "auto", answered steps after the first VOTES: the ring is looked at in one of this many
BLOCK_FIELDS = 6  # the block is [6, R, width] int32 (TreeBatch._FIELDS)


class InPlacePlan:
    """One stream's (whose drafter writes trees in place and rings the doorbell): mode "on" or "auto"."""

    def __init__(self, mode: str):
        self.mode = mode
        self.ready = False  # one answered step's trees came through the region (the check's kernels have run)
        self.ring_first: collections.deque[bool] = collections.deque(maxlen=VOTES)
        self.since_probe = 0  # in-place steps since the last answered one ("auto")
        self.answered = 0  # answered steps asked whether to look at the ring ("auto": `looks`)
        self.probing = False  # the next answered step is a probe from in-place steps: it looks

    def width(self, caps: Sequence[int], region_nbytes: int) -> int:
        """The step's block width (its largest tree), or 0: answer this step (not ready, no room for the block in
        the response region, or "auto" says so)."""
        if not self.ready or not caps:
            return 0
        width = max(caps)
        if BLOCK_FIELDS * len(caps) * width * 4 > region_nbytes:
            return 0
        if self.mode == "auto":
            if sum(self.ring_first) < QUORUM:
                return 0
            self.since_probe += 1
            if self.since_probe > PROBE_EVERY:
                self.since_probe = 0
                self.probing = True
                return 0
        return width

    def looks(self) -> bool:
        """An answered step ("auto"): whether to look at the ring for it (then `observe` what was seen)."""
        self.answered += 1
        probe, self.probing = self.probing, False
        return probe or self.answered <= VOTES or self.answered % OBSERVE_EVERY == 0

    def observe(self, rung: bool) -> bool:
        """An answered step: whether the drafter had rung by the time its answer was decoded and checked ("auto"
        only; -> rung)."""
        self.ring_first.append(rung)
        return rung


@dataclass
class InPlaceStep:
    """An in-place step queued on the GPU whose answer has not been read yet."""
    stream: object  # the DraftCall it went out on
    ids: list[str]  # the step's sessions, in request (row) order
    caps: list[int]
    excused: set[str]  # the check's rows whose verdicts fail no session (filled in when the answer is read)
    t_sent: float
    deadline: float
    check_ms: float
    step_id: int  # its DraftStep's (the stream's last one may be a later, ahead step)
