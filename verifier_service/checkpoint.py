"""Load a Kimi K2.x / DeepSeek-V3 target from a Hugging Face folder into `KimiForCausalLM`.

Tensor names follow the checkpoint (DESIGN 2.1), with the `language_model.` prefix for K2.5/K2.6.
Routed experts are stacked per layer: INT4 `weight_packed`/`weight_scale`/`weight_shape` go to
`w13_packed`/`w13_scale` (gate rows then up rows) and `w2_packed`/`w2_scale`; bf16 experts to w13/w2.
"""

from __future__ import annotations

from pathlib import Path

import torch

from verifier_service.config import KimiConfig
from verifier_service.model import KimiForCausalLM
from verifier_service.safetensors_io import CheckpointError, ShardedReader


def expert_name(cfg: KimiConfig, layer: int, e: int, proj: str, part: str) -> str:
    return f"{cfg.tensor_prefix}model.layers.{layer}.mlp.experts.{e}.{proj}.{part}"


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], folder: Path) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{folder}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def _stack_experts(reader: ShardedReader, cfg: KimiConfig, layer: int, part: str, folder: Path):
    """-> (w13 [E, 2I, ...], w2 [E, D, ...]) for part in weight_packed / weight_scale / weight."""
    w13, w2 = [], []
    for e in range(cfg.n_routed_experts):
        g = reader.get(expert_name(cfg, layer, e, "gate_proj", part))
        u = reader.get(expert_name(cfg, layer, e, "up_proj", part))
        w13.append(torch.cat((g, u), 0))
        w2.append(reader.get(expert_name(cfg, layer, e, "down_proj", part)))
    return torch.stack(w13), torch.stack(w2)


@torch.no_grad()
def load_target(folder: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                cfg: KimiConfig | None = None) -> KimiForCausalLM:
    folder = Path(folder)
    cfg = cfg or KimiConfig.from_file(folder)
    reader = ShardedReader(folder)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg)
    model = model.to_empty(device=device)
    p = cfg.tensor_prefix
    for name, param in list(model.named_parameters()) + list(model.named_buffers()):
        if ".mlp.w13" in name or ".mlp.w2" in name:
            continue
        src = p + name
        t = _check(src, reader.get(src), param.shape, folder)
        param.copy_(t.to(param.dtype))
    for i, layer in enumerate(model.model.layers):
        moe = layer.mlp
        if not cfg.is_moe_layer(i):
            continue
        if moe.quantized:
            for part, (a, b) in (("weight_packed", ("w13_packed", "w2_packed")),
                                 ("weight_scale", ("w13_scale", "w2_scale"))):
                w13, w2 = _stack_experts(reader, cfg, i, part, folder)
                getattr(moe, a).copy_(_check(f"layer {i} experts {part}", w13, getattr(moe, a).shape, folder))
                getattr(moe, b).copy_(_check(f"layer {i} experts {part}", w2, getattr(moe, b).shape, folder))
        else:
            w13, w2 = _stack_experts(reader, cfg, i, "weight", folder)
            moe.w13.copy_(_check(f"layer {i} experts weight", w13, moe.w13.shape, folder))
            moe.w2.copy_(_check(f"layer {i} experts weight", w2, moe.w2.shape, folder))
    # compute dtype for weights; INT4 words stay int32 and scales stay bf16 for the kernels
    for mod in model.modules():
        for prm in list(mod.parameters(recurse=False)):
            prm.data = prm.data.to(dtype)
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias = mod.e_score_correction_bias.float()
    model.build_rope()  # rope tables were created on the meta device
    return model.eval()
