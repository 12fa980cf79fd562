"""Corrupted checkpoints fail with one clear message naming the file and the tensor, before the model is
allocated on the device (`build_empty_target` is replaced by a tripwire in every test here)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.unit.ckpt_tools import rewrite, text, write_tiny
from verifier_service.checkpoint import load_target
from verifier_service.safetensors_io import INDEX, CheckpointError

P = "language_model.model.layers."
EXPERT = P + "2.mlp.experts.5.up_proj."


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    write_tiny(d, "kimi_k25")
    return d


@pytest.fixture(autouse=True)
def no_device(monkeypatch):
    def tripwire(*a, **k):
        raise AssertionError("the model was built before the checkpoint was validated")

    monkeypatch.setattr("verifier_service.checkpoint.build_empty_target", tripwire)


def load_err(folder, exc=CheckpointError) -> str:
    with pytest.raises(exc) as ei:
        load_target(folder, torch.float32, "cpu")
    return str(ei.value)


def shard_of(folder, name) -> str:
    return json.loads((folder / INDEX).read_text())["weight_map"][name]


def test_missing_shard(good, tmp_path):
    bad = rewrite(good, tmp_path / "c")
    victim = shard_of(bad, EXPERT + "weight_packed")
    (bad / victim).unlink()
    msg = load_err(bad)
    assert str(bad / victim) in msg and "missing" in msg


def test_missing_tensor(good, tmp_path):
    bad = rewrite(good, tmp_path / "c", lambda t: t.pop(EXPERT + "weight_scale"))
    msg = load_err(bad)
    assert INDEX in msg and repr(EXPERT + "weight_scale") in msg and "missing" in msg


def test_index_points_to_wrong_shard(good, tmp_path):
    bad = rewrite(good, tmp_path / "c")
    idx = json.loads((bad / INDEX).read_text())
    name = P + "3.self_attn.o_proj.weight"
    other = next(s for s in sorted(set(idx["weight_map"].values())) if s != idx["weight_map"][name])
    idx["weight_map"][name] = other
    (bad / INDEX).write_text(json.dumps(idx))
    msg = load_err(bad)
    assert str(bad / other) in msg and repr(name) in msg


@pytest.mark.parametrize("name,new,expect", [
    (P + "1.self_attn.q_b_proj.weight", lambda t: t[:-1], r"shape \[\d+, 32\], expected \[\d+, 32\]"),
    (EXPERT + "weight_packed", lambda t: t.to(torch.int64), "dtype I64, expected I32"),
    (EXPERT + "weight_scale", lambda t: t.float(), "dtype F32, expected BF16"),
    (P + "4.input_layernorm.weight", lambda t: t.to(torch.float8_e4m3fn), "dtype F8_E4M3"),
    (EXPERT + "weight_shape", lambda t: torch.tensor([32, 32], dtype=torch.int32), r"= \[32, 32\].*\[32, 64\]"),
    (P + "2.mlp.gate.e_score_correction_bias", lambda t: t[:4], r"shape \[4\], expected \[8\]"),
])
def test_wrong_shape_dtype_or_value(good, tmp_path, name, new, expect):
    def edit(t):
        t[name] = new(t[name])

    bad = rewrite(good, tmp_path / "c", edit)
    msg = load_err(bad)
    assert str(bad / shard_of(bad, name)) in msg and repr(name) in msg
    assert re.search(expect, msg), msg


def test_truncated_shard(good, tmp_path):
    bad = rewrite(good, tmp_path / "c")
    victim = bad / shard_of(bad, P + "3.self_attn.kv_b_proj.weight")
    victim.write_bytes(victim.read_bytes()[:-100])
    msg = load_err(bad)
    assert str(victim) in msg and "truncated or corrupt" in msg


def test_corrupt_header(good, tmp_path):
    bad = rewrite(good, tmp_path / "c")
    victim = bad / shard_of(bad, P + "1.self_attn.o_proj.weight")
    raw = bytearray(victim.read_bytes())
    raw[8:12] = b"!!!!"
    victim.write_bytes(bytes(raw))
    msg = load_err(bad)
    assert str(victim) in msg and "header" in msg


@pytest.mark.parametrize("field,value,expect", [
    ("format", "mxfp4-pack-quantized", "unsupported format 'mxfp4-pack-quantized'"),
    ("quant_method", "fp8", "unsupported quant_method 'fp8'"),
    ("quantization_status", "frozen", "not packed"),
])
def test_unknown_quantization(good, tmp_path, field, value, expect):
    def cfg(c):
        text(c)["quantization_config"][field] = value

    bad = rewrite(good, tmp_path / "c", config=cfg)
    msg = load_err(bad, ValueError)
    assert str(bad / "config.json") in msg and expect in msg


def test_quantized_attention_in_files(good, tmp_path):
    """The files pack an attention projection (a module DDTree serves in bf16 only)."""
    from kernels.int4_pack import pack_int4, quantize_int4

    mod = P + "1.self_attn.q_a_proj"

    def edit(t):
        q, s = quantize_int4(t.pop(mod + ".weight").float(), 32)
        t[mod + ".weight_packed"], t[mod + ".weight_scale"] = pack_int4(q), s
        t[mod + ".weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int32)

    bad = rewrite(good, tmp_path / "c", edit)
    msg = load_err(bad)
    assert str(bad / shard_of(bad, mod + ".weight_packed")) in msg and mod in msg
    assert "quantized in the files" in msg and "attention" in msg


def test_quantized_attention_in_config(good, tmp_path):
    def cfg(c):
        text(c)["quantization_config"]["ignore"].remove("re:.*self_attn.*")

    bad = rewrite(good, tmp_path / "c", config=cfg)
    msg = load_err(bad)
    assert str(bad / "config.json") in msg and "self_attn.q_a_proj" in msg and "only routed experts" in msg


def test_packed_experts_without_quantization_config(good, tmp_path):
    bad = rewrite(good, tmp_path / "c", config=lambda c: text(c).pop("quantization_config"))
    msg = load_err(bad)
    assert "mlp.experts." in msg and "quantized in the files" in msg and "no quantization_config" in msg


def test_config_from_another_layout(good, tmp_path):
    """A K2-style config (no prefix) next to K2.6 files: the missing name comes with a hint."""
    def cfg(c):
        t = c.pop("text_config")
        c.clear()
        c.update(t)

    bad = rewrite(good, tmp_path / "c", config=cfg)
    msg = load_err(bad)
    assert "'model.embed_tokens.weight' is missing" in msg and "language_model.model.embed_tokens.weight" in msg


def test_not_a_target_config(tmp_path):
    from drafter_service.checkpoint import write_random_drafter
    from verifier_service import presets

    write_random_drafter(tmp_path, presets.drafter_config("tiny"), 64)
    with pytest.raises(ValueError, match="model_type 'qwen3' is not a Kimi"):
        load_target(tmp_path, torch.float32, "cpu")
