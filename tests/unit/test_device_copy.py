"""drafter_service.device_copy: the drafter's per-step uploads give exactly what `.to(device, dtype)` gives, for
every mix of blocks, with and without a destination, on the CPU and (through pinned staging) on a GPU."""

from __future__ import annotations

import pytest
import torch

from drafter_service import device_copy
from drafter_service.device_copy import (
    host_to_device,
    int64_to_device,
    pack_rows,
    pinned_min_bytes,
    rows_to_device,
    stage_pinned,
)

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a GPU")])]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _blocks(gen: torch.Generator, rows: list[int], F: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    return [torch.randn(n, F, generator=gen).to(dt) for n, dt in zip(rows, dtypes, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,dtypes,want", [
    ([3], [torch.float16], torch.float16),  # one block, same dtype
    ([5, 1, 7], [torch.float16] * 3, torch.float16),  # wire rows: one dtype, several blocks
    ([2, 9], [torch.float32] * 2, torch.float16),  # converted on the way
    ([4, 3], [torch.float32, torch.float16], torch.float32),  # mixed blocks: each converted first
    ([9000, 8000], [torch.float16] * 2, torch.float16),  # 1.26 MB: past a 1 MiB threshold (pinned on a GPU)
    ([9000, 8000], [torch.float16] * 2, torch.float32),  # the same, converted on the device
])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("min_bytes", [0, 1 << 20])  # the default (all pinned), the split of DDTREE_PINNED_MIN_BYTES
def test_rows_to_device_equals_to(device, rows, dtypes, want, with_out, min_bytes, monkeypatch):
    monkeypatch.setattr(device_copy, "PINNED_MIN_BYTES", min_bytes)
    gen = torch.Generator().manual_seed(sum(rows))
    parts = _blocks(gen, rows, 37, dtypes)  # an awkward feature width
    ref = torch.cat([p.to(device, want) for p in parts])
    dev = torch.device(device)
    if with_out:
        buf = torch.full((sum(rows) + 5, 37), float("nan"), dtype=want, device=device)  # larger: a graph's input
        got = rows_to_device(parts, dev, want, out=buf[: sum(rows)])
        assert got.data_ptr() == buf.data_ptr()
        assert torch.isnan(buf[sum(rows):]).all()  # nothing written past the rows
    else:
        got = rows_to_device(parts, dev, want)
    _sync(dev)
    assert got.device.type == dev.type and got.dtype == want and got.shape == ref.shape
    assert torch.equal(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_survive_their_host_blocks(device):
    """The upload may still be in flight when the caller drops (or overwrites) its host blocks: the staged copy,
    not the caller's memory, is what lands."""
    dev = torch.device(device)
    parts = [torch.arange(12.0).reshape(4, 3).half(), torch.arange(6.0).reshape(2, 3).half()]
    ref = torch.cat(parts).to(device)
    got = rows_to_device(parts, dev, torch.float16)
    for p in parts:
        p.fill_(-1)
    _sync(dev)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_index_uploads(device):
    dev = torch.device(device)
    vals = [[1, 2, 3], [4, 5, 2**40]]
    assert torch.equal(int64_to_device(vals, dev).cpu(), torch.tensor(vals))
    out = torch.zeros(2, 3, dtype=torch.int64, device=device)
    small = torch.tensor([[7, 8, 9], [1, 0, -3]], dtype=torch.int32)  # widened on the way
    assert int64_to_device(small, dev, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out.cpu(), small.long())
    assert torch.equal(host_to_device(torch.tensor(vals), dev).cpu(), torch.tensor(vals))


@pytest.mark.parametrize("pinned", [False, pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="pinned memory needs a GPU")])])
def test_pack_rows_equals_cat(pinned):
    """pack_rows gives torch.cat's values for the blocks a step hands it: views at an offset into one decoded step
    tensor (a session's kept window), an empty block, a non-contiguous block, whole tensors."""
    gen = torch.Generator().manual_seed(7)
    step = torch.randn(23, 13, generator=gen).half()  # one decoded step: sessions' rows are views of it
    loose = torch.randn(13, 6, generator=gen).half().t()  # [6, 13], not contiguous
    parts = [step[2:9], step[9:9], step[15:], loose, torch.randn(1, 13, generator=gen).half()]
    dst = torch.full((sum(p.shape[0] for p in parts), 13), float("nan"), dtype=torch.float16, pin_memory=pinned)
    assert pack_rows(parts, dst) is dst
    assert torch.equal(dst, torch.cat(parts))


def test_pack_rows_refuses_what_does_not_fit():
    rows = [torch.zeros(3, 4, dtype=torch.float16), torch.zeros(2, 4, dtype=torch.float16)]
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([rows[0], rows[1].float()], torch.empty(5, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([rows[0], torch.zeros(2, 5, dtype=torch.float16)], torch.empty(5, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="more than the 4 rows"):
        pack_rows(rows, torch.empty(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="hold 5 rows, dst 6"):
        pack_rows(rows, torch.empty(6, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous CPU"):
        pack_rows(rows, torch.empty(4, 5, dtype=torch.float16).t())


def test_wire_rows_are_staged_pinned_by_size():
    """Below a threshold host rows go to a GPU from pageable memory, from it on through pinned memory; never for a
    CPU destination or rows already on a device. By default (PINNED_MIN_BYTES 0) every host upload to a GPU is
    staged (the measurements: device_copy's docstring)."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    mib = 1 << 20
    row = mib // 4  # rows per MiB at float16 x 2 values: 4 bytes each
    small = [torch.zeros(row - 1, 2, dtype=torch.float16)]
    exact = [torch.zeros(row // 2, 2, dtype=torch.float16), torch.zeros(row - row // 2, 2, dtype=torch.float16)]
    assert not stage_pinned(small, gpu, mib)
    assert stage_pinned(exact, gpu, mib)  # summed over the blocks, from exactly the threshold
    assert stage_pinned([torch.zeros(row, 1, dtype=torch.float32)], gpu, mib)  # element size counts
    assert not stage_pinned(exact, cpu, mib)
    assert not stage_pinned([torch.zeros(row * 2, 2, dtype=torch.float16, device="meta")], gpu, mib)
    assert stage_pinned([torch.zeros(1, 2, dtype=torch.float16)], gpu, 0)
    assert not stage_pinned([torch.zeros(1, 2, dtype=torch.float16)], cpu, 0)


def test_pinned_threshold_from_the_environment():
    """DDTREE_PINNED_MIN_BYTES: unset or empty is 0 (every upload staged pinned), a byte count is taken as is,
    anything else is refused with the variable's name."""
    assert pinned_min_bytes(None) == pinned_min_bytes("") == 0
    assert pinned_min_bytes("0") == 0 and pinned_min_bytes("4096") == 4096
    for bad in ("-1", "1MiB", "1.5"):
        with pytest.raises(ValueError, match="DDTREE_PINNED_MIN_BYTES"):
            pinned_min_bytes(bad)
