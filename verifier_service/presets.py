"""Model-pair presets for `ddtree init-random` and the tests: config.json contents in the real layouts.

Sizes come from the preset (`kimi-k2.6`: the published Kimi K2.6 text-model and DFlash-drafter values,
DESIGN 2.1/2.2; `tiny`: the same structure at toy sizes for two CPU cores). The layout comes from
`layout`, mirroring the published config.json files field for field:
- `kimi_k25` (K2.5 / K2.6): `KimiK25ForConditionalGeneration`, text model under `text_config` with its
  compressed-tensors `quantization_config`, a `vision_config`, tensors prefixed `language_model.`.
- `kimi_k2` (K2 / K2-Thinking): `DeepseekV3ForCausalLM` fields at the top level, top-level
  `quantization_config` whose ignore list names `lm_head` exactly, no prefix.
- `deepseek_v3`: plain DeepSeek-V3 (bf16 experts, no quantization_config, grouped routing n_group 8 /
  topk_group 4, one MTP layer in the files beyond num_hidden_layers).
"""

from __future__ import annotations

import copy

_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
_DRAFT_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
               "beta_slow": 1.0}
_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
             "AutoModel": "modeling_deepseek.DeepseekV3Model",
             "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}

# ignore lists as published: K2 names lm_head exactly; K2.5/K2.6 match it (and the vision parts) by regex
K2_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
K25_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
              "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]
LAYOUTS = ("kimi_k25", "kimi_k2", "deepseek_v3")


def quant_config(group: int, ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "global_compression_ratio": None, "sparsity_config": {}, "kv_cache_scheme": None, "ignore": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": group, "dynamic": False,
                                                  "observer": "minmax", "observer_kwargs": {}, "actorder": None,
                                                  "block_structure": None}}},
    }


def _text(**kw) -> dict:
    """Every field of the published Kimi K2.x text config (DeepseekV3 architecture)."""
    base = {
        "architectures": ["DeepseekV3ForCausalLM"], "auto_map": dict(_AUTO_MAP), "model_type": "kimi_k2",
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1,
        "first_k_dense_replace": 1, "hidden_act": "silu", "initializer_range": 0.02, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "norm_topk_prob": True, "num_nextn_predict_layers": 0,
        "pretraining_tp": 1, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
        "topk_method": "noaux_tc", "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": dict(_YARN),
        "max_position_embeddings": 262144, "tie_word_embeddings": False, "bos_token_id": 163584,
        "eos_token_id": 163585, "pad_token_id": 163839, "torch_dtype": "bfloat16", "use_cache": True,
    }
    base.update(kw)
    return base


KIMI_K26_TEXT = _text(
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
    num_experts_per_tok=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128)
KIMI_K26_VISION = {
    "_attn_implementation": "flash_attention_2", "init_pos_emb_height": 64, "init_pos_emb_width": 64,
    "init_pos_emb_time": 4, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": 1152,
    "mm_projector_type": "patchmerger", "patch_size": 14, "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": 7168,
    "video_attn_type": "spatial_temporal", "vt_hidden_size": 1152, "vt_intermediate_size": 4304,
    "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27,
}
KIMI_K26_DRAFTER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168, "num_hidden_layers": 6,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 18432,
    "vocab_size": 163840, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": dict(_DRAFT_YARN),
    "max_position_embeddings": 262144, "num_target_layers": 61, "block_size": 8, "torch_dtype": "bfloat16",
    "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838, "block_size": 8},
}

TINY_VOCAB = 320  # 256 bytes + 64 special tokens
TINY_SPECIALS = {256: "[BOS]", 257: "[EOS]", 258: "<|im_end|>", 259: "<|im_user|>", 260: "<|im_assistant|>",
                 261: "<|im_system|>", 262: "<|im_middle|>", TINY_VOCAB - 2: "<|dflash_mask|>"}
TINY_TEXT = _text(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, bos_token_id=256, eos_token_id=257,
    pad_token_id=TINY_VOCAB - 1, max_position_embeddings=8192)
TINY_VISION = {**KIMI_K26_VISION, "mm_hidden_size": 16, "text_hidden_size": 64, "vt_hidden_size": 16,
               "vt_intermediate_size": 32, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1}
TINY_DRAFTER = {
    **KIMI_K26_DRAFTER, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": TINY_VOCAB,
    "num_target_layers": 6, "max_position_embeddings": 8192,
    "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": TINY_VOCAB - 2, "block_size": 8},
}


def _deepseek_v3(text: dict) -> dict:
    """The same sizes in plain DeepSeek-V3 form: grouped routing, bf16 experts, one MTP layer."""
    E = max(16, text["n_routed_experts"] // 8 * 8)  # 8 groups of >= 2 experts
    return {**text, "model_type": "deepseek_v3", "n_routed_experts": E, "n_group": 8, "topk_group": 4,
            "num_experts_per_tok": min(text["num_experts_per_tok"], 4 * E // 8), "routed_scaling_factor": 2.5,
            "num_nextn_predict_layers": 1, "rope_theta": 10000.0,
            "rope_scaling": {**_YARN, "factor": 40.0, "beta_fast": 32, "beta_slow": 1}}


def target_config(preset: str, layers: int | None = None, layout: str = "kimi_k25") -> dict:
    """config.json of the target at the preset's sizes in one of the LAYOUTS."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (choose from {', '.join(LAYOUTS)})")
    text = copy.deepcopy({"tiny": TINY_TEXT, "kimi-k2.6": KIMI_K26_TEXT}[preset])
    if layers is not None:
        text["num_hidden_layers"] = layers
    if layout == "deepseek_v3":
        return _deepseek_v3(text)
    if layout == "kimi_k2":
        return {**text, "quantization_config": quant_config(32, K2_IGNORE)}
    text["quantization_config"] = quant_config(32, K25_IGNORE)
    vision = copy.deepcopy(TINY_VISION if preset == "tiny" else KIMI_K26_VISION)
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                         "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                         "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
            "text_config": text, "vision_config": vision, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
            "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
            "pad_token_id": text["pad_token_id"], "ignore_index": -100, "media_placeholder_token_id": 163605,
            "use_unified_vision_chunk": True, "video_placeholder": "<|kimi_k25_video_placeholder|>"}


def truncated_tap_ids(ids: list[int], target_layers: int) -> list[int]:
    """The drafter's taps of a target truncated to `target_layers` layers: the ids that still exist, then the
    deepest unused layers, min(len(ids), target_layers) distinct ids in all, ascending (a drafter config needs
    distinct taps, so a target with fewer layers than taps gets one tap per layer: a narrower `fc`)."""
    kept = [i for i in ids if i < target_layers]
    extra = [i for i in range(target_layers - 1, -1, -1) if i not in kept]
    return sorted(kept + extra[: min(len(ids), target_layers) - len(kept)])


def drafter_config(preset: str, target_layers: int | None = None) -> dict:
    d = copy.deepcopy({"tiny": TINY_DRAFTER, "kimi-k2.6": KIMI_K26_DRAFTER}[preset])
    if target_layers is not None:
        d["num_target_layers"] = target_layers
        d["dflash_config"]["target_layer_ids"] = truncated_tap_ids(d["dflash_config"]["target_layer_ids"],
                                                                   target_layers)
    return d


PRESETS = ("tiny", "kimi-k2.6")
