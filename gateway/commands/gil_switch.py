"""The interpreter's GIL switch interval for the served processes (`--gil-switch-us`).

A thread that wants the GIL while another runs Python waits until the holder blocks, or, if it never does, for the
switch interval (CPython's default: 5 ms) before it may ask the holder to drop it. In a verifier with a remote
drafter that is the hand-off of every step: the engine thread sends a step (a queue put) and goes on launching its
verify step in Python, while gRPC's request thread needs the GIL to take the step out and serialize it; the reader
thread that lands the drafter's answer competes the same way. A shorter interval bounds those waits; it costs only
while two threads want the GIL at once. 0 leaves the interpreter's default.
"""

from __future__ import annotations

import sys


def set_gil_switch(us: float) -> float:
    """Set the switch interval to `us` microseconds (0: leave it) -> the interval in effect, in microseconds."""
    if us < 0:
        raise ValueError(f"--gil-switch-us must be >= 0, got {us}")
    if us:
        sys.setswitchinterval(us * 1e-6)
    return sys.getswitchinterval() * 1e6
