"""Host data -> device with as few copies as possible (the drafter's per-step index and feature uploads).

A plain `torch.tensor(...).to("cuda")` copies from pageable memory, which makes the host wait for the
stream (PyTorch synchronises after a blocking host-to-device copy): the GPU then idles while the host
queues the next launches. Index uploads are staged in pinned memory and copied with `non_blocking=True`;
PyTorch's caching host allocator keeps the pinned block alive until the copy has run, so the host
buffer can be dropped right away. Feature rows (context taps) are concatenated where they live and moved
with one copy.

Rows decoded from the wire (the gRPC transport) are packed with `pack_rows`, one memmove per block on the
calling thread, never with torch's CPU copy or cat: those split a block of more than 32k elements over the
intra-op thread pool, and on the H200 host, with the verifier's process busy beside the drafter's, that was
the whole cost of the wire uploads (docs/performance.md, seventeenth and eighteenth sessions; a row is 6 taps
x 7168 x bf16 = 84 KiB). Pinned staging through torch's cat made a C = 1 gRPC step 17-19 ms and pageable
staging a C = 32 step 296 ms; the same pinned staging with OMP_NUM_THREADS=1 took 10.5 ms at C = 1, and
pack_rows into pinned memory 10.2 ms at C = 1 and 43.1 ms at C = 32 (in-process 8.6 / 34.6 ms). So the
rows are packed into pinned memory and uploaded by a copy the host does not wait for. The environment
variable DDTREE_PINNED_MIN_BYTES (bytes, read at import; 0 when unset) keeps the old split for A/B runs:
below it a single block goes from where it lies (pageable: the copy makes the host wait for the stream)
and several are packed into pageable memory first.
"""

from __future__ import annotations

import ctypes
import os

import torch


def pinned_min_bytes(value: str | None) -> int:
    """DDTREE_PINNED_MIN_BYTES's value -> the threshold in bytes (0, everything pinned, when unset)."""
    if value is None or value == "":
        return 0
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"DDTREE_PINNED_MIN_BYTES must be a byte count >= 0, got {value!r}")
    return n


# host row blocks from this size on are staged in pinned memory (all of them unless the environment says otherwise)
PINNED_MIN_BYTES = pinned_min_bytes(os.environ.get("DDTREE_PINNED_MIN_BYTES"))


def int64_to_device(values: list | torch.Tensor, device: torch.device, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """values (nested lists of ints, or a CPU int tensor) -> int64 tensor on `device` with one copy; into
    `out` (an int64 tensor of the same shape on `device`, e.g. a CUDA graph's static input) when given."""
    if isinstance(values, torch.Tensor):
        return host_to_device(values.to(torch.int64), device, out)
    # pinned from the start on a GPU: one host op fewer than pinning a pageable copy
    return host_to_device(torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda"), device, out)


def host_to_device(host: torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """A CPU tensor -> `device` (into `out` when given) with one copy that does not make the host wait:
    staged in pinned memory when `device` is a GPU."""
    cuda = device.type == "cuda"
    if cuda and not host.is_pinned():
        host = host.pin_memory()
    if out is not None:
        return out.copy_(host, non_blocking=cuda)
    return host.to(device, non_blocking=cuda)


def rows_to_device(parts: list[torch.Tensor], device: torch.device, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate row blocks [n_i, F] into one [sum n_i, F] tensor of `dtype` on `device` (into `out` when
    given): one concatenation and one copy when the blocks share a device and dtype (the usual case: all on
    the verifier's device, or all decoded from the wire), each block converted first otherwise. Values are
    what `block.to(device, dtype)` gives."""
    if out is not None and all(p.device == out.device and p.dtype == out.dtype for p in parts):
        return torch.cat(parts, out=out)
    if len({(p.device, p.dtype) for p in parts}) == 1:
        if device.type == "cuda" and parts[0].device.type == "cpu":
            return _host_rows_to_device(parts, device, dtype, out)
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
    else:
        x = torch.cat([p.to(device, dtype) for p in parts])
    return x.to(device, dtype) if out is None else out.copy_(x)


def stage_pinned(parts: list[torch.Tensor], device: torch.device, min_bytes: int | None = None) -> bool:
    """Whether host row blocks of one dtype go to `device` through pinned memory: to a GPU from `min_bytes`
    (PINNED_MIN_BYTES when None) on."""
    threshold = PINNED_MIN_BYTES if min_bytes is None else min_bytes
    return (device.type == "cuda" and parts[0].device.type == "cpu"
            and sum(p.numel() for p in parts) * parts[0].element_size() >= threshold)


def pack_rows(parts: list[torch.Tensor], dst: torch.Tensor) -> torch.Tensor:
    """Host row blocks [n_i, ...] one after another into `dst` ([sum n_i, ...], contiguous, on the CPU, of the
    blocks' dtype) on this thread: a memmove per contiguous block (a non-contiguous one is copied by torch). -> dst"""
    if dst.device.type != "cpu" or not dst.is_contiguous():
        raise ValueError("pack_rows packs into a contiguous CPU tensor")
    row = 0
    for p in parts:
        if p.dtype != dst.dtype or p.device.type != "cpu" or p.shape[1:] != dst.shape[1:]:
            raise ValueError(f"a block {p.dtype} {list(p.shape)} on {p.device} does not fit rows "
                             f"{dst.dtype} {list(dst.shape[1:])} on the CPU")
        n = p.shape[0]
        if row + n > dst.shape[0]:
            raise ValueError(f"the blocks hold more than the {dst.shape[0]} rows of dst")
        if p.is_contiguous():
            if p.numel():
                ctypes.memmove(dst[row].data_ptr(), p.data_ptr(), p.numel() * p.element_size())
        else:
            dst[row: row + n].copy_(p)
        row += n
    if row != dst.shape[0]:
        raise ValueError(f"the blocks hold {row} rows, dst {dst.shape[0]}")
    return dst


def _host_rows_to_device(parts: list[torch.Tensor], device: torch.device, dtype: torch.dtype,
                         out: torch.Tensor | None) -> torch.Tensor:
    """Host row blocks of one dtype (rows decoded from the wire) -> a GPU: packed by `pack_rows` (into pinned memory
    from PINNED_MIN_BYTES on, then uploaded by one copy the host does not wait for; a single smaller block is
    uploaded from where it lies), converted to `dtype` on the device when it differs (a CPU-side conversion would
    run on the thread pool). PyTorch's caching host allocator keeps the pinned block until the copy has run."""
    pinned = stage_pinned(parts, device)
    if len(parts) == 1 and not pinned:
        host = parts[0]
    else:
        host = pack_rows(parts, torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                                            dtype=parts[0].dtype, pin_memory=pinned))
    if out is not None and out.dtype == host.dtype:
        return out.copy_(host, non_blocking=pinned)
    x = host.to(device, non_blocking=pinned)
    return x.to(dtype) if out is None else out.copy_(x)
