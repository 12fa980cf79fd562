"""Row-wise RMSNorm kernel (kernels/rmsnorm.py) against `rms_norm_ref`.

CPU: the Triton kernel under TRITON_INTERPRET=1 in fp32/fp16 at awkward row lengths, one-chunk and
multi-chunk reductions, 3-D inputs (the drafter's per-head q/k norms) and column slices (the
latent c_kv of kv_a_proj's output), outputs poisoned with NaN. GPU (marked `gpu`): bf16 at Kimi
row lengths, a row normalised alone vs inside M = 64 / 300 / 1100 rows: bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from kernels.rmsnorm import RMSNorm, rms_norm, rms_norm_ref, rms_norm_triton
from tests.kernels.test_matmul import assert_close, rand

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def test_exact_hand_case():
    """x = [2, -2, 2, -2]: mean square 4, scale 1/2, so y = [1, -1, 1, -1] * w exactly (eps 0)."""
    x = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    w = torch.tensor([1.0, 2.0, 0.5, -3.0])
    for dtype in (torch.float32, torch.float16):
        out = torch.full((1, 4), float("nan"), dtype=dtype)
        rms_norm_triton(x.to(dtype), w, 0.0, out=out)
        assert torch.equal(out[0].float(), torch.tensor([1.0, -2.0, 0.5, 3.0])), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("R,D,block", [(1, 1, None), (3, 7, None), (5, 320, None), (4, 129, 32), (2, 1000, 256),
                                       (6, 512, 128)])
def test_kernel_vs_reference(R, D, block, dtype):
    x = rand(R, D, dtype=dtype, seed=D) * 3
    w = rand(D, seed=D + 1).to(dtype)
    out = torch.full((R, D), float("nan"), dtype=dtype)
    rms_norm_triton(x, w, 1e-5, out=out, block_d=block)
    assert_close(out, rms_norm_ref(x, w, 1e-5), TOL[dtype], f"{R}x{D} block {block} {dtype}")


def test_fp32_weight_with_16bit_rows():
    x = rand(3, 48, dtype=torch.float16, seed=1)
    w = rand(48, seed=2)
    assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), TOL[torch.float16], "mixed")


def test_3d_rows_and_column_slices():
    x = rand(4, 3, 16, seed=3)  # [T, H, head_dim] (drafter q_norm / k_norm)
    w = rand(16, seed=4)
    assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), TOL[torch.float32], "3-D")
    kv = rand(5, 40, seed=5)  # [T, Dl + Dr]: normalise the first 32 columns (c_kv) in place of a copy
    out = rms_norm_triton(kv[:, :32], w.repeat(2), 1e-6)
    assert out.is_contiguous() and out.shape == (5, 32)
    assert_close(out, rms_norm_ref(kv[:, :32], w.repeat(2), 1e-6), TOL[torch.float32], "slice")
    nc = rand(3, 4, 16, seed=6).transpose(0, 1)  # rows not laid out [R, D]: copied first
    assert_close(rms_norm_triton(nc, w, 1e-6), rms_norm_ref(nc, w, 1e-6), TOL[torch.float32], "transposed")


def test_empty_and_checks():
    assert rms_norm_triton(torch.zeros(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    with pytest.raises(ValueError, match="does not match"):
        rms_norm_triton(torch.zeros(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="unsupported"):
        rms_norm_triton(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="out must be"):
        rms_norm_triton(torch.zeros(2, 8), torch.ones(8), 1e-6, out=torch.zeros(2, 8, dtype=torch.float16))


def test_module_interface_and_cpu_dispatch():
    m = RMSNorm(10, 1e-5)
    assert [n for n, _ in m.named_parameters()] == ["weight"] and m.eps == 1e-5
    x = rand(3, 10, seed=7, dtype=torch.float64)
    assert torch.equal(m(x), rms_norm_ref(x, m.weight, 1e-5))  # CPU: the reference, fp64 kept
    assert torch.equal(rms_norm(x.float(), m.weight, 1e-5), rms_norm_ref(x.float(), m.weight, 1e-5))
    y = m(x.float().requires_grad_())
    y.sum().backward()  # autograd works (the reference runs whenever a gradient is needed)
    assert m.weight.grad is not None


# --- GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("D", [7168, 1536, 512, 320, 128, 9000])
def test_row_invariance_bf16(D):
    x = rand(1100, D, dtype=torch.bfloat16, seed=D, device="cuda") * 2
    w = rand(D, seed=1, device="cuda").to(torch.bfloat16)
    rows = [0, 1, 37, 63, 299, 1099]
    alone = {r: rms_norm(x[r : r + 1], w, 1e-5)[0] for r in rows}
    for M in (64, 300, 1100):
        y = rms_norm(x[:M], w, 1e-5)
        for r in rows:
            if r < M:
                assert torch.equal(y[r], alone[r]), f"D={D}: row {r} of M={M} differs from the row alone"
    assert_close(y, rms_norm_ref(x, w, 1e-5), TOL[torch.bfloat16], f"D={D}")


@pytest.mark.gpu
@needs_cuda
def test_module_uses_kernel_and_slices_are_invariant_on_gpu():
    """kv_a_layernorm normalises kv[:, :512] of a [T, 576] tensor: strided rows, same bits alone."""
    m = RMSNorm(512, 1e-5).to("cuda", torch.bfloat16)
    kv = rand(300, 576, dtype=torch.bfloat16, seed=2, device="cuda")
    with torch.no_grad():
        y = m(kv[:, :512])
        assert torch.equal(m(kv[7:8, :512])[0], y[7])
        assert torch.equal(y, rms_norm_triton(kv[:, :512], m.weight, 1e-5))
    y_grad = m(kv[:, :512].float().requires_grad_())  # grad mode: the differentiable reference
    assert y_grad.requires_grad
