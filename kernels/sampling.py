"""Seeded sampling of posterior tokens (DESIGN 3.2): warps + Gumbel-max with position-keyed noise.

Owns `sample_tokens` (launcher: Triton kernel on CUDA, torch reference elsewhere), the reference
`sample_reference`, the kernel `_sample_kernel` and the fixed-point mass helpers. One row = one
tree node (or AR step) with its own parameters; rows of one call may all differ.

Definition, per row with logits x [V], inv_temp = 1/T, top_p, top_k, seed, position:
  - T = 0 (inv_temp == 0): greedy, y = argmax(x) (first index on ties); no noise, no warps.
  - z = fp32(x) * inv_temp. Rank tokens by z descending, ties by lower index first.
  - mass: q_i = trunc(2^40 * 2^((z_i - max z) * log2 e)) as int64, computed with our own exp2
    (fp32 mul/add only, like `kernels.gumbel_noise`), so sums are exact and order-independent;
    tokens with q_i = 0 (z_i < max z - 27.7) carry no mass.
  - top-k (k in 1..V-1; 0 or >= V = off): keep ranks < k.
  - top-p (p < 1; 1 = off): keep token i iff the mass ranked strictly before i is < p * total
    (compared in fp64), i.e. the smallest prefix whose mass reaches p; the top token is always kept.
    Both filters are judged on the full temperature-scaled distribution; the kept set is the
    shorter prefix (as in FlashInfer's joint top-k/top-p filter).
  - y = argmax over kept tokens of z_i + g_i, g = Gumbel noise of (seed, position, i) from
    `kernels.gumbel_noise`; first index on ties. This draws exactly from softmax(z) restricted
    to the kept set (Gumbel-max), and the same (seed, position) gives the same y whichever tree
    node or AR step asks.

No sort is needed: let j = argmax of z + g over a candidate set S (start: all tokens). If j is
kept, it is the answer (kept set ⊂ S). Otherwise every kept token ranks before j, so continue with
S = {ranked before j}. Ranks shrink each round; usually the first j is kept (one round). The kernel runs one program
per row: pass 1 (max z, argmax of z + g), then one pass per round (count, mass, total, and the
argmax over the tokens ranked before j), all on the device with no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.gumbel_noise import KERNEL_OPTIONS, check_keys, gumbel_block, gumbel_noise_ref

LOG2E = 1.44269502162933349609375  # fp32(log2 e)
# 2^r on r in [0, 1): degree 6, least squares on Chebyshev nodes, fp32 coefficients (max rel err 8e-8)
EXP2_C = (1.0, 0.6931469440460205, 0.2402305006980896, 0.05548042804002762, 0.009684580378234386,
          0.0012387821916490793, 0.00021877505059819669)
MASS_BITS = 40  # q of the top token = 2^40; V * 2^40 < 2^63 for V < 2^23
GUMBEL_BOUND = 17.0  # > the largest noise value, -ln(-ln(1 - 2^-24)) = 16.64
_LOG2E, _GUMBEL_BOUND = tl.constexpr(LOG2E), tl.constexpr(GUMBEL_BOUND)
_E0, _E1, _E2, _E3, _E4, _E5, _E6 = (tl.constexpr(c) for c in EXP2_C)


# --- torch reference ---------------------------------------------------------------------------------
def fixed_mass_ref(d: Tensor) -> Tensor:
    """d = z - max z (fp32, <= 0, -inf allowed) -> int64 q = trunc(2^40 * 2^(d log2 e)) (own exp2)."""
    y = torch.clamp(d * LOG2E, min=-41.0)  # log2 of the relative mass; -inf -> -41 (q = 0)
    ni = y.to(torch.int32)  # truncation toward 0; floor below (GPU floor flushes denormals, this does not)
    ni = torch.where(ni.to(torch.float32) > y, ni - 1, ni)
    r = y - ni.to(torch.float32)  # [0, 1), exact
    p = torch.full_like(r, EXP2_C[-1])
    for c in EXP2_C[-2::-1]:
        p = p * r + c
    pm = (p * 8388608.0).to(torch.int64)  # p * 2^23: an exact integer, p has 23 fraction bits
    ni = ni.to(torch.int64)
    sh = ni + (MASS_BITS - 23)
    q = torch.where(sh >= 0, pm << sh.clamp(min=0), pm >> (-sh).clamp(min=0))
    return torch.where(ni < -MASS_BITS, 0, q)


def sample_reference(logits: Tensor, inv_temp: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor,
                     position: Tensor) -> Tensor:
    """logits [R, V] float; per-row inv_temp fp32, top_p fp32, top_k int32, seed/position int64 -> [R] int64."""
    R, V = logits.shape
    x = logits.to(torch.float32)
    greedy = (inv_temp == 0)[:, None]  # [R, 1]
    z = torch.where(greedy, x, x * inv_temp[:, None])  # [R, V] fp32
    key = torch.where(greedy, z, z + gumbel_noise_ref(seed, position, V))
    j = key.argmax(-1)  # [R] int64, first index on ties
    k = top_k.long()
    use_k = (k > 0) & (k < V)
    use_p = top_p < 1
    done = greedy[:, 0] | ~(use_k | use_p)
    if bool(done.all()):
        return j
    q = fixed_mass_ref(z - z.amax(-1, keepdim=True))  # [R, V] int64
    limit = top_p.double() * q.sum(-1).double()  # [R]
    idx = torch.arange(V, device=logits.device)[None, :]
    while not bool(done.all()):  # host loop: fine for the CPU reference
        zj = z.gather(1, j[:, None])
        before = (z > zj) | ((z == zj) & (idx < j[:, None]))  # [R, V] ranked strictly before j
        cnt, mass = before.sum(-1), torch.where(before, q, 0).sum(-1)
        kept = (~use_k | (cnt < k)) & (~use_p | (mass.double() < limit))
        done = done | kept
        fallback = torch.where(before, key, float("-inf")).argmax(-1)
        j = torch.where(done, j, fallback)
    return j


# --- Triton --------------------------------------------------------------------------------------------
@triton.jit
def fixed_mass(d):
    """Mirror of `fixed_mass_ref` (launch with enable_fp_fusion=False)."""
    y = tl.maximum(d * _LOG2E, -41.0)
    ni = y.to(tl.int32)
    ni = tl.where(ni.to(tl.float32) > y, ni - 1, ni)
    r = y - ni.to(tl.float32)
    p = r * 0.0 + _E6
    p = p * r + _E5
    p = p * r + _E4
    p = p * r + _E3
    p = p * r + _E2
    p = p * r + _E1
    p = p * r + _E0
    pm = (p * 8388608.0).to(tl.int64)
    ni = ni.to(tl.int64)
    sh = ni + 17  # MASS_BITS - 23
    q = tl.where(sh >= 0, pm << tl.maximum(sh, 0), pm >> tl.maximum(-sh, 0))
    return tl.where(ni < -40, 0, q)


@triton.jit
def _row_z(row_ptr, start, V, inv_t, greedy, BLOCK: tl.constexpr):
    """One block of a row: (offs, z) with z = -inf outside the row; z = x for greedy rows."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if not greedy:
        x = x * inv_t
    return offs, x


@triton.jit
def _sample_kernel(x_ptr, stride_xm, inv_temp_ptr, top_p_ptr, top_k_ptr, seed_ptr, pos_ptr, out_ptr, V,
                   BLOCK: tl.constexpr):
    """grid (R,): out[r] = the posterior token of row r (see the module docstring).

    Noise is only generated where it can matter: in pass 1, a block whose largest z cannot reach
    the best key so far even with the largest possible noise (g < GUMBEL_BOUND) is skipped; in
    the rounds, only blocks holding tokens ranked before j. Both skips are exact."""
    r = tl.program_id(0)
    row = x_ptr + r.to(tl.int64) * stride_xm
    inv_t = tl.load(inv_temp_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    top_k = tl.load(top_k_ptr + r)
    seed = tl.load(seed_ptr + r)
    pos = tl.load(pos_ptr + r)
    greedy = inv_t == 0.0
    neg_inf = float("-inf")

    # pass 1: max z and the unrestricted Gumbel-max candidate j
    zmax = tl.full((), neg_inf, tl.float32)
    best = tl.full((), neg_inf, tl.float32)
    j = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs, z = _row_z(row, start, V, inv_t, greedy, BLOCK)
        zb = tl.max(z, 0)
        zmax = tl.maximum(zmax, zb)
        key = z
        if not greedy:
            if zb + _GUMBEL_BOUND >= best:
                key = z + gumbel_block(seed, pos, start, BLOCK)
            else:  # no token here can beat `best`
                key = tl.full([BLOCK], neg_inf, tl.float32)
        key = tl.where(offs < V, key, neg_inf)
        bm = tl.max(key, 0)
        bi = tl.argmax(key, 0, tie_break_left=True)
        upd = bm > best  # strictly: earlier blocks win ties
        j = tl.where(upd, start + bi, j)
        best = tl.where(upd, bm, best)

    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0
    done = greedy | ((not use_k) & (not use_p))
    # rounds: accept j if kept, else restrict to the tokens ranked before j
    while not done:
        zj = tl.load(row + j).to(tl.float32) * inv_t
        cnt = tl.full((), 0, tl.int32)
        mass = tl.full((), 0, tl.int64)
        total = tl.full((), 0, tl.int64)
        fbest = tl.full((), neg_inf, tl.float32)
        fj = j
        for start in range(0, V, BLOCK):
            offs, z = _row_z(row, start, V, inv_t, greedy, BLOCK)
            q = tl.where(offs < V, fixed_mass(z - zmax), 0)  # [BLOCK] int64
            before = (offs < V) & ((z > zj) | ((z == zj) & (offs < j)))
            nb = tl.sum(before.to(tl.int32), 0)
            total += tl.sum(q, 0)
            cnt += nb
            mass += tl.sum(tl.where(before, q, 0), 0)
            if nb > 0:
                kb = tl.where(before, z + gumbel_block(seed, pos, start, BLOCK), neg_inf)
                bm = tl.max(kb, 0)
                bi = tl.argmax(kb, 0, tie_break_left=True)
                upd = bm > fbest
                fj = tl.where(upd, start + bi, fj)
                fbest = tl.where(upd, bm, fbest)
        limit = top_p.to(tl.float64) * total.to(tl.float64)
        kept = ((not use_k) | (cnt < top_k)) & ((not use_p) | (mass.to(tl.float64) < limit))
        j = tl.where(kept, j, fj)
        done = kept
    tl.store(out_ptr + r, j.to(tl.int64))


def check_sampling_args(logits: Tensor, inv_temp: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor,
                        position: Tensor) -> None:
    """Shapes, dtypes and devices only (values are validated in SamplingParams: no device reads here)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor [R, V], got {tuple(logits.shape)} {logits.dtype}")
    if logits.stride(-1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    R, V = logits.shape
    if V >= 1 << (63 - MASS_BITS):
        raise ValueError(f"logits: vocabulary {V} is too large for the int64 fixed-point masses (< 2^23)")
    for name, t, dt in (("inv_temp", inv_temp, torch.float32), ("top_p", top_p, torch.float32),
                        ("top_k", top_k, torch.int32)):
        if t.shape != (R,) or t.dtype != dt:
            raise ValueError(f"{name} must be [{R}] {dt}, got {tuple(t.shape)} {t.dtype}")
    check_keys(seed, position, R)
    devs = {t.device for t in (logits, inv_temp, top_p, top_k, seed, position)}
    if len(devs) != 1:
        raise ValueError(f"sampling tensors are on different devices: {sorted(map(str, devs))}")


def sample_tokens(logits: Tensor, inv_temp: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor, position: Tensor,
                  impl: str = "auto", block: int = 1024, num_warps: int = 4) -> Tensor:
    """Launcher: posterior token per row -> [R] int64 on logits' device.

    logits [R, V] fp32/bf16/fp16/fp64 (read as fp32); inv_temp [R] fp32 (0 = greedy); top_p [R]
    fp32 in (0, 1]; top_k [R] int32 (0 = off); seed [R] int64 >= 0; position [R] int64 = absolute
    position of the token each row predicts. impl: auto (Triton on CUDA, reference elsewhere),
    triton (on CPU needs TRITON_INTERPRET=1) or torch.
    """
    check_sampling_args(logits, inv_temp, top_p, top_k, seed, position)
    if impl == "auto":
        impl = "triton" if logits.is_cuda else "torch"
    if impl == "torch":
        return sample_reference(logits, inv_temp, top_p, top_k, seed, position)
    if impl != "triton":
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    if block < 4 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 4, got {block}")
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R:
        _sample_kernel[(R,)](logits, logits.stride(0), inv_temp, top_p, top_k, seed, position, out, V,
                             BLOCK=block, num_warps=num_warps, **KERNEL_OPTIONS)
    return out
