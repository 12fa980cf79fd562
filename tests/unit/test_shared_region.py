"""Shared regions and IPC events of the co-located transport (`protos.shared_region`), on their own.

Regions mapped by another process (a /dev/shm file, a CUDA IPC allocation found by GPU UUID), their
attach errors, the arena that packs a message's tensors, the CUDA handle's fields, and the IPC events
that each side polls (never waited on a stream: a dead peer's event would block it for good).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from protos.ddtree.v1 import drafter_pb2
from protos.shared_region import (
    _REBUILD_ARGS,
    IpcEvent,
    RegionArena,
    SharedRegion,
    _rebuild_arg_names,
    _region_pool,
    local_cuda_index,
)


def test_shared_region_is_shared_with_another_process():
    region = SharedRegion.create(1, 256)
    try:
        code = ("import sys; from protos.ddtree.v1 import drafter_pb2; from protos.shared_region import SharedRegion;"
                "r = SharedRegion.attach(drafter_pb2.SharedRegion.FromString(sys.stdin.buffer.read()));"
                "r.buf[:4] = r.buf[4:8] + 1")
        region.buf[4:8] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        subprocess.run([sys.executable, "-c", code], input=region.to_pb().SerializeToString(), check=True,
                       timeout=60)
        assert region.buf[:4].tolist() == [2, 3, 4, 5]
    finally:
        region.close()
    assert not region.path.exists()  # the owner removed the file


def test_shared_region_attach_errors(tmp_path):
    region = SharedRegion.create(1, 128)
    msg = region.to_pb()
    region.close()
    with pytest.raises(ValueError, match="same host"):
        SharedRegion.attach(msg)
    msg.shm_path = str(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="not a ddtree region"):
        SharedRegion.attach(msg)
    other = SharedRegion.create(2, 64)
    msg = other.to_pb()
    msg.nbytes = 128
    with pytest.raises(ValueError, match="expected 128"):
        SharedRegion.attach(msg)
    other.close()


def test_region_arena_packs_tensors_back_to_back():
    """place_many: one copy for tensors of one element size on the region's device, each readable at
    its own offset; a batch that does not fit goes tensor by tensor (the rest inline)."""
    from protos.codec import tensor_from_pb, tensor_to_pb

    region = SharedRegion.create(7, 4096)
    try:
        arena = RegionArena(region)
        ts = [torch.arange(6, dtype=torch.int32).view(2, 3), torch.full((4,), -2.5),
              torch.zeros(0, 5, dtype=torch.int32)]
        places = arena.place_many(ts)
        assert [p.offset for p in places] == [0, 24, 40] and arena.placed == 3 and arena.cursor == 40
        for t, where in zip(ts, places):
            assert torch.equal(tensor_from_pb(tensor_to_pb(t, where=where), "t", {7: region}), t)
        big = [torch.ones(600, dtype=torch.float32), torch.ones(600, dtype=torch.float32)]  # 4800 bytes together
        arena.reset()
        first, second = arena.place_many(big)
        assert first is not None and first.offset == 0 and second is None  # the first alone still fits
        mixed = arena.place_many([torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.int32)])
        assert [m.offset for m in mixed] == [2432, 2496]  # different element sizes: one by one, 64-byte aligned
        block = torch.arange(24, dtype=torch.int32).view(2, 3, 4)  # place_block: as it is, aligned, one copy
        assert arena.place_block(block) == 2560 and arena.cursor == 2656
        assert torch.equal(region.view(2560, 96).view(torch.int32).view(2, 3, 4), block)
        assert arena.place_block(block.transpose(1, 2)) is None  # not contiguous
        assert arena.place_block(torch.ones(400, dtype=torch.int32)) is None and arena.cursor == 2656  # too big
    finally:
        region.close()


def test_region_views_are_cached_per_slice_and_read_the_live_bytes(monkeypatch):
    """tensor_from_pb(copy=False, views=...): one view per (region, offset, dtype, shape), reused by later
    messages naming the same slice, reading what the region holds now; other slices get their own; the
    cache starts over when full; the checks still run for every message."""
    from protos import codec
    from protos.codec import WireError, tensor_from_pb, tensor_to_pb

    region = SharedRegion.create(3, 4096)
    try:
        arena, views = RegionArena(region), {}
        msg = tensor_to_pb(torch.arange(6, dtype=torch.float32).view(2, 3), arena=arena)
        a = tensor_from_pb(msg, "t", {3: region}, copy=False, views=views)
        arena.reset()
        msg2 = tensor_to_pb(torch.full((2, 3), 7.0), arena=arena)  # the next step's rows, same place
        b = tensor_from_pb(msg2, "t", {3: region}, copy=False, views=views)
        assert b is a and torch.equal(b, torch.full((2, 3), 7.0)) and len(views) == 1
        c = tensor_from_pb(tensor_to_pb(torch.ones(3, 2), arena=arena), "t", {3: region}, copy=False, views=views)
        assert c is not a and c.shape == (3, 2) and len(views) == 2
        d = tensor_from_pb(msg2, "t", {3: region}, copy=True, views=views)  # copy: a tensor of its own
        assert d is not a and torch.equal(d, a)
        msg2.region.offset = 4092  # out of bounds: refused although a view of this message was cached
        with pytest.raises(WireError, match="outside"):
            tensor_from_pb(msg2, "t", {3: region}, copy=False, views=views)
        monkeypatch.setattr(codec, "MAX_CACHED_VIEWS", 2)
        e = tensor_from_pb(tensor_to_pb(torch.ones(1), arena=arena), "t", {3: region}, copy=False, views=views)
        assert list(views.values()) == [e]
    finally:
        region.close()


def test_cuda_ipc_helpers_without_a_gpu():
    """What the CUDA path relies on, checked on every machine: torch's rebuild_cuda_tensor still takes
    the arguments this module fills in by name, and a GPU is found by UUID whatever its ordinal."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    assert sorted(_rebuild_arg_names(rebuild_cuda_tensor)) == sorted(_REBUILD_ARGS)
    with pytest.raises(RuntimeError, match="need updating"):
        _rebuild_arg_names(lambda tensor_cls, storage_handle: None)
    visible = ["7f6e5d4c-0000-1111-2222-333344445555", "0a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff"]
    assert local_cuda_index("0a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff", 5, visible) == 1  # owner's cuda:5 is our cuda:1
    assert local_cuda_index("GPU-0A1B2C3D-AAAA-BBBB-CCCC-DDDDEEEEFFFF", 5, visible) == 1  # nvidia-smi's spelling
    assert local_cuda_index("99999999-aaaa-bbbb-cccc-ddddeeeeffff", 0, visible) is None  # not visible here
    assert local_cuda_index("", 1, visible) == 1 and local_cuda_index("", 2, visible) is None  # no UUID sent


def test_cuda_handle_fields_reach_rebuild_cuda_tensor(monkeypatch):
    """Without a GPU, with torch's reduce/rebuild stubbed: every field reduce_tensor gives the owner
    reaches rebuild_cuda_tensor in the peer (by name, as the types torch's C++ side checks: bytes for
    handles, a bool), except the device, which the peer maps to its own ordinal by UUID."""
    import functools

    from torch.multiprocessing import reductions

    import protos.shared_region as sr

    sent = dict(tensor_cls=torch.Tensor, tensor_size=(4096,), tensor_stride=(1,), tensor_offset=0,
                storage_cls=torch.storage.TypedStorage, dtype=torch.uint8, storage_device=3,
                storage_handle=b"\x01" * 66, storage_size_bytes=2 << 20, storage_offset_bytes=512,
                requires_grad=False, ref_counter_handle=b"/torch_123_456_0", ref_counter_offset=7,
                event_handle=b"\x02" * 64, event_sync_required=True)
    got = {}

    @functools.wraps(reductions.rebuild_cuda_tensor)
    def rebuild(*args, **kw):
        assert not args
        got.update(kw)
        return torch.zeros(kw["tensor_size"], dtype=torch.uint8)

    names = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (rebuild, tuple(sent[k] for k in names)))
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(sr, "cuda_uuid", lambda i: f"gpu-uuid-{i}")
    monkeypatch.setattr(sr, "_visible_uuids", lambda: ["gpu-uuid-3"])  # the owner's cuda:3 is the peer's cuda:0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    handle = sr._export_cuda(torch.zeros(4096, dtype=torch.uint8))
    msg = drafter_pb2.SharedRegion.FromString(drafter_pb2.SharedRegion(region_id=1, nbytes=4096, cuda=handle)
                                              .SerializeToString())
    region = SharedRegion.attach(msg)
    assert region.nbytes == 4096 and not region.owner
    assert got == {**sent, "storage_device": 0}
    assert all(type(got[k]) is bytes for k in ("storage_handle", "ref_counter_handle", "event_handle"))
    assert type(got["event_sync_required"]) is bool
    msg.cuda.device_uuid = "gpu-uuid-9"
    with pytest.raises(ValueError, match="not visible in this process"):
        SharedRegion.attach(msg)
    msg.cuda.device_uuid, msg.nbytes = "gpu-uuid-3", 4 << 20
    with pytest.raises(ValueError, match="do not fit"):
        SharedRegion.attach(msg)


CHILD_ATTACH = """
import sys, torch
from protos.ddtree.v1 import drafter_pb2
from protos.shared_region import SharedRegion
r = SharedRegion.attach(drafter_pb2.SharedRegion.FromString(sys.stdin.buffer.read()))
assert r.device.type == "cuda", r.device
torch.cuda.current_stream(r.device).synchronize()
r.buf[:4] = r.buf[4:8] + 1  # a kernel on this process's stream
torch.cuda.current_stream(r.device).synchronize()
print(r.device.index, torch.cuda.device_count())
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
@pytest.mark.parametrize("hide_others", [False, True])
def test_cuda_ipc_region_is_shared_with_another_process(hide_others):
    """A child process maps the region, reads what this process wrote and writes back. With
    hide_others the child sees only the region's GPU (CUDA_VISIBLE_DEVICES=GPU-<uuid>), as its cuda:0:
    it must find it by UUID (on a multi-GPU host the region sits on the last GPU, so the ordinals differ)."""
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    region = SharedRegion.create(1, 1 << 20, dev)
    env = dict(os.environ)
    if hide_others:
        env["CUDA_VISIBLE_DEVICES"] = "GPU-" + region.to_pb().cuda.device_uuid.removeprefix("GPU-")
    try:
        assert region.to_pb().cuda.device == dev.index and region.to_pb().cuda.device_uuid
        region.buf[4:8] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device=dev)
        RegionArena(region).sync()
        out = subprocess.run([sys.executable, "-c", CHILD_ATTACH], input=region.to_pb().SerializeToString(),
                             capture_output=True, check=True, timeout=120, env=env)
        index, count = map(int, out.stdout.split())
        assert (index, count) == ((0, 1) if hide_others else (dev.index, torch.cuda.device_count()))
        assert region.buf[:4].tolist() == [2, 3, 4, 5]
    finally:
        region.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_regions_share_segments_with_regions_only():
    """What an IPC handle maps (the allocator segment holding the region) holds regions and nothing else: small
    tensors allocated before, between and after, which would share a segment with a region carved from the
    default pool, are never in it; regions closed and made again in the same pool neither abort nor grow it
    past one more segment."""
    dev = torch.device("cuda", 0)
    others = [torch.empty(256, dtype=torch.uint8, device=dev) for _ in range(4)]
    regions = [SharedRegion.create(3, 4, dev)]
    others += [torch.empty(256, dtype=torch.uint8, device=dev) for _ in range(4)]
    regions.append(SharedRegion.create(4, 4096, dev))
    others += [torch.empty(256, dtype=torch.uint8, device=dev) for _ in range(4)]
    try:
        segments = torch.cuda.memory_snapshot()
        for region in regions:
            ptr = region.buf.data_ptr()
            seg = next(sg for sg in segments if sg["address"] <= ptr < sg["address"] + sg["total_size"])
            # the segment belongs to the regions' pool, so whatever else lives in it is a region too (regions of
            # earlier tests may still be alive in this process: a peer in the same process holds views of them)
            assert tuple(seg["segment_pool_id"]) == tuple(_region_pool(dev).id), seg["segment_pool_id"]
            for t in others:
                assert not seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"]
        regions[0].buf[:4] = 7  # usable as before
        assert regions[0].buf[:4].tolist() == [7, 7, 7, 7]
    finally:
        for region in regions:
            region.close()
    del regions
    reserved = torch.cuda.memory_reserved(dev)
    for _ in range(20):  # made and dropped again and again (small: at most one more segment)
        SharedRegion.create(5, 4096, dev).close()
    assert torch.cuda.memory_reserved(dev) <= reserved + (2 << 20)


class _FakeEvent:
    """query() answers from a script: False until `ready_after` polls, or raises like a vanished peer's event."""

    def __init__(self, ready_after=None, fail=False):
        self.polls, self.ready_after, self.fail = 0, ready_after, fail

    def query(self):
        self.polls += 1
        if self.fail:
            raise RuntimeError("CUDA error: invalid resource handle")
        return self.ready_after is not None and self.polls > self.ready_after


def test_ipc_event_host_wait_completes_times_out_aborts_and_survives_a_vanished_peer():
    """`IpcEvent.wait_host` (the only way either side waits for the other's event) without a GPU: the poll
    loop's four outcomes."""
    def wait(fake, timeout_s=5.0, abort=None):
        return IpcEvent(fake, torch.device("cpu"), b"h", owner=False).wait_host(timeout_s, abort)

    assert wait(_FakeEvent(ready_after=3)) is True
    t0 = time.monotonic()
    assert wait(_FakeEvent(), timeout_s=0.05) is False and 0.05 <= time.monotonic() - t0 < 2
    calls = []
    assert wait(_FakeEvent(), abort=lambda: calls.append(1) or len(calls) >= 3) is False and len(calls) == 3
    assert wait(_FakeEvent(fail=True)) is False


CHILD_EVENT = """
import sys, time, torch
from protos.shared_region import IpcEvent
ev = IpcEvent.create(torch.device("cuda", 0))
torch.cuda._sleep(int(sys.argv[1]))  # a long kernel before the record: the event completes after it
ev.record()
sys.stdout.write(ev.handle.hex() + "\\n")
sys.stdout.flush()
time.sleep(60)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_ipc_event_of_a_killed_peer_times_out_without_wedging_our_stream():
    """A peer records its event after work that will never finish (it is killed mid-kernel): polling it gives
    up at the deadline, and nothing was queued on our stream, which keeps running (a GPU-side wait on that
    event would block it for good)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD_EVENT, str(20_000_000_000)], stdout=subprocess.PIPE,
                             text=True, cwd=str(Path(__file__).resolve().parents[2]))
    try:
        handle = bytes.fromhex(child.stdout.readline().strip())
        event = IpcEvent.open(handle, torch.device("cuda", 0))
        assert not event.wait_host(0.2)  # the child's kernel is still running
        child.kill()
        child.wait(30)
        t0 = time.monotonic()
        assert not event.wait_host(1.0) and time.monotonic() - t0 >= 0.9
        x = torch.zeros(1, device="cuda")
        x.add_(1)
        torch.cuda.current_stream().synchronize()  # returns: our stream never waited on the dead peer
        assert x.item() == 1.0
    finally:
        child.kill()
