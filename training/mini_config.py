"""Config dicts of the `kimi-mini` pair, in the same layouts as `verifier_service.presets` (K2.6 nesting).

Target: Kimi K2.6 architecture at small size — MLA with q_lora, dense layer 0, then MoE layers with
16 routed experts (top-2, noaux_tc sigmoid routing with e_score_correction_bias, routed scaling 2.827)
plus one shared expert, YaRN rope as K2.6; routed experts INT4 g32 (compressed-tensors). Vocabulary
4096 = 4032 byte-level BPE ranks + 64 specials ([BOS] 4032, [EOS] 4033, ..., mask 4094).
Drafter: 2 DFlash layers, block size 8, taps after target layers 1, 3, 5.
"""

from __future__ import annotations

import copy

from verifier_service import presets

VOCAB = 4096
BOS, EOS, MASK, PAD = VOCAB - 64, VOCAB - 63, VOCAB - 2, VOCAB - 1

MINI_TEXT = {
    "vocab_size": VOCAB, "hidden_size": 320, "intermediate_size": 1024, "moe_intermediate_size": 128,
    "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 16,
    "num_experts_per_tok": 2, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "bos_token_id": BOS, "eos_token_id": EOS,
    "max_position_embeddings": 8192, "pad_token_id": VOCAB - 1,
}
MINI_DRAFTER = {
    "hidden_size": 320, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 768, "vocab_size": VOCAB, "num_target_layers": 6, "max_position_embeddings": 8192,
    "block_size": 8, "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": MASK, "block_size": 8},
}


def target_config() -> dict:
    """config.json of the kimi-mini target (KimiK25ForConditionalGeneration / text_config / INT4 g32)."""
    cfg = presets.target_config("tiny")
    cfg["text_config"].update(copy.deepcopy(MINI_TEXT))
    cfg["bos_token_id"], cfg["eos_token_id"] = BOS, EOS
    cfg["text_config"]["pad_token_id"] = cfg["pad_token_id"] = PAD
    if "media_placeholder_token_id" in cfg:  # K2.6 has one; ours is a reserved special id
        cfg["media_placeholder_token_id"] = VOCAB - 64 + 11
    if "text_hidden_size" in cfg.get("vision_config", {}):
        cfg["vision_config"]["text_hidden_size"] = MINI_TEXT["hidden_size"]
    return cfg


def drafter_config(block_size: int = 8) -> dict:
    cfg = presets.drafter_config("tiny")
    cfg.update(copy.deepcopy(MINI_DRAFTER))
    cfg["block_size"] = cfg["dflash_config"]["block_size"] = block_size
    return cfg
