"""Helpers for the checkpoint tests: tiny synthetic folders in each layout and edited (corrupted) copies.

Reading back uses the safetensors library itself (`safe_open`), independent of the loader under test.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from verifier_service import presets
from verifier_service.random_checkpoint import write_random_target
from verifier_service.safetensors_io import INDEX, write_sharded


def write_tiny(folder: Path, layout: str = "kimi_k25", seed: int = 3, shard_bytes: int = 120_000, **kw) -> dict:
    cfg = presets.target_config("tiny", layout=layout)
    write_random_target(folder, cfg, seed=seed, max_shard_bytes=shard_bytes, **kw)
    return cfg


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder through the safetensors library (reference reader)."""
    index = json.loads((folder / INDEX).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(folder / shard, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def rewrite(src: Path, dst: Path, edit: Callable[[dict], None] | None = None,
            config: Callable[[dict], None] | None = None, shard_bytes: int = 120_000) -> Path:
    """Copy a checkpoint folder, letting `edit` change the tensors dict and `config` the config dict."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    tensors = read_all(src)
    if edit:
        edit(tensors)
    cfg = json.loads((src / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    write_sharded(dst, tensors, shard_bytes)
    return dst


def text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)
