"""A streaming read of the routed experts' bytes, no arithmetic: the INT4 MoE benchmark's "read" peer.

`read_experts(read_plan(tensors, ids, chunk), ...)` reads, for every distinct expert in `ids`, its whole slice of
each expert-major tensor (w13 words and scales, w2 words and scales: [E, ...], contiguous) in chunks of `chunk` int32
words, one program per chunk, XOR-folding each chunk into one word so nothing is written but a word per program. One
launch for all tensors (CONFIGS: the chunk / load / warps settings the benchmark tries, keeping the fastest). Timed
with the same CUDA-graph harness as the MoE kernels it is the same run's answer to "how fast can these bytes be
streamed at all from one launch" (the copy floor is a 2 GiB copy with no launch or ramp in sight).

Plain Triton, so it runs under TRITON_INTERPRET=1 on the CPU (tests/unit/test_expert_read.py against torch).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

CHUNK = 16384  # int32 words per program (64 KiB), the default
CONFIGS = ((16384, 1024, 4), (16384, 4096, 4), (65536, 4096, 8), (4096, 2048, 4))  # (chunk, block, warps) tried


@triton.jit
def _read_kernel(base_ptr, offs_ptr, lens_ptr, out_ptr, n_jobs, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (job j, chunk c): XOR of words [c CHUNK, min((c + 1) CHUNK, len_j)) at base + offs[j] (int32 words
    from base_ptr), into out[pid]."""
    pid = tl.program_id(0)
    j = pid % n_jobs
    c = pid // n_jobs
    start = tl.load(offs_ptr + j)
    n = tl.load(lens_ptr + j)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        r = i + tl.arange(0, BLOCK)
        idx = c * CHUNK + r
        acc ^= tl.load(base_ptr + start + idx, mask=(idx < n) & (r < CHUNK), other=0)
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_plan(tensors, ids: torch.Tensor, chunk: int | None = None):
    """(base, offsets, lengths, chunks, chunk): int32 words from `base` (the lowest data pointer among `tensors`) of
    each distinct expert's slice of each tensor, the chunks of `chunk` words (default CHUNK) of the longest, and that
    chunk: a host-side plan, made once (the experts of `ids` are read on the host), so that `read_experts` launches
    without a host sync (CUDA-graph capturable)."""
    chunk = chunk or CHUNK
    experts = sorted(set(ids.reshape(-1).tolist()))
    base = min(tensors, key=lambda t: t.data_ptr())
    offs, lens = [], []
    for t in tensors:
        if not t.is_contiguous() or (t.data_ptr() - base.data_ptr()) % 4 or t[0].numel() * t.element_size() % 4:
            raise ValueError("read_plan: expert-major contiguous tensors of whole int32 words")
        per = t[0].numel() * t.element_size() // 4
        for e in experts:
            offs.append((t.data_ptr() - base.data_ptr()) // 4 + e * per)
            lens.append(per)
    dev = base.device
    return (base.view(torch.int32) if base.dtype != torch.int32 else base,
            torch.tensor(offs, dtype=torch.int64, device=dev), torch.tensor(lens, dtype=torch.int32, device=dev),
            -(-max(lens) // chunk), chunk)


def read_experts(plan, out: torch.Tensor | None = None, block: int = 1024, warps: int = 4) -> torch.Tensor:
    """One launch reading every slice of `plan` (`read_plan`) in loads of `block` words; returns the per-program XOR
    words."""
    base, offs, lens, chunks, chunk = plan
    grid = offs.numel() * chunks
    if out is None:
        out = torch.empty(grid, dtype=torch.int32, device=base.device)
    _read_kernel[(grid,)](base, offs, lens, out, offs.numel(), CHUNK=chunk, BLOCK=block, num_warps=warps)
    return out


def read_experts_ref(tensors, ids: torch.Tensor) -> int:
    """The XOR of every int32 word of every distinct expert's slice of `tensors` (what the kernel's words fold to)."""
    acc = 0
    for t in tensors:
        for e in sorted(set(ids.reshape(-1).tolist())):
            words = t[e].contiguous().reshape(-1).view(torch.int32).cpu().numpy()
            acc ^= int(np.bitwise_xor.reduce(words))
    return acc
