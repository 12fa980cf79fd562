"""Sharded safetensors reading and writing (Hugging Face layout with model.safetensors.index.json).

Reading is memory-mapped and tensor by tensor (`safe_open`), so peak host memory stays around one
tensor, not one shard. Used for the target and, through it, by the drafter (which borrows the
target's embed_tokens and lm_head).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and tensor."""


class ShardedReader:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        idx = self.folder / INDEX
        if idx.exists():
            self.weight_map: dict[str, str] = json.loads(idx.read_text())["weight_map"]
        elif (self.folder / SINGLE).exists():
            with safe_open(self.folder / SINGLE, "pt") as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise CheckpointError(f"{self.folder}: neither {INDEX} nor {SINGLE} exists")
        for shard in sorted(set(self.weight_map.values())):
            if not (self.folder / shard).exists():
                raise CheckpointError(f"{self.folder / shard}: shard listed in {INDEX} is missing")
        self._open: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def keys(self):
        return self.weight_map.keys()

    def get(self, name: str) -> torch.Tensor:
        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is not in the checkpoint")
        f = self._open.get(shard)
        if f is None:
            f = self._open[shard] = safe_open(self.folder / shard, "pt")
        return f.get_tensor(name)


def write_sharded(folder: str | Path, tensors, max_shard_bytes: int) -> None:
    """Write (name, tensor) pairs in order into shards of at most ~max_shard_bytes, plus the index.

    `tensors` may be a generator: each shard is written as soon as it is full, so host memory
    holds one shard at a time, not the checkpoint.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    items = tensors.items() if isinstance(tensors, dict) else tensors
    written: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        tmp = f"shard-{len(written):05d}.tmp"
        save_file(shard, folder / tmp, metadata={"format": "pt"})
        written.append((tmp, list(shard)))

    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t.contiguous()
        size += nbytes
        total += nbytes
    if shard:
        flush()
    weight_map = {}
    for i, (tmp, names) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        (folder / tmp).rename(folder / fname)
        weight_map.update({k: fname for k in names})
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
