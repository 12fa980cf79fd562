"""Programmatic dependent launch (PDL) for the one-token layer's chain of small kernels (opt-in).

A decode-sized GEMM streams 7-28 us of weights after a few microseconds of launch and first DRAM reads, and nothing
overlaps that start with the end of the kernel before it. With `ENABLED` (read at each launch; written without a GPU
in the thirty-second session, not yet run on one):
  - `kernels.matmul` launches whose programs all fit at once go out with the `launch_pdl` attribute; each program
    prefetches its first weight tiles into L2, then waits for the previous grid (`griddepcontrol.wait`: its writes
    are visible after it), then lets the next grid launch (`griddepcontrol.launch_dependents`);
  - kernels launched plainly right before such GEMMs (`kernels.rmsnorm`: before q_a + kv_a, q_b and the router;
    the MLA combine in `kernels.mla_attention`: before the W_UV product) let the next grid launch at their start
    (`TRIGGER`), so a PDL GEMM after them is scheduled while they run and its prefetches overlap them. A trigger is
    a no-op when the next launch is not a PDL one. (The W_UK product reads a transposed weight view, so it keeps a
    plain launch: the prefetch assumes rows contiguous in K.)
`bench/bench_verify_step.py --pdl off on` times a verify step both ways; docs/performance.md ("Thirty-second session:
programmatic dependent launch") says what was checked and what was not.
A kernel launched with PDL reads nothing another kernel writes before its wait, so the bits are the plain launches'.
"""

from __future__ import annotations

ENABLED = False


def trigger(x) -> dict:
    """The TRIGGER constexpr for a plainly launched kernel that feeds a PDL launch, given one of its tensors (none off
    CUDA: the interpreter has no griddepcontrol)."""
    return {"TRIGGER": True} if ENABLED and x.is_cuda else {}
