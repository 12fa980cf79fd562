"""The two target tensors a standalone drafter needs: `embed_tokens` and `lm_head` (DESIGN 2.2).

The DFlash drafter has no embedding or output head of its own; as a separate service it reads just
these two from the target checkpoint (a few GB at Kimi K2.6 shapes) instead of the whole target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from verifier_service.config import KimiConfig
from verifier_service.safetensors_io import CheckpointError, ShardedReader


@torch.no_grad()
def load_target_head(folder: str | Path, dtype: torch.dtype, device: str | torch.device,
                     cfg: KimiConfig | None = None) -> tuple[KimiConfig, torch.Tensor, torch.Tensor]:
    """-> (target config, embed_tokens [V, D], lm_head [V, D]) on `device` in `dtype`."""
    folder = Path(folder)
    cfg = cfg or KimiConfig.from_file(folder)
    p = cfg.tensor_prefix
    names = {"embed": f"{p}model.embed_tokens.weight", "head": f"{p}lm_head.weight"}
    if cfg.tie_word_embeddings:
        names["head"] = names["embed"]
    out = {}
    with ShardedReader(folder) as reader:
        for key, name in names.items():
            t = reader.view(name)
            if tuple(t.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise CheckpointError(f"{folder}: tensor {name!r} has shape {list(t.shape)}, expected "
                                      f"[{cfg.vocab_size}, {cfg.hidden_size}] from config.json")
            out[key] = t.to(device=device, dtype=dtype, copy=True)
    return cfg, out["embed"], out["head"]
