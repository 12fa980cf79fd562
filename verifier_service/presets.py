"""Model-pair presets for `ddtree init-random`: config.json contents in the real checkpoint layouts.

`kimi-k2.6` carries the published Kimi K2.6 text-model and DFlash-drafter values (DESIGN 2.1, 2.2)
in the K2.5/K2.6 `kimi_k25` nesting; `tiny` has exactly the same structure, names and packing at
toy sizes so that it runs on two CPU cores.
"""

from __future__ import annotations

import copy

_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
_DRAFT_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
               "beta_slow": 1.0}


def _quant(group: int) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": group, "dynamic": False,
                                                  "observer": "minmax", "actorder": None}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": None,
    }


def _text(**kw) -> dict:
    base = {
        "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "hidden_act": "silu",
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": dict(_YARN),
        "max_position_embeddings": 262144, "tie_word_embeddings": False, "bos_token_id": 163584,
        "eos_token_id": 163585, "torch_dtype": "bfloat16", "attention_bias": False,
    }
    base.update(kw)
    return base


KIMI_K26_TEXT = _text(
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
    num_experts_per_tok=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128)
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
    max_position_embeddings=8192)
TINY_DRAFTER = {
    **KIMI_K26_DRAFTER, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": TINY_VOCAB,
    "num_target_layers": 6, "max_position_embeddings": 8192,
    "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": TINY_VOCAB - 2, "block_size": 8},
}


def target_config(preset: str, layers: int | None = None) -> dict:
    """config.json of the target in the K2.5/K2.6 layout (`kimi_k25` with `text_config`)."""
    text = copy.deepcopy({"tiny": TINY_TEXT, "kimi-k2.6": KIMI_K26_TEXT}[preset])
    if layers is not None:
        text["num_hidden_layers"] = layers
    text["quantization_config"] = _quant(32)
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": text, "torch_dtype": "bfloat16",
            "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"]}


def drafter_config(preset: str, target_layers: int | None = None) -> dict:
    d = copy.deepcopy({"tiny": TINY_DRAFTER, "kimi-k2.6": KIMI_K26_DRAFTER}[preset])
    if target_layers is not None:
        d["num_target_layers"] = target_layers
        n = d["num_hidden_layers"]
        d["dflash_config"]["target_layer_ids"] = [min(i, target_layers - 1) for i in
                                                  d["dflash_config"]["target_layer_ids"]][:n]
    return d


PRESETS = ("tiny", "kimi-k2.6")
