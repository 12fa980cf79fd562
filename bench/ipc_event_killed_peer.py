"""Does a CUDA stream that waits (cudaStreamWaitEvent) on a peer's IPC event hang when the peer dies first?

    python bench/ipc_event_killed_peer.py      # one GPU; prints one line per trial, exit 3 when wedged

A child process queues a kernel, records an IPC event after it and sends the handle; this process puts
a wait on that event on its stream, then a small kernel and an event of its own, kills the child and
polls its own event for 20 s. Trial 1: the child's kernel (~1 ms) is done before the kill. Trial 2: the
child is killed in the middle of a ~10 s kernel. Measured on an H200 (2026-11-30,
bench/results/ipc_event_killed_peer.log): trial 2's stream was still waiting 20 s after the kill. This
is why `protos.shared_region.IpcEvent` is polled on the host with a deadline and never waited on a stream.
The process exits without synchronising when wedged (a synchronize would never return).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

CHILD = r'''
import sys, time, torch
ev = torch.cuda.Event(interprocess=True)
torch.cuda._sleep(int(sys.argv[1]))  # a long kernel queued before the record
ev.record()
sys.stdout.write(bytes(ev.ipc_handle()).hex() + "\n")
sys.stdout.flush()
time.sleep(100)
'''


def trial(cycles: int, kill_after_s: float) -> bool:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(cycles)], stdout=subprocess.PIPE, text=True)
    event = torch.cuda.Event.from_ipc_handle(0, bytes.fromhex(child.stdout.readline().strip()))
    x = torch.zeros(1, device="cuda")
    torch.cuda.current_stream().wait_event(event)
    x.add_(1)
    done = torch.cuda.Event()
    done.record()
    time.sleep(kill_after_s)
    child.send_signal(signal.SIGKILL)
    child.wait()
    t0 = time.monotonic()
    while not done.query() and time.monotonic() - t0 < 20:
        time.sleep(0.01)
    ok = done.query()
    print(f"cycles {cycles} killed after {kill_after_s}s: our stream {'completed' if ok else 'STILL WAITING'} "
          f"{time.monotonic() - t0:.2f}s after the kill", flush=True)
    return ok


def main() -> int:
    torch.cuda.init()
    trial(2_000_000, 0.5)
    if not trial(20_000_000_000, 0.5):
        print("stream wedged; exiting without synchronize", flush=True)
        os._exit(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
