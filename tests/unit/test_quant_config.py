"""config.json parsing: every Kimi K2.5/K2.6 field, the three layouts, and the compressed-tensors rule
that decides which modules are INT4 (`re:` = re.match from the start; otherwise the exact module path;
class names such as "Linear" match by class)."""

from __future__ import annotations

import copy
import math

import pytest

from verifier_service import presets
from verifier_service.checkpoint_layout import LINEAR, experts_quantized, target_layout
from verifier_service.config import KimiConfig, QuantConfig, match_name


def test_full_k26_config_parses_to_design_values():
    c = presets.target_config("kimi-k2.6")
    assert {"vision_config", "text_config", "auto_map", "media_placeholder_token_id"} <= c.keys()
    assert {"aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers", "quantization_config",
            "rope_scaling", "pretraining_tp"} <= c["text_config"].keys()
    cfg = KimiConfig.from_dict(c)
    assert cfg.tensor_prefix == "language_model."
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.intermediate_size) == \
        (7168, 61, 1, 18432)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.moe_intermediate_size) == \
        (384, 8, 1, 2048)
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.vocab_size) == (64, 1536, 512, 128, 64, 128, 163840)
    assert cfg.rms_norm_eps == 1e-5 and cfg.routed_scaling_factor == 2.827 and cfg.rope_theta == 50000.0
    m = 0.1 * math.log(64) + 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * m * m)
    assert cfg.quant.group_size == 32 and cfg.quant.targets == ("Linear",)
    assert cfg.eos_ids == (163585,)


@pytest.mark.parametrize("layout,prefix,int4,groups", [
    ("kimi_k25", "language_model.", True, (1, 1)), ("kimi_k2", "", True, (1, 1)), ("deepseek_v3", "", False, (8, 4))])
def test_layouts(layout, prefix, int4, groups):
    cfg = KimiConfig.from_dict(presets.target_config("tiny", layout=layout))
    assert cfg.tensor_prefix == prefix
    assert experts_quantized(cfg) == int4
    assert (cfg.n_group, cfg.topk_group) == groups


def test_match_name_is_compressed_tensors_rule():
    assert match_name("model.layers.0.self_attn.q_a_proj", "re:.*self_attn.*")
    assert match_name("lm_head", "lm_head") and not match_name("language_model.lm_head", "lm_head")
    assert match_name("language_model.lm_head", "re:.*lm_head.*")
    # re.match anchors at the start only
    assert not match_name("model.layers.0.mlp.gate_proj", "re:mlp\\.gate_proj")
    assert match_name("model.layers.0.mlp.gate_proj.extra", "re:.*mlp\\.gate_proj")
    assert not match_name("model.layers.0.mlp.gate_proj", "model.layers.0.mlp")


def test_k2_ignore_list_quantizes_exactly_the_routed_experts():
    q = QuantConfig(ignore=tuple(presets.K2_IGNORE))
    L = "model.layers.3."
    assert q.is_quantized(L + "mlp.experts.17.down_proj", LINEAR)
    for mod in ("self_attn.q_a_proj", "self_attn.kv_b_proj", "mlp.shared_experts.up_proj", "mlp.gate_proj"):
        assert not q.is_quantized(L + mod, LINEAR), mod
    assert not q.is_quantized("lm_head", LINEAR)
    assert not q.is_quantized(L + "mlp.gate", ("MoEGate", "Module"))  # the router is not a Linear
    assert q.is_quantized(L + "mlp.gate", LINEAR)  # ...it would be if it were


def test_k2_ignore_list_with_k26_prefix_quantizes_lm_head():
    """K2's exact "lm_head" does not match K2.6's language_model.lm_head: strict rule, clear error."""
    c = presets.target_config("tiny")
    c["text_config"]["quantization_config"]["ignore"] = list(presets.K2_IGNORE)
    with pytest.raises(ValueError, match="quantizes language_model.lm_head"):
        target_layout(KimiConfig.from_dict(c))


def test_targets_by_name_and_partial_experts():
    c = presets.target_config("tiny", layout="kimi_k2")
    qc = c["quantization_config"]
    qc["config_groups"]["group_0"]["targets"] = ["re:.*experts.*"]  # also matches shared_experts
    qc["ignore"] = []
    with pytest.raises(ValueError, match="quantizes model.layers.1.mlp.shared_experts.gate_proj"):
        experts_quantized(KimiConfig.from_dict(c))
    qc["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\.experts\\."]
    assert experts_quantized(KimiConfig.from_dict(c))
    qc["ignore"] = ["re:model\\.layers\\.3\\.mlp\\.experts\\."]
    with pytest.raises(ValueError, match="some routed experts but not model.layers.3.mlp.experts.0.gate_proj"):
        experts_quantized(KimiConfig.from_dict(c))
    qc["ignore"] = ["re:.*"]
    with pytest.raises(ValueError, match="quantizes no routed expert"):
        experts_quantized(KimiConfig.from_dict(c))


@pytest.mark.parametrize("edit,expect", [
    (lambda q: q.update(format="mxfp4-pack-quantized"), "unsupported format"),
    (lambda q: q["config_groups"]["group_0"].update(format="int-quantized"), "unsupported format 'int-quantized'"),
    (lambda q: q.update(quant_method="fp8"), "unsupported quant_method 'fp8'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "only symmetric INT4"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "only symmetric INT4"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="channel"), "unsupported weights scheme"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder 'group'"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "input_activations"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (lambda q: q.update(ignore=["re:(unclosed"]), "bad regex"),
    (lambda q: q["config_groups"].update(group_1={}), "expected one config group"),
])
def test_unsupported_quantization_configs(edit, expect):
    c = presets.target_config("tiny", layout="kimi_k2")
    edit(c["quantization_config"])
    with pytest.raises(ValueError, match=expect):
        KimiConfig.from_dict(c)


def test_config_errors_name_the_file(tmp_path):
    import json

    c = copy.deepcopy(presets.target_config("tiny"))
    del c["text_config"]["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"config.json: missing fields \['hidden_size'\]"):
        KimiConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        KimiConfig.from_file(tmp_path)
    c = presets.target_config("tiny", layout="deepseek_v3")
    c["n_routed_experts"] = 8  # 8 groups of one expert: group scores need two
    with pytest.raises(ValueError, match="fewer than 2 per group"):
        KimiConfig.from_dict(c)
