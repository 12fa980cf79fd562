"""INT4 compressed-tensors packing: round trips and dequant against an independent per-element rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.int4_pack import dequantize_int4, pack_int4, quantize_int4, unpack_int4


def independent_dequant(packed: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """Spec, element by element: nibble k of word j holds column 8j+k as u = q + 8; W = (u-8)*s[r, c//G]."""
    out_f, words = packed.shape
    w = np.zeros((out_f, words * 8), dtype=np.float64)
    for r in range(out_f):
        for j in range(words):
            word = int(packed[r, j]) & 0xFFFFFFFF  # reinterpret int32 as uint32
            for k in range(8):
                u = (word >> (4 * k)) & 0xF
                c = 8 * j + k
                w[r, c] = (u - 8) * float(scale[r, c // group])
    return w


@pytest.mark.parametrize("shape,group", [((3, 32), 32), ((5, 96), 32), ((7, 64), 16), ((1, 8), 8)])
def test_pack_unpack_round_trip(shape, group):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    q[0, :8] = torch.arange(-8, 0, dtype=torch.int8)  # every nibble incl. the sign bit of the word
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], shape[1] // 8)
    assert torch.equal(unpack_int4(packed), q)


def test_dequant_matches_independent_rule():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g)
    q, scale = quantize_int4(w, 32)
    packed = pack_int4(q)
    ref = independent_dequant(packed.numpy(), scale.float().numpy(), 32)
    got = dequantize_int4(packed, scale, torch.float64).numpy()
    assert np.array_equal(got, ref)
    # quantisation error bounded by half a step per group
    step = scale.float().repeat_interleave(32, 1)
    assert (dequantize_int4(packed, scale) - w).abs().le(step * 0.5 + 1e-6).all()


def test_known_word():
    # columns 0..7 = q -8..-1 -> u 0..7 -> word 0x76543210
    q = torch.arange(-8, 0, dtype=torch.int8)[None]
    assert pack_int4(q).item() == 0x76543210
    q = torch.arange(0, 8, dtype=torch.int8)[None]  # u 8..15 -> 0xFEDCBA98 (negative as int32)
    assert pack_int4(q).item() == 0xFEDCBA98 - 2**32


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="in % 8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.int8))
    with pytest.raises(ValueError, match="outside"):
        pack_int4(torch.full((1, 8), 9, dtype=torch.int8))
