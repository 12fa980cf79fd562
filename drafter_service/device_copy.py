"""Host ints -> device tensor without a stream synchronisation (the drafter's per-step index uploads).

A plain `torch.tensor(...).to("cuda")` copies from pageable memory, which makes the host wait for the
stream (PyTorch synchronises after a blocking host-to-device copy): the GPU then idles while the host
queues the next launches. Staging in pinned memory and copying with `non_blocking=True` avoids that;
PyTorch's caching host allocator keeps the pinned block alive until the copy has run, so the host
buffer can be dropped right away.
"""

from __future__ import annotations

import torch


def int64_to_device(values: list | torch.Tensor, device: torch.device, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """values (nested lists of ints, or a CPU int tensor) -> int64 tensor on `device` with one copy; into
    `out` (an int64 tensor of the same shape on `device`, e.g. a CUDA graph's static input) when given."""
    host = values.to(torch.int64) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    cuda = device.type == "cuda"
    if cuda:
        host = host.pin_memory()
    if out is not None:
        return out.copy_(host, non_blocking=cuda)
    return host.to(device, non_blocking=cuda)
