"""Load / write a DFlash drafter in its Hugging Face layout, checked against its target.

Tensor names: fc.weight, hidden_norm.weight, norm.weight, layers.{i}.{input_layernorm,
post_attention_layernorm}.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
layers.{i}.self_attn.{q,k}_norm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight; a `model.` prefix
may occur (either form is accepted per tensor). The drafter has no embedding or lm_head: it borrows
the target's, so extra tensors such as a copied `embed_tokens`/`lm_head` are ignored.

Loading mirrors the target: config check against the target (`check_pair`), header-only validation of
every tensor (name, shape, dtype), then the model is built on the meta device, allocated once on the
device and filled by streaming from the memory map.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch

from drafter_service.config import DFlashConfig
from drafter_service.model import DFlashDrafter
from kernels.rope import Rope
from verifier_service.config import KimiConfig
from verifier_service.random_checkpoint import random_dense
from verifier_service.safetensors_io import CheckpointError, ShardedReader, TensorSpec, write_sharded_lazy
from verifier_service.weight_stream import Copy, Progress, stream_copies

FLOATS = ("BF16", "F16", "F32", "F64")


def check_pair(d: DFlashConfig, t: KimiConfig) -> None:
    """A drafter built for another target fails here, before any weights move."""
    if d.hidden_size != t.hidden_size:
        raise ValueError(f"drafter hidden_size {d.hidden_size} != target hidden_size {t.hidden_size}: "
                         "the drafter was built for another target")
    if d.vocab_size != t.vocab_size:
        raise ValueError(f"drafter vocab_size {d.vocab_size} != target vocab_size {t.vocab_size}: "
                         "the drafter was built for another target")
    bad = [i for i in d.target_layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {list(d.target_layer_ids)}: {bad} outside the target's "
                         f"{t.num_hidden_layers} layers")
    explicit = d.raw.get("num_target_layers") or (d.raw.get("dflash_config") or {}).get("num_target_layers")
    if explicit and int(explicit) != t.num_hidden_layers:
        raise ValueError(f"drafter num_target_layers {explicit} != target num_hidden_layers "
                         f"{t.num_hidden_layers}: the drafter was built for another target")
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise ValueError(f"drafter mask_token_id {d.mask_token_id} outside the target vocabulary "
                         f"(vocab_size {t.vocab_size})")


def _meta_drafter(cfg: DFlashConfig, target_hidden: int) -> DFlashDrafter:
    with torch.device("meta"):
        return DFlashDrafter(cfg, target_hidden)


def plan_drafter(reader: ShardedReader, model: DFlashDrafter) -> list[tuple[str, str]]:
    """(parameter name, checkpoint name) for every parameter, after checking presence, shape and dtype."""
    out = []
    for name, p in model.named_parameters():
        src = name if name in reader else "model." + name
        if src not in reader:
            raise CheckpointError(f"{reader.index_path}: tensor {name!r} (or 'model.{name}') is missing")
        info = reader.info(src)
        if info.shape != tuple(p.shape):
            raise CheckpointError(f"{info.file}: tensor {src!r} has shape {list(info.shape)}, expected "
                                  f"{list(p.shape)} from the drafter and target configs")
        if info.dtype not in FLOATS:
            raise CheckpointError(f"{info.file}: tensor {src!r} has dtype {info.dtype}, expected one of {FLOATS}")
        out.append((name, src))
    return out


@torch.no_grad()
def load_drafter(folder: str | Path, target_cfg: KimiConfig, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", *, progress: bool | None = None,
                 workers: int = 4) -> DFlashDrafter:
    folder = Path(folder)
    cfg = DFlashConfig.from_file(folder)
    try:
        check_pair(cfg, target_cfg)
    except ValueError as e:
        raise ValueError(f"{folder / 'config.json'}: {e}") from None
    with ShardedReader(folder) as reader:
        model = _meta_drafter(cfg, target_cfg.hidden_size)
        plan = plan_drafter(reader, model)
        model = model.to(dtype).to_empty(device=device)
        params = dict(model.named_parameters())
        copies = [Copy(src, reader.info(src), params[name]) for name, src in plan]
        stream_copies(reader, copies, Progress(sum(c.src.nbytes for c in copies), f"loading {folder.name}",
                                               progress), workers)
    # the rope tables were built on the meta device: rebuild them as DFlashDrafter.__init__ does
    model.rope = Rope.build(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, rule="hf", interleaved=False)
    return model.eval()


def write_random_drafter(folder: str | Path, config: dict, target_hidden: int, seed: int = 0,
                         prefix: str = "", max_shard_bytes: int = 5 << 30) -> None:
    """Random bf16 drafter weights, generated lazily tensor by tensor (bounded host memory at any size)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = DFlashConfig.from_dict(config)
    model = _meta_drafter(cfg, target_hidden)
    specs = [TensorSpec(prefix + n, tuple(p.shape), torch.bfloat16,
                        partial(random_dense, tuple(p.shape), n, seed + 1)) for n, p in model.named_parameters()]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_sharded_lazy(folder, specs, max_shard_bytes)
