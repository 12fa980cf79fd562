"""DFlash drafter folders: config fallbacks, the default target_layer_ids rule, names with or without
`model.`, and the checks that reject a drafter built for another target before any weight moves."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from drafter_service.checkpoint import check_pair, load_drafter, write_random_drafter
from drafter_service.config import DFlashConfig, default_target_layer_ids
from tests.unit.ckpt_tools import read_all
from verifier_service import presets
from verifier_service.config import KimiConfig
from verifier_service.safetensors_io import CheckpointError

TARGET = KimiConfig.from_dict(presets.target_config("tiny"))


def test_default_layer_rule():
    assert default_target_layer_ids(61, 6) == (1, 12, 24, 35, 47, 58)  # the Kimi K2.6 drafter's published ids
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(10, 1) == (1,)
    d = copy.deepcopy(presets.KIMI_K26_DRAFTER)
    del d["dflash_config"]["target_layer_ids"]
    assert DFlashConfig.from_dict(d).target_layer_ids == (1, 12, 24, 35, 47, 58)


def test_dflash_config_wins_then_top_level_fallback():
    d = copy.deepcopy(presets.TINY_DRAFTER)
    d.update(block_size=4, mask_token_id=5, target_layer_ids=[0, 2])
    c = DFlashConfig.from_dict(d)
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (8, presets.TINY_VOCAB - 2, (1, 3))
    del d["dflash_config"]
    c = DFlashConfig.from_dict(d)
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (4, 5, (0, 2))
    del d["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id is missing"):
        DFlashConfig.from_dict(d)


@pytest.mark.parametrize("prefix", ["", "model."])
def test_round_trip_with_or_without_prefix(tmp_path, prefix):
    write_random_drafter(tmp_path, presets.drafter_config("tiny"), 64, seed=4, prefix=prefix)
    files = read_all(tmp_path)
    assert all(k.startswith(prefix) for k in files)
    model = load_drafter(tmp_path, TARGET, torch.float64, "cpu")
    n = 0
    for name, p in model.named_parameters():
        assert torch.equal(p, files[prefix + name].double()), name
        n += 1
    assert n == len(files)
    assert model.rope.inv_freq.device.type == "cpu" and torch.isfinite(model.rope.inv_freq).all()


def other_target(**kw):
    c = presets.target_config("tiny")
    c["text_config"].update(kw)
    return KimiConfig.from_dict(c)


@pytest.mark.parametrize("target,expect", [
    (other_target(hidden_size=96), "hidden_size 64 != target hidden_size 96"),
    (other_target(vocab_size=400), "vocab_size 320 != target vocab_size 400"),
    (other_target(num_hidden_layers=3), r"\[3\] outside the target's 3 layers"),
    (other_target(num_hidden_layers=8), "num_target_layers 6 != target num_hidden_layers 8"),
])
def test_drafter_for_another_target(tmp_path, target, expect, monkeypatch):
    write_random_drafter(tmp_path, presets.drafter_config("tiny"), 64)
    with pytest.raises(ValueError, match=expect):
        check_pair(DFlashConfig.from_file(tmp_path), target)
    monkeypatch.setattr("drafter_service.checkpoint.ShardedReader", None)  # must fail before opening weights
    with pytest.raises(ValueError, match=expect) as ei:
        load_drafter(tmp_path, target, torch.float32)
    assert str(tmp_path / "config.json") in str(ei.value)


def test_mask_token_outside_vocab():
    d = copy.deepcopy(presets.TINY_DRAFTER)
    d["dflash_config"]["mask_token_id"] = presets.TINY_VOCAB
    with pytest.raises(ValueError, match="mask_token_id 320 is outside the vocabulary"):
        DFlashConfig.from_dict(d)


def test_missing_and_misshapen_tensors(tmp_path):
    from verifier_service.safetensors_io import write_sharded

    write_random_drafter(tmp_path, presets.drafter_config("tiny"), 64)
    files = read_all(tmp_path)
    files.pop("layers.1.self_attn.k_norm.weight")
    for p in tmp_path.glob("*.safetensors*"):
        p.unlink()
    write_sharded(tmp_path, files, 1 << 20)
    with pytest.raises(CheckpointError, match=r"index.json: tensor 'layers.1.self_attn.k_norm.weight' \(or 'model"):
        load_drafter(tmp_path, TARGET, torch.float32)
    files["layers.1.self_attn.k_norm.weight"] = torch.ones(8, dtype=torch.bfloat16)
    for p in tmp_path.glob("*.safetensors*"):
        p.unlink()
    write_sharded(tmp_path, files, 1 << 20)
    with pytest.raises(CheckpointError, match=r"safetensors: tensor 'layers.1.self_attn.k_norm.weight' has shape "
                                              r"\[8\], expected \[16\]"):
        load_drafter(tmp_path, TARGET, torch.float32)


def test_drafter_config_errors_name_the_file(tmp_path):
    d = copy.deepcopy(presets.TINY_DRAFTER)
    del d["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"config.json: drafter config: missing field 'hidden_size'"):
        DFlashConfig.from_file(tmp_path)
