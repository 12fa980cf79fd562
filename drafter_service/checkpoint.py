"""Load / write a DFlash drafter in its Hugging Face layout, checked against its target.

Tensor names: fc.weight, hidden_norm.weight, norm.weight, layers.{i}.{input_layernorm,
post_attention_layernorm}.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
layers.{i}.self_attn.{q,k}_norm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight; a `model.` prefix
may occur. The drafter has no embedding or lm_head: it borrows the target's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from drafter_service.config import DFlashConfig
from drafter_service.model import DFlashDrafter
from verifier_service.config import KimiConfig
from verifier_service.safetensors_io import CheckpointError, ShardedReader, write_sharded


def check_pair(d: DFlashConfig, t: KimiConfig) -> None:
    """A drafter built for another target fails here, before any weights move."""
    if d.hidden_size != t.hidden_size:
        raise ValueError(f"drafter hidden_size {d.hidden_size} != target hidden_size {t.hidden_size}")
    if d.vocab_size != t.vocab_size:
        raise ValueError(f"drafter vocab_size {d.vocab_size} != target vocab_size {t.vocab_size}")
    bad = [i for i in d.target_layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {list(d.target_layer_ids)}: {bad} outside the target's "
                         f"{t.num_hidden_layers} layers")
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise ValueError(f"drafter mask_token_id {d.mask_token_id} outside the target vocabulary")


@torch.no_grad()
def load_drafter(folder: str | Path, target_cfg: KimiConfig, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu") -> DFlashDrafter:
    folder = Path(folder)
    cfg = DFlashConfig.from_file(folder)
    check_pair(cfg, target_cfg)
    reader = ShardedReader(folder)
    prefix = "model." if any(k.startswith("model.layers.") for k in reader.keys()) else ""
    model = DFlashDrafter(cfg, target_cfg.hidden_size)
    for name, param in model.named_parameters():
        t = reader.get(prefix + name)
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(f"{folder}: tensor {prefix + name!r} has shape {tuple(t.shape)}, "
                                  f"expected {tuple(param.shape)}")
        param.copy_(t.to(param.dtype))
    return model.to(device=device, dtype=dtype).eval()


def write_random_drafter(folder: str | Path, config: dict, target_hidden: int, seed: int = 0) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = DFlashConfig.from_dict(config)
    g = torch.Generator().manual_seed(seed + 1)
    model = DFlashDrafter(cfg, target_hidden)
    tensors = {}
    for name, p in model.named_parameters():
        if p.dim() == 1:
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            t = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
        tensors[name] = t.to(torch.bfloat16)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_sharded(folder, tensors, 5 << 30)
