"""Write a random-weight Kimi target in the real K2.5/K2.6 checkpoint layout (for tests and benchmarks).

Same names, shapes, dtypes and INT4 packing as a downloaded checkpoint: bf16 dense weights, fp32
`e_score_correction_bias`, routed experts as compressed-tensors `weight_packed`/`weight_scale`/
`weight_shape`, sharded with an index. Weights are generated one tensor at a time, so real-shape
checkpoints (truncated to a few layers) stay within host memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from kernels.int4_pack import pack_int4, quantize_int4
from verifier_service.config import KimiConfig
from verifier_service.safetensors_io import write_sharded


def _dense(g: torch.Generator, out_f: int, in_f: int) -> torch.Tensor:
    return (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(torch.bfloat16)


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)


def target_tensors(cfg: KimiConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, tensor) in file order."""
    g = torch.Generator().manual_seed(seed)
    p, D, H = cfg.tensor_prefix, cfg.hidden_size, cfg.num_attention_heads
    yield f"{p}model.embed_tokens.weight", torch.randn(cfg.vocab_size, D, generator=g).to(torch.bfloat16)
    for i in range(cfg.num_hidden_layers):
        L = f"{p}model.layers.{i}."
        yield L + "input_layernorm.weight", _norm(g, D)
        yield L + "post_attention_layernorm.weight", _norm(g, D)
        a = L + "self_attn."
        if cfg.q_lora_rank:
            yield a + "q_a_proj.weight", _dense(g, cfg.q_lora_rank, D)
            yield a + "q_a_layernorm.weight", _norm(g, cfg.q_lora_rank)
            yield a + "q_b_proj.weight", _dense(g, H * cfg.qk_head_dim, cfg.q_lora_rank)
        else:
            yield a + "q_proj.weight", _dense(g, H * cfg.qk_head_dim, D)
        yield a + "kv_a_proj_with_mqa.weight", _dense(g, cfg.kv_row_dim, D)
        yield a + "kv_a_layernorm.weight", _norm(g, cfg.kv_lora_rank)
        yield a + "kv_b_proj.weight", _dense(g, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        yield a + "o_proj.weight", _dense(g, D, H * cfg.v_head_dim)
        m = L + "mlp."
        if not cfg.is_moe_layer(i):
            yield m + "gate_proj.weight", _dense(g, cfg.intermediate_size, D)
            yield m + "up_proj.weight", _dense(g, cfg.intermediate_size, D)
            yield m + "down_proj.weight", _dense(g, D, cfg.intermediate_size)
            continue
        yield m + "gate.weight", _dense(g, cfg.n_routed_experts, D)
        yield m + "gate.e_score_correction_bias", 0.1 * torch.randn(cfg.n_routed_experts, generator=g)
        si = cfg.moe_intermediate_size * cfg.n_shared_experts
        yield m + "shared_experts.gate_proj.weight", _dense(g, si, D)
        yield m + "shared_experts.up_proj.weight", _dense(g, si, D)
        yield m + "shared_experts.down_proj.weight", _dense(g, D, si)
        inter = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            for proj, (o, n) in (("gate_proj", (inter, D)), ("up_proj", (inter, D)), ("down_proj", (D, inter))):
                w = _dense(g, o, n).float()
                name = f"{m}experts.{e}.{proj}."
                if cfg.quant is None:
                    yield name + "weight", w.to(torch.bfloat16)
                    continue
                q, scale = quantize_int4(w, cfg.quant.group_size)
                yield name + "weight_packed", pack_int4(q)
                yield name + "weight_scale", scale
                yield name + "weight_shape", torch.tensor([o, n], dtype=torch.int32)
    yield f"{p}model.norm.weight", _norm(g, D)
    yield f"{p}lm_head.weight", _dense(g, cfg.vocab_size, D)


def write_random_target(folder: str | Path, config: dict, seed: int = 0, max_shard_bytes: int = 5 << 30) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = KimiConfig.from_dict(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_sharded(folder, target_tensors(cfg, seed), max_shard_bytes)
