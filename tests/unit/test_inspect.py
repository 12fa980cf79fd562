"""`ddtree inspect`: parameter counts and memory from config.json alone, checked against published numbers
(Kimi K2.6: ~1.0T total / ~32B activated; DeepSeek-V3: 671B / 37B) and exact byte formulas."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.unit.ckpt_tools import rewrite, write_tiny
from verifier_service import presets
from verifier_service.config import KimiConfig
from verifier_service.model_size import size_report

# DeepSeek-V3's published text config (the fields that size it)
DSV3 = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8,
        "topk_group": 4, "routed_scaling_factor": 2.5}


def test_kimi_k26_sizes():
    cfg = KimiConfig.from_dict(presets.target_config("kimi-k2.6"))
    r = size_report(cfg, ep_size=8, kv_tokens=1000)
    assert 1.00e12 < r["total_params"] < 1.06e12  # "1T total"
    assert 31e9 < r["active_params"] < 34e9  # "32B activated"
    # one INT4 g32 expert: 3 projections of 2048x7168 as 4-bit words + bf16 scale per 32 + int32 [2] shape
    per_proj = 2048 * 7168 // 2 + 2048 * 7168 // 32 * 2 + 8
    assert r["bytes_per_expert"] == 3 * per_proj == 24_772_632
    assert r["bytes"]["int4_experts"] == 60 * 384 * 3 * per_proj
    assert r["bytes"]["embeddings"] == 2 * 163840 * 7168 * 2
    assert r["bytes"]["bf16_experts"] == 0
    assert 580e9 < r["bytes"]["total"] < 610e9  # "about 600 GB at INT4" (DESIGN 7)
    assert r["kv_bytes_per_token"] == 61 * (512 + 64) * 2
    pr = r["per_rank"]
    rest = r["bytes"]["total"] - r["bytes"]["int4_experts"]
    assert pr["experts_per_rank"] == 48
    assert pr["weight_bytes"] == rest + r["bytes"]["int4_experts"] // 8
    assert pr["total_bytes"] == pr["weight_bytes"] + 1000 * 61 * 576 * 2


def test_deepseek_v3_matches_published_counts():
    r = size_report(KimiConfig.from_dict(DSV3))
    assert r["total_params"] == pytest.approx(671e9, rel=0.005)
    assert r["active_params"] == pytest.approx(37e9, rel=0.02)
    assert r["bytes"]["int4_experts"] == 0 and r["bytes"]["bf16_experts"] == 2 * r["routed_expert_params"]


def test_uneven_expert_split_sizes_the_largest_rank():
    cfg = KimiConfig.from_dict(presets.target_config("kimi-k2.6"))
    r = size_report(cfg, ep_size=5)  # 384 = 5 * 76 + 4: the first four ranks hold 77
    assert r["per_rank"]["experts_per_rank"] == 77


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gateway.cli", "inspect", *args], capture_output=True, text=True)


def test_cli_json_on_config_only_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(presets.target_config("kimi-k2.6")))
    p = run_cli(str(tmp_path), "--json", "--ep-size", "8")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert {"total_params", "active_params", "bytes", "kv_bytes_per_token", "per_rank", "config"} <= r.keys()
    assert r["files"] == {"weights": False}
    assert r["per_rank"]["ep_size"] == 8 and r["config"]["n_routed_experts"] == 384
    assert r["bytes"]["int4_experts"] > 0 and r["bytes"]["total"] == sum(
        v for k, v in r["bytes"].items() if k != "total")
    text = run_cli(str(tmp_path))
    assert text.returncode == 0 and "activated per token" in text.stdout and "70,272 bytes per token" in text.stdout


def test_cli_checks_weights_when_present(tmp_path):
    good = tmp_path / "good"
    write_tiny(good, "kimi_k2")
    r = json.loads(run_cli(str(good), "--json").stdout)
    assert r["files"]["weights"] and r["files"]["checked"] and r["files"]["tensors"] > 0
    bad = rewrite(good, tmp_path / "bad", lambda t: t.pop("model.layers.2.self_attn.o_proj.weight"))
    p = run_cli(str(bad))
    assert p.returncode == 2 and "'model.layers.2.self_attn.o_proj.weight' is missing" in p.stderr


def test_cli_drafter_folder(tmp_path):
    from drafter_service.checkpoint import write_random_drafter

    write_random_drafter(tmp_path, presets.drafter_config("tiny"), 64)
    r = json.loads(run_cli(str(tmp_path), "--json").stdout)
    assert r["kind"] == "drafter" and r["config"]["target_layer_ids"] == [1, 3]
    assert r["total_params"] == sum(json.loads((tmp_path / "model.safetensors.index.json").read_text())
                                    ["metadata"].values()) // 2
