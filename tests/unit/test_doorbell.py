"""The trees doorbell (`protos.doorbell`) and its deadline (`protos.doorbell_watch`).

On the GPU, across two processes: a stream waiting on the doorbell runs its later work only once the
peer's stream has rung it, and sees what the peer wrote before ringing; a peer that never rings (alive,
then killed) leaves our stream blocked until we release it ourselves, which the watch does at the
deadline. Without
a GPU: the watch's decisions (release at the deadline unless rung or disarmed, release at once when the
stream breaks, mark the released step) and the verdicts of a released step being dropped.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kernels.tree_build import TreeBatch
from protos.doorbell import NBYTES, Doorbell, HostBell, host_supported, poll_until, reached, supported
from protos.doorbell_watch import DoorbellWatch
from protos.shared_region import RegionArena, SharedRegion
from verifier_service.tree_verdicts import TreeChecker

ROOT = Path(__file__).resolve().parents[2]


class _FakeBell:
    """The counter on the host: what the watch needs of a Doorbell (read, release)."""

    def __init__(self):
        self.value, self.releases = 0, []

    def read(self) -> int:
        return self.value

    def release(self, value: int) -> None:
        self.releases.append(value)
        self.value = max(self.value, value)


def _watch():
    expired = []
    bell = _FakeBell()
    return DoorbellWatch(bell, expired.append), bell, expired


def _until(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.005)


def test_watch_releases_an_unrung_wait_at_its_deadline_and_reports_it():
    watch, bell, expired = _watch()
    released = threading.Event()
    owner = object()
    try:
        t0 = time.monotonic()
        watch.arm(owner, 7, t0 + 0.15, released)
        _until(lambda: expired)
        assert time.monotonic() - t0 >= 0.15
        assert bell.releases == [7] and released.is_set() and expired == [owner]
        assert not watch.release(owner)  # nothing armed any more
    finally:
        watch.close()


def test_watch_leaves_a_rung_or_disarmed_wait_alone():
    watch, bell, expired = _watch()
    try:
        rung = threading.Event()
        bell.value = 3  # the peer rang 3 (and so everything before it)
        watch.arm("s", 3, time.monotonic() + 0.05, rung)
        time.sleep(0.2)
        assert not rung.is_set() and bell.releases == [] and expired == []
        disarmed = threading.Event()
        watch.arm("s", 4, time.monotonic() + 0.1, disarmed)
        watch.disarm()  # the step was read back: the wait is behind us
        time.sleep(0.25)
        assert not disarmed.is_set() and bell.releases == [] and expired == []
    finally:
        watch.close()


def test_watch_releases_at_once_for_a_broken_stream_and_on_close():
    watch, bell, expired = _watch()
    a, b = threading.Event(), threading.Event()
    watch.arm("stream-1", 5, time.monotonic() + 60, a)
    assert not watch.release("stream-2")  # another stream's break: not ours to release
    assert watch.release("stream-1") and a.is_set() and bell.releases == [5]
    rung = threading.Event()
    watch.arm("stream-1", 6, time.monotonic() + 60, rung)
    bell.value = 6  # the drafter rang before its stream broke: that step's trees (and verdicts) stand
    assert watch.release("stream-1") and not rung.is_set() and bell.releases == [5]
    watch.arm("stream-2", 7, time.monotonic() + 60, b)
    watch.close()  # nothing stays blocked behind a closed client
    assert b.is_set() and bell.releases == [5, 7] and expired == []


def test_verdicts_of_a_released_step_are_dropped():
    """A released step's trees were read before the drafter wrote them: failures there are not the drafter's
    and must fail no session; the same failure in a step that was not released is reported."""
    checker = TreeChecker(vocab_size=100, max_depth=4)

    def bad_tree():
        i32 = torch.int32
        tokens = torch.tensor([[5, 1000]], dtype=i32)  # a token outside the vocabulary
        return TreeBatch(tokens, torch.tensor([[-1, 0]], dtype=i32), torch.tensor([[0, 1]], dtype=i32),
                         torch.tensor([[1, -1]], dtype=i32), torch.tensor([[-1, -1]], dtype=i32),
                         torch.tensor([[0.0, -1.0]]), [2])

    void = threading.Event()
    checker.check(["a"], bad_tree(), [5], [2], void=void)
    void.set()
    checker.check(["b"], bad_tree(), [5], [2], void=threading.Event())
    got = checker.verdicts()
    assert set(got) == {"b"} and "vocab" in got["b"]


def test_cyclic_comparison_of_counter_and_value():
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    assert reached(2, (1 << 32) - 3) and not reached((1 << 32) - 3, 2)  # across the wrap


def test_poll_until_a_condition_its_timeout_or_an_abort():
    calls = iter([False, False, True])
    assert poll_until(lambda: next(calls), 5.0)
    t0 = time.monotonic()
    assert not poll_until(lambda: False, 0.05) and time.monotonic() - t0 >= 0.05
    t0 = time.monotonic()
    assert not poll_until(lambda: False, 30.0, abort=lambda: True) and time.monotonic() - t0 < 5.0


def test_no_doorbell_without_a_gpu():
    assert not supported(torch.device("cpu"))
    with pytest.raises(ValueError, match="4 aligned bytes of GPU memory"):
        Doorbell(torch.zeros(8, dtype=torch.uint8))


CHILD_RING = """
import sys, time, torch
from protos.ddtree.v1 import drafter_pb2
from protos.doorbell import Doorbell
from protos.shared_region import SharedRegion
bell_region, data = (SharedRegion.attach(drafter_pb2.SharedRegion.FromString(bytes.fromhex(h))) for h in sys.argv[1:3])
cycles, value = int(sys.argv[3]), int(sys.argv[4])
bell = Doorbell(bell_region.buf)
torch.cuda._sleep(cycles)  # a long kernel: the data and the ring come after it
data.buf[:4].copy_(torch.arange(1, 5, dtype=torch.uint8, device=data.device))
if value:
    bell.ring(value)
print("queued", flush=True)
torch.cuda.synchronize()
time.sleep(60 if len(sys.argv) > 5 else 0)
"""


def _child(bell: SharedRegion, data: SharedRegion, cycles: int, value: int, linger: bool = False):
    args = [bell.to_pb().SerializeToString().hex(), data.to_pb().SerializeToString().hex(), str(cycles), str(value)]
    child = subprocess.Popen([sys.executable, "-c", CHILD_RING, *args, *(["linger"] if linger else [])],
                             stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    assert child.stdout.readline().strip() == "queued"
    return child


def _regions():
    """The counter's region and a region for the data, zeroed, on the GPU."""
    dev = torch.device("cuda", 0)
    bell_region, data = SharedRegion.create(3, NBYTES, dev), SharedRegion.create(1, 1 << 16, dev)
    bell_region.buf.zero_()
    data.buf.zero_()
    RegionArena(data).sync()
    return bell_region, data


def _bell(region: SharedRegion):
    """Our doorbell, ready to be released, and a stream of ours with its output allocated and the kernel the
    tests run behind a wait loaded: no kernel may load for the first time behind a wait (protos.doorbell)."""
    bell = Doorbell(region.buf)
    bell.prepare_release()
    ours = torch.cuda.Stream()
    with torch.cuda.stream(ours):
        out = torch.zeros(4, dtype=torch.uint8, device=region.device)
        out.add_(0)
    ours.synchronize()
    return bell, ours, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_wait_on_our_stream_runs_after_the_peer_rings_and_sees_its_writes():
    assert supported(torch.device("cuda", 0))
    bell_region, data = _regions()
    bell, ours, seen = _bell(bell_region)
    try:
        t0 = time.monotonic()
        bell.wait(1, ours)  # queued: the host goes on at once
        with torch.cuda.stream(ours):
            seen.copy_(data.buf[:4])
        assert time.monotonic() - t0 < 0.5
        child = _child(bell_region, data, 200_000_000, 1)  # ~0.1 s of sleep kernel, then data, then the ring
        ours.synchronize()
        assert seen.tolist() == [1, 2, 3, 4] and bell.read() == 1
        child.wait(60)
    finally:
        bell.close()
        data.close()
        bell_region.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_peer_that_never_rings_is_released_by_the_watch():
    """The peer queues its work but no ring (a drafter that hangs, then dies): our stream stays blocked behind
    the wait, while the peer lives and after it was killed, until the watch's deadline, when the watch rings it
    itself and reports the stream; then our stream runs on, and the GPU keeps serving us."""
    bell_region, data = _regions()
    bell, ours, after = _bell(bell_region)
    expired, released = [], threading.Event()
    watch = DoorbellWatch(bell, expired.append)
    child = _child(bell_region, data, 100_000_000, 0, linger=True)  # its kernel, then nothing rings
    try:
        bell.wait(1, ours)
        with torch.cuda.stream(ours):
            after.add_(2)
        time.sleep(0.3)
        assert not ours.query()  # blocked while the peer lives and does not ring
        child.kill()
        child.wait(30)
        time.sleep(0.3)
        assert not ours.query()  # and after it died: only we can release it now
        t0 = time.monotonic()
        watch.arm("stream", 1, t0 + 0.5, released)
        ours.synchronize()  # returns once the watch released the wait
        assert time.monotonic() - t0 >= 0.45 and released.is_set() and expired == ["stream"]
        assert after.tolist() == [2, 2, 2, 2] and bell.read() == 1
    finally:
        child.kill()
        watch.close()
        bell.close()
        data.close()
        bell_region.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_wait_host_returns_once_the_peer_rings_and_releases_itself_when_it_never_does():
    """`Doorbell.wait_host`: True once the peer's ring lands (not before: its kernel runs ~0.1 s first); False after
    its timeout when nothing rings, and False at once when `abort` says so, its wait left queued until we release
    the value (then a later wait for it passes at once, and a stream of ours runs on)."""
    bell_region, data = _regions()
    bell, ours, after = _bell(bell_region)
    try:
        child = _child(bell_region, data, 200_000_000, 1)
        assert bell.wait_host(1, 30.0)
        assert bell.read() == 1 and data.buf[:4].tolist() == [1, 2, 3, 4]
        child.wait(60)
        t0 = time.monotonic()
        assert not bell.wait_host(2, 0.3)  # nobody rings 2
        assert 0.25 <= time.monotonic() - t0 < 5.0 and bell.read() == 1
        bell.release(2)  # what the caller's watch does
        assert bell.wait_host(2, 5.0)  # nothing left blocked
        t0 = time.monotonic()
        assert not bell.wait_host(3, 30.0, abort=lambda: True)
        assert time.monotonic() - t0 < 5.0
        bell.release(3)
        assert bell.wait_host(3, 5.0)
        with torch.cuda.stream(ours):
            after.add_(1)
        ours.synchronize()
        assert after.tolist() == [1, 1, 1, 1]
    finally:
        bell.close()
        data.close()
        bell_region.close()


def test_host_doorbells_need_a_gpu():
    assert not host_supported(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="CUDA device"):
        HostBell(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_host_doorbell_holds_a_stream_until_the_host_rings_it():
    """A wait for a counter in pinned host memory holds its stream through smaller values (also across the 2^32
    wrap) and lets it go once the host stores the value; what the host stored before is what the copy behind the
    wait reads."""
    dev = torch.device("cuda", 0)
    assert host_supported(dev)
    bell = HostBell(dev)
    stream = torch.cuda.Stream(dev)
    staged = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    out = torch.full((4,), -1, dtype=torch.int32, device=dev)
    out.add_(0)  # every kernel used behind the wait is loaded first (see protos.doorbell)
    torch.cuda.synchronize()
    for start, value in ((0, 5), ((1 << 32) - 2, 1)):  # the second pair wraps around
        bell.ring(start)
        bell.wait(value, stream)
        with torch.cuda.stream(stream):
            out.copy_(staged, non_blocking=True)
            out.add_(0)
        time.sleep(0.05)
        bell.ring(start + 1 if start + 1 != value else start)  # still short of the value
        time.sleep(0.05)
        assert not stream.query()
        staged.copy_(torch.arange(4, dtype=torch.int32) + value)  # written before the store that rings
        bell.ring(value)
        stream.synchronize()
        assert out.tolist() == [value, value + 1, value + 2, value + 3] and bell.read() == value
    assert bell.wait_host(1, 0.1)  # rung already
    assert not bell.wait_host(2, 0.1) and not bell.wait_host(2, 30.0, abort=lambda: True)
    threading.Timer(0.1, bell.ring, (2,)).start()
    assert bell.wait_host(2, 30.0) and bell.read() == 2


@pytest.mark.parametrize("flag, expected, in_place, ahead, gpu_wait", [
    ([], True, "auto", True, True), (["--no-doorbell"], False, "auto", True, True),
    (["--trees-in-place", "on", "--ahead-gpu-wait", "off", "--no-request-doorbell"], True, "on", True, False),
    (["--draft-ahead", "off", "--commit-moves", "torch"], True, "auto", False, True)])
def test_verifier_serve_doorbell_flag_reaches_the_server_config(monkeypatch, flag, expected, in_place, ahead,
                                                               gpu_wait):
    """`ddtree verifier serve --no-doorbell` turns the doorbell off for the stream client (the operator's way
    back to the IPC-event path); by default it is on. `--trees-in-place` (auto by default) says when the drafter
    is asked for trees where the verifier lays them out; `--draft-ahead off` and `--ahead-gpu-wait off` reach the
    engine's config, `--no-request-doorbell` the stream client's."""
    from gateway.cli import build_parser
    from gateway.commands import verifier
    from verifier_service.server import _engine_config

    seen = []
    monkeypatch.setattr(verifier, "run_server", lambda serve, cfg, *a: seen.append(cfg) or 0)
    argv = ["verifier", "serve", "--listen", "127.0.0.1:0", "--target", "t", "--drafter-address", "127.0.0.1:1"]
    args = build_parser("verifier").parse_args([*argv, *flag])
    assert args.func(args) == 0 and seen[0].doorbell is expected and seen[0].trees_in_place == in_place
    assert seen[0].draft_ahead is ahead and _engine_config(seen[0], "cpu").draft_ahead is ahead
    assert _engine_config(seen[0], "cpu").ahead_gpu_wait is gpu_wait
    assert seen[0].request_doorbell is ("--no-request-doorbell" not in flag)
    assert _engine_config(seen[0], "cpu").commit_moves == ("auto" if ahead else "torch")
