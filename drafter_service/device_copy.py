"""Host data -> device with as few copies as possible (the drafter's per-step index and feature uploads).

A plain `torch.tensor(...).to("cuda")` copies from pageable memory, which makes the host wait for the
stream (PyTorch synchronises after a blocking host-to-device copy): the GPU then idles while the host
queues the next launches. Index uploads are staged in pinned memory and copied with `non_blocking=True`;
PyTorch's caching host allocator keeps the pinned block alive until the copy has run, so the host
buffer can be dropped right away. Feature rows (context taps) are concatenated where they live and moved
with one copy. Rows decoded from the wire (the gRPC transport) go by size: from PINNED_MIN_BYTES on they are
concatenated into pinned memory and uploaded asynchronously, below it from pageable memory with a copy the host
waits for. Measured on the H200 with the K2.6 pair over gRPC (docs/performance.md, sixteenth session; a row is 6
taps x 7168 x bf16 = 84 KiB): pageable uploads of C = 32 sessions' rows (1 MiB or more) made the step 296 ms
instead of 45, while every pinned variant tried (torch's caching allocator, one reused buffer, a host wait after the
copy, a kernel reading the pinned rows instead of a copy engine) made the C = 1 step (under 1 MiB) 17-19 ms instead
of 10.4. Why either happens is not known, and sizes between those of C = 1 and C = 32 were not measured. The
environment variable DDTREE_PINNED_MIN_BYTES (bytes, read at import) moves the threshold for such measurements: 0
stages every wire upload pinned, a size past any step's rows none.
"""

from __future__ import annotations

import os

import torch


def pinned_min_bytes(value: str | None) -> int:
    """DDTREE_PINNED_MIN_BYTES's value -> the threshold in bytes (1 MiB when unset)."""
    if value is None or value == "":
        return 1 << 20
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"DDTREE_PINNED_MIN_BYTES must be a byte count >= 0, got {value!r}")
    return n


# host row blocks from this size on are staged in pinned memory (see above)
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
        if stage_pinned(parts, device):
            return _pinned_rows_to_device(parts, device, dtype, out)
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
    else:
        x = torch.cat([p.to(device, dtype) for p in parts])
    return x.to(device, dtype) if out is None else out.copy_(x)


def stage_pinned(parts: list[torch.Tensor], device: torch.device) -> bool:
    """Whether host row blocks of one dtype go to `device` through pinned memory: to a GPU from PINNED_MIN_BYTES on."""
    return (device.type == "cuda" and parts[0].device.type == "cpu"
            and sum(p.numel() for p in parts) * parts[0].element_size() >= PINNED_MIN_BYTES)


def _pinned_rows_to_device(parts: list[torch.Tensor], device: torch.device, dtype: torch.dtype,
                           out: torch.Tensor | None) -> torch.Tensor:
    """Host row blocks of one dtype (rows decoded from the wire, PINNED_MIN_BYTES or more) -> `device`: concatenated
    straight into pinned memory, uploaded by one copy the host does not wait for, converted to `dtype` on the device
    when it differs (a CPU-side conversion would be pageable again). PyTorch's caching host allocator keeps the
    pinned block until the copy has run."""
    staged = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                         pin_memory=True)
    torch.cat(parts, out=staged)
    if out is not None and out.dtype == staged.dtype:
        return out.copy_(staged, non_blocking=True)
    x = staged.to(device, non_blocking=True)
    return x.to(dtype) if out is None else out.copy_(x)
