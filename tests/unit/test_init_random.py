"""`ddtree init-random`: tiny folders in every layout load back; the kimi-k2.6 preset has exactly the tiny
preset's names and packing at the real shapes (checked from the lazy specs, without writing ~15 GB)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from kernels.int4_pack import dequantize_int4
from verifier_service import presets
from verifier_service.checkpoint import load_target
from verifier_service.random_checkpoint import CHUNK_ELEMS, target_specs


@pytest.mark.parametrize("layout", presets.LAYOUTS)
def test_cli_writes_loadable_pair(tmp_path, layout):
    cmd = ["init-random", "--preset", "tiny", "--layout", layout, "--layers", "3", "--out", str(tmp_path),
           "--shard-gb", "0.0001"]
    p = subprocess.run([sys.executable, "-m", "gateway.cli", *cmd], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["shards"] > 1 and (tmp_path / "target" / "tiktoken.model").exists()
    model = load_target(tmp_path / "target", torch.float32, "cpu")
    assert model.cfg.num_hidden_layers == 3
    from drafter_service.checkpoint import load_drafter

    assert load_drafter(tmp_path / "drafter", model.cfg, torch.float32).cfg.target_layer_ids == (1, 2)


def _norm(name: str) -> str:
    return re.sub(r"experts\.\d+\.", "experts.E.", name)


def test_kimi_preset_matches_tiny_structure():
    big = {s.name: s for s in target_specs(presets.target_config("kimi-k2.6", layers=2))}
    tiny = {s.name: s for s in target_specs(presets.target_config("tiny", layers=2))}
    text_big = {_norm(n): s.dtype for n, s in big.items() if n.startswith("language_model.")}
    text_tiny = {_norm(n): s.dtype for n, s in tiny.items() if n.startswith("language_model.")}
    assert text_big == text_tiny  # same names (up to the expert count) and dtypes
    L = "language_model.model.layers.1."
    shapes = {"language_model.model.embed_tokens.weight": (163840, 7168),
              L + "self_attn.q_b_proj.weight": (64 * 192, 1536),
              L + "self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
              L + "mlp.experts.383.gate_proj.weight_packed": (2048, 896),
              L + "mlp.experts.383.gate_proj.weight_scale": (2048, 224),
              L + "mlp.experts.0.down_proj.weight_packed": (7168, 256),
              L + "mlp.experts.0.down_proj.weight_shape": (2,),
              L + "mlp.gate.e_score_correction_bias": (384,), "language_model.lm_head.weight": (163840, 7168)}
    assert {n: big[n].shape for n in shapes} == shapes
    assert any(n.startswith("vision_tower.") for n in big) and any(n.startswith("mm_projector.") for n in big)
    experts = sum(s.nbytes for n, s in big.items() if ".mlp.experts." in n)
    assert experts == 384 * 3 * (2048 * 7168 // 2 + 2048 * 7168 // 32 * 2 + 8)  # one MoE layer, ~9.5 GB


def test_kimi_fast_int4_expert_is_valid():
    """Random words + scales at a real expert shape dequantize to weights of std ~ 1/sqrt(in)."""
    specs = {s.name: s for s in target_specs(presets.target_config("kimi-k2.6", layers=2))}
    b = "language_model.model.layers.1.mlp.experts.7.down_proj."
    packed = torch.cat(list(specs[b + "weight_packed"].make()))
    scale = torch.cat(list(specs[b + "weight_scale"].make()))
    shape = next(iter(specs[b + "weight_shape"].make()))
    assert packed.dtype == torch.int32 and packed.shape == (7168, 256) and scale.dtype == torch.bfloat16
    assert shape.tolist() == [7168, 2048]
    w = dequantize_int4(packed, scale)
    assert w.std().item() == pytest.approx(2048**-0.5, rel=0.1)
    counts = torch.bincount((packed[:64].unsqueeze(-1) >> torch.arange(0, 32, 4)).flatten() & 0xF, minlength=16)
    assert counts.min() > 0.8 * counts.float().mean()  # all 16 nibble values, roughly uniform
    again = torch.cat(list(specs[b + "weight_packed"].make()))
    assert torch.equal(packed, again)  # seeded per tensor: regenerating gives the same bytes


def test_big_tensors_are_generated_in_bounded_chunks():
    specs = {s.name: s for s in target_specs(presets.target_config("kimi-k2.6", layers=2))}
    first = next(iter(specs["language_model.lm_head.weight"].make()))
    assert first.shape[1] == 7168 and first.numel() <= CHUNK_ELEMS and first.shape[0] < 163840


@pytest.mark.parametrize("shape,std", [((512, 7168), 7168**-0.5), ((256, 1536), 1536**-0.5), ((64, 100), 1.0)])
def test_fast_dense_has_the_requested_scale(shape, std):
    from verifier_service.random_checkpoint import fast_dense

    w = torch.cat(list(fast_dense(shape, "k", 0, std))).float()
    assert w.shape == shape and torch.isfinite(w).all()
    assert 0.5 * std < w.std().item() < 2 * std
    assert abs(w.mean().item()) < 0.05 * std and (w > 0).float().mean().item() == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("layers,taps", [(2, [0, 1]), (5, [0, 1, 2, 3, 4]), (8, [1, 3, 4, 5, 6, 7]),
                                         (30, [1, 12, 24, 27, 28, 29]), (61, [1, 12, 24, 35, 47, 58])])
def test_kimi_drafter_taps_of_a_truncated_target(layers, taps):
    """A truncated kimi-k2.6 target keeps a valid drafter: distinct taps that exist (the deepest layer among them),
    one per layer when the target has fewer layers than the drafter's six taps."""
    from drafter_service.config import DFlashConfig

    d = presets.drafter_config("kimi-k2.6", layers)
    assert d["dflash_config"]["target_layer_ids"] == taps
    cfg = DFlashConfig.from_dict(d)
    assert cfg.target_layer_ids == tuple(taps) and cfg.num_target_layers == layers
