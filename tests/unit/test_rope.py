"""YaRN rope parameters (DESIGN 2.1/2.2) against an independent scalar implementation of the formulas."""

from __future__ import annotations

import math

import torch

from kernels.rope import Rope, rope_amplitude, rope_inv_freq

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
