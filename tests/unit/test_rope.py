"""YaRN rope parameters (DESIGN 2.1/2.2) against an independent scalar implementation of the formulas."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.rope import Rope, rope_amplitude, rope_inv_freq, rotate_ref, rotate_triton

KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def scalar_yarn(dim, base, factor, orig, beta_fast, beta_slow):
    def corr(n_rot):
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        extra = 1.0 / base ** (2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(extra / factor * ramp + extra * (1 - ramp))  # ramp 1 = fully interpolated
    return out


def test_yarn_inv_freq_matches_scalar_formula():
    got = rope_inv_freq(64, 50000.0, KIMI_YARN)
    ref = torch.tensor(scalar_yarn(64, 50000.0, 64.0, 4096, 32.0, 1.0))
    assert torch.allclose(got.double(), ref.double(), rtol=1e-6)
    assert got[0] == 1.0  # highest frequency untouched
    assert math.isclose(got[-1].item(), 1 / 50000.0 ** (62 / 64) / 64, rel_tol=1e-5)  # lowest fully interpolated


def test_amplitudes():
    assert rope_amplitude(KIMI_YARN, "deepseek") == 1.0  # target: mscale / mscale_all_dim
    drafter = {k: v for k, v in KIMI_YARN.items() if not k.startswith("mscale")}
    assert math.isclose(rope_amplitude(drafter, "hf"), 1.41589, abs_tol=1e-5)  # DFlash drafter (DESIGN 2.2)
    assert rope_amplitude(KIMI_YARN, "hf") == 1.0
    assert rope_amplitude(None, "hf") == 1.0


def test_rotation_preserves_norm_and_relative_position():
    rope = Rope.build(16, 10000.0, None, "hf", interleaved=True)
    q, k = torch.randn(1, 16, dtype=torch.float64), torch.randn(1, 16, dtype=torch.float64)
    for interleaved in (True, False):
        r = Rope(rope.inv_freq, 1.0, interleaved)
        assert torch.allclose(r.apply(q, torch.tensor([5])).norm(), q.norm())
        a = (r.apply(q, torch.tensor([10])) * r.apply(k, torch.tensor([3]))).sum()
        b = (r.apply(q, torch.tensor([107])) * r.apply(k, torch.tensor([100]))).sum()
        # depends on the offset only (the angles are fp32: an error relative to |q| |k|, not to a dot near zero)
        assert abs(float(a - b)) <= 1e-5 * float(q.norm() * k.norm())


# --- the rotation kernel (kernels/rope.py::_rotate_kernel) against rotate_ref -------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (5, 3, 64), (4, 70, 6), (2, 1, 130)])
def test_rotate_kernel_vs_reference(shape, interleaved, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    T, dim = shape[0], shape[-1]
    rope = Rope.build(dim, 50000.0, KIMI_YARN, "deepseek", interleaved)
    cos, sin = rope.cos_sin(torch.randint(0, 100000, (T,), generator=g))
    x = torch.randn(*shape, generator=g).to(dtype)
    got = rotate_triton(x, cos, sin, interleaved)
    want = rotate_ref(x, cos, sin, interleaved)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_rotate_kernel_reads_strided_rows_like_the_mla_slices():
    """q_pe: the last 64 of 192 columns of every head, k_pe: the last 64 of a 576-wide row (MLAAttention)."""
    g = torch.Generator().manual_seed(3)
    T, H = 7, 5
    rope = Rope.build(64, 50000.0, KIMI_YARN, "deepseek", True)
    cos, sin = rope.cos_sin(torch.arange(T) * 997)
    q = torch.randn(T, H, 192, generator=g)
    kv = torch.randn(T, 576, generator=g)
    for x in (q[..., 128:], kv[:, None, 512:]):
        torch.testing.assert_close(rotate_triton(x, cos, sin, True), rotate_ref(x, cos, sin, True), rtol=1e-6,
                                   atol=1e-6)
    assert torch.equal(rotate_triton(q[:0, :, 128:], cos[:0], sin[:0], True), torch.empty(0, H, 64))
    with pytest.raises(ValueError, match="needs cos / sin"):
        rotate_triton(q[..., 128:], cos[:, :16], sin[:, :16], True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rotate_kernel_bf16_and_rows_independent_gpu():
    g = torch.Generator(device="cuda").manual_seed(4)
    rope = Rope.build(64, 50000.0, KIMI_YARN, "deepseek", True)
    rope = Rope(rope.inv_freq.cuda(), rope.amplitude, True)
    pos = torch.randint(0, 131072, (300,), device="cuda", generator=g)
    q = torch.randn(300, 64, 192, device="cuda", generator=g).to(torch.bfloat16)[..., 128:]
    cos, sin = rope.cos_sin(pos)
    got = rope.apply(q, pos, (cos, sin))  # CUDA: the kernel
    want = rotate_ref(q, cos, sin, True)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert (got.float() - want.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * want.float().abs().max()
    for r in (0, 150, 299):
        assert torch.equal(rope.apply(q[r : r + 1], pos[r : r + 1], (cos[r : r + 1], sin[r : r + 1]))[0], got[r])
