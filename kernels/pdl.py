"""Programmatic dependent launch (PDL) for the one-token layer's chain of small kernels (on by default on sm_90).

A decode-sized GEMM streams 7-28 us of weights after a few microseconds of launch and first DRAM reads, and nothing
overlaps that start with the end of the kernel before it. With `ENABLED` (read at each launch; written without a GPU
in the thirty-second session; on an H100 in the thirty-third its GPU tests passed, bitwise, and a verify step was
0.2-1.6% faster with it, less than expected; the whole GPU suite passed with it in the thirty-fourth and
thirty-sixth sessions, and batch-1 verify steps were 0.3-0.8% faster in both orders there, so it is the default
since then):
  - `kernels.matmul` launches whose programs all fit at once go out with the `launch_pdl` attribute; each program
    prefetches its first weight tiles into L2, then waits for the previous grid (`griddepcontrol.wait`: its writes
    are visible after it), then lets the next grid launch (`griddepcontrol.launch_dependents`);
  - kernels launched plainly right before such GEMMs (`kernels.rmsnorm`: before q_a + kv_a, q_b and the router;
    the MLA combine in `kernels.mla_attention`: before the W_UV product) let the next grid launch at their start
    (`TRIGGER`), so a PDL GEMM after them is scheduled while they run and its prefetches overlap them. A trigger is
    a no-op when the next launch is not a PDL one. (The W_UK product reads a transposed weight view, so it keeps a
    plain launch: the prefetch assumes rows contiguous in K.)
`bench/bench_verify_step.py --pdl off on` times a verify step both ways; docs/performance.md ("Thirty-second session:
programmatic dependent launch", and the thirty-third's first GPU run) says what was checked and what was measured.
A kernel launched with PDL reads nothing another kernel writes before its wait, so the bits are the plain launches'.
The environment variable DDTREE_PDL (0 or 1, default 1) sets `ENABLED` for a process, read at import. Only sm_90
and newer GPUs have griddepcontrol; elsewhere every launch stays plain whatever `ENABLED` says.
"""

from __future__ import annotations

import functools
import os

import torch


def _from_env(raw: str | None) -> bool:
    """DDTREE_PDL -> ENABLED: unset (on), "0" or "1"."""
    if raw in (None, "", "1"):
        return True
    if raw == "0":
        return False
    raise ValueError(f"DDTREE_PDL={raw!r}: 1 (programmatic dependent launch for the decode-sized GEMMs, the default) "
                     "or 0 (plain launches)")


ENABLED = _from_env(os.environ.get("DDTREE_PDL"))


@functools.cache
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def active(x: torch.Tensor) -> bool:
    """Whether launches on x's device go out with PDL: `ENABLED`, a CUDA tensor and an sm_90+ GPU (the interpreter
    and older GPUs have no griddepcontrol)."""
    if not (ENABLED and x.is_cuda):
        return False
    return _capable(x.device)


def trigger(x: torch.Tensor) -> dict:
    """The TRIGGER constexpr for a plainly launched kernel that feeds a PDL launch, given one of its tensors."""
    return {"TRIGGER": True} if active(x) else {}
