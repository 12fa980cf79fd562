"""Export trained modules in the real checkpoint layouts, and read them back as dense training models.

Target: Kimi K2.5/K2.6 HF layout (`config.json` with `text_config` + compressed-tensors
`quantization_config`, `language_model.` tensor prefix, `model.safetensors.index.json`). Every tensor
except the routed experts is `prefix + <module parameter name>` in bf16 (the router's
`e_score_correction_bias` in fp32) — exactly the names `verifier_service.checkpoint.load_target`
reads; routed experts are quantized with `kernels.int4_pack.quantize_int4`/`pack_int4` into
`weight_packed`/`weight_scale`/`weight_shape` per projection (names from `checkpoint.expert_name`).
Drafter: DFlash layout (`fc`, `hidden_norm`, `norm`, `layers.{i}...` in bf16) + config.json.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from drafter_service.model import DFlashDrafter
from kernels.int4_pack import dequantize_int4, pack_int4, quantize_int4
from verifier_service.checkpoint import expert_name, load_target
from verifier_service.config import KimiConfig
from verifier_service.model import KimiForCausalLM
from verifier_service.safetensors_io import write_sharded


def dense_config(cfg: KimiConfig) -> KimiConfig:
    """The same model with bf16/fp32 routed experts (w13/w2 parameters) for training."""
    return dataclasses.replace(cfg, quant=None)


def target_tensors(model: KimiForCausalLM, cfg: KimiConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) in module order; `cfg` is the exported (quantized) config."""
    p, group = cfg.tensor_prefix, cfg.quant.group_size
    inter = cfg.moe_intermediate_size
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".mlp.w13" in name:
            layer = int(name.split(".")[2])
            w13, w2 = t.detach().float().cpu(), model.model.layers[layer].mlp.w2.detach().float().cpu()
            for e in range(cfg.n_routed_experts):
                for proj, w in (("gate_proj", w13[e, :inter]), ("up_proj", w13[e, inter:]), ("down_proj", w2[e])):
                    q, scale = quantize_int4(w, group)
                    yield expert_name(cfg, layer, e, proj, "weight_packed"), pack_int4(q)
                    yield expert_name(cfg, layer, e, proj, "weight_scale"), scale
                    yield expert_name(cfg, layer, e, proj, "weight_shape"), torch.tensor(list(w.shape),
                                                                                         dtype=torch.int32)
            continue
        if ".mlp.w2" in name:
            continue
        dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        yield p + name, t.detach().cpu().to(dtype)


def write_target(model: KimiForCausalLM, folder: str | Path, config: dict, max_shard_bytes: int = 8 << 20) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = KimiConfig.from_dict(config)
    if cfg.quant is None:
        raise ValueError("export config has no quantization_config")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_sharded(folder, target_tensors(model, cfg), max_shard_bytes)


def write_drafter(model: DFlashDrafter, folder: str | Path, config: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {n: p.detach().cpu().to(torch.bfloat16) for n, p in model.named_parameters()}
    write_sharded(folder, tensors, 16 << 20)


@torch.no_grad()
def load_target_dense(folder: str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> KimiForCausalLM:
    """An exported target as a dense model: routed experts dequantized with the reference rule, so
    training code computes exactly the checkpoint's function (up to the compute dtype)."""
    q = load_target(folder, torch.float32, "cpu")
    dense = KimiForCausalLM(dense_config(q.cfg))
    state = {k: v for k, v in q.state_dict().items() if "_packed" not in k and "_scale" not in k}
    for i, layer in enumerate(q.model.layers):
        m = layer.mlp
        if getattr(m, "quantized", False):
            state[f"model.layers.{i}.mlp.w13"] = dequantize_int4(m.w13_packed, m.w13_scale)
            state[f"model.layers.{i}.mlp.w2"] = dequantize_int4(m.w2_packed, m.w2_scale)
    dense.load_state_dict(state, strict=True)
    dense = dense.to(device=device, dtype=dtype)
    for mod in dense.modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias = mod.e_score_correction_bias.float()
    dense.build_rope()
    return dense.eval()
