"""Host timestamps at the hand-offs of a remote draft step, in both processes: where the time between the verifier's
send and the drafter's first launch, and between the drafter's trees and the verifier's GPU, goes.

Off unless the environment names a file: `DDTREE_HOST_TIMELINE=FILE` in both processes (a verifier and its drafter on
one host; `bench_transport.py`'s drafter process inherits it from the bench). Each `mark(tag)` then records (pid, tag,
CLOCK_MONOTONIC ns), which both processes of one host share, with the thread's id and its CPU time so far
(CLOCK_THREAD_CPUTIME_ID ns): between two marks of one thread, CPU time well below the wall time means the thread
waited (for the GIL, or for a core), CPU time near it that its code ran slowly. Records are appended to FILE in
batches and at exit, one line each: `<pid> <tag> <ns> <tid> <cpu ns>`. `bench/host_timeline.py FILE` lines a step's
marks up and prints each hand-off's median. Off, `mark` is one global read and a return (~35 ns with the call, this
repo's CPU host); on, ~1 us (the clocks read, the record formatted and appended; a batch written every FLUSH_EVERY).

The marks of a step on the gRPC stream, in order (`MARKS`): the verifier's engine thread sends it (`step_sent`);
gRPC's request thread takes it from the queue (`step_out`); the drafter's event loop has read it (`step_in`); its
model part starts (`draft_begin`), has checked the sessions' requests (`draft_rows`) and has queued its GPU work
(`draft_queued`); the trees' host copy is seen done (`trees_copied`); the trees are encoded (`trees_encoded`), the
answer is ready (`answer_ready`) and handed to gRPC (`answer_sent`); the verifier's reader thread has it
(`answer_in`), has decoded it (`answer_decoded`) and has landed it, ringing the host doorbell its GPU waits on
(`answer_landed`), or the engine thread has taken it (`answer_taken`, without a landing). A co-located stream's steps
travel over its control socket: `step_sent`, `step_in` (the drafter's socket thread has it), `draft_begin` (after the
poll of the verifier's request event, on a GPU), `draft_rows`, `draft_queued`, `trees_encoded` (trees in the region,
the doorbell rung on the GPU), `answer_ready`, `answer_sent`, `answer_taken`. For diagnosis: the marks stay in the
code, costing next to nothing off.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

ENV = "DDTREE_HOST_TIMELINE"
MARKS = ("step_sent", "step_out", "step_in", "draft_begin", "draft_rows", "draft_queued", "trees_copied",
         "trees_encoded", "answer_ready", "answer_sent", "answer_in", "answer_decoded", "answer_landed", "answer_taken")
# the engine thread's marks off the hand-off chain, reported as their time after the step's `step_sent` (the first
# after it; while the drafter works, in no fixed order with its marks): the step's layout is queued (`layout_queued`),
# a stream client's check of the answered trees is queued (`trees_checked`), the drafter's trees are back in the engine
# (`trees_taken`) and in its [S, M] columns (`trees_in`: on the GPU, queued behind the drafter's answer), the forward's
# tree inputs are queued (`inputs_queued`), its forward is queued (`forward_queued`), the whole verify step is and the
# engine starts reading it back (`verify_queued`), the read is back (`verify_read`), the step returns (`step_done`)
SIDE_MARKS = ("layout_queued", "trees_checked", "trees_taken", "trees_in", "inputs_queued", "forward_queued",
              "verify_queued", "verify_read", "step_done")
# and reported as their time before the next step's `step_sent` (the last before it: another engine stepping in between
# comes first): the engine's next step starts (`step_begin`), it asks its drafter (`draft_asked`), the context rows are
# ready (`rows_ready`: projected, when the verifier projects them) and the step's message is built (`step_built`)
LEAD_MARKS = ("step_begin", "draft_asked", "rows_ready", "step_built")
FLUSH_EVERY = 256  # records held before an append to the file

_path: str | None = os.environ.get(ENV) or None
_records: list[str] = []
_lock = threading.Lock()


def mark(tag: str) -> None:
    """Record `tag` now (nothing when the timeline is off)."""
    if _path is None:
        return
    _records.append(f"{os.getpid()} {tag} {time.monotonic_ns()} {threading.get_native_id()} {time.thread_time_ns()}\n")
    if len(_records) >= FLUSH_EVERY:
        flush()


def flush() -> None:
    """Append the records held to the file (also at exit)."""
    global _records
    if _path is None:
        return
    with _lock:
        held, _records = _records, []
        if held:
            with open(_path, "a") as f:
                f.write("".join(held))


def enable(path: str | None) -> None:
    """Turn the timeline on (a file) or off (None) in this process; `ENV` sets it at import."""
    global _path
    flush()
    _path = path


atexit.register(flush)
