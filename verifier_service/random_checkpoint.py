"""Write a random-weight target checkpoint in the real Hugging Face layout (for tests and benchmarks).

Names, shapes, dtypes and tensor kinds come from `checkpoint_layout.target_layout` (the loader's own
expectations), plus the parts a real folder holds beside the text model: K2.5/K2.6 vision-tower and
projector tensors (`vision_tower.*`, `mm_projector.*`, representative, at the vision_config sizes) and
DeepSeek-V3's multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`). The loader ignores
both.

Every tensor is generated lazily, chunk by chunk, while its shard is written
(`safetensors_io.write_sharded_lazy`), so a real-shape Kimi K2.6 checkpoint truncated to a few layers
is written with host memory bounded by one chunk (~128 MB), not by one layer (a K2.6 MoE layer is
~9.5 GB of INT4 experts). Values are seeded per tensor from (seed, name without prefix), so the
three layouts of one config hold identical weights.

Two modes (same names, shapes, dtypes and packing either way):
- exact (the default for small models, e.g. `tiny`): bf16 matrices drawn N(0, 1/in), routed experts as
  random float matrices quantized with the reference `kernels.int4_pack.quantize_int4` / `pack_int4`.
- fast (default when an expert matrix has >= 4M elements, e.g. `kimi-k2.6`): routed experts as random
  packed int32 words (uniform nibbles) and bf16 scales near 1 / (4.6 sqrt(in)), drawn directly, and
  bf16 matrices built from random bits at the same scale (`fast_dense`); quantizing 384 x 3 random
  2048 x 7168 matrices per layer, or drawing billions of normals, on a CPU is too slow for a benchmark.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from kernels.int4_pack import pack_int4, quantize_int4
from verifier_service.checkpoint_layout import LayoutTensor, target_layout
from verifier_service.config import KimiConfig
from verifier_service.safetensors_io import TensorSpec, write_sharded_lazy

CHUNK_ELEMS = 32 << 20  # rows per generated chunk are chosen to stay under this many elements
FAST_INT4_MIN = 1 << 22  # expert matrices with at least this many elements use the fast mode


def _gen(seed: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))


def _rows(shape: tuple[int, ...]) -> int:
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, CHUNK_ELEMS // max(inner, 1))


def random_dense(shape, key: str, seed: int, dtype=torch.bfloat16) -> Iterator[torch.Tensor]:
    """N(0, 1/in) in row chunks (1-D: norms around 1)."""
    g = _gen(seed, key)
    if len(shape) == 1:
        yield (1.0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        return
    step = _rows(shape)
    fan_in = math.prod(shape[1:])
    for r in range(0, shape[0], step):
        n = min(step, shape[0] - r)
        yield (torch.randn((n, *shape[1:]), generator=g) / math.sqrt(fan_in)).to(dtype)


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


SIGN_MANT = _signed64(0x807F_807F_807F_807F)  # per 16-bit lane: sign bit + 7 mantissa bits
LANE_LOW2 = 0x0003_0003_0003_0003


WORD_PARTS = 8  # a big draw is split over this many generators, seeded from the tensor's: same bytes on any CPU
_pool: ThreadPoolExecutor | None = None


def random_words(n: int, g: torch.Generator) -> torch.Tensor:
    """n uniformly random int64 words. torch's CPU generator is serial, so a large draw is split over
    WORD_PARTS generators filled in threads (randint releases the GIL); the result depends only on g."""
    global _pool
    lo, hi = -(2**63), 2**63 - 1
    if n < 1 << 20:
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64)
    seeds = torch.randint(0, 2**62, (WORD_PARTS,), generator=g).tolist()
    out = torch.empty(n, dtype=torch.int64)
    cut = [n * i // WORD_PARTS for i in range(WORD_PARTS + 1)]

    def fill(i: int) -> None:
        part = out[cut[i] : cut[i + 1]]
        torch.randint(lo, hi, part.shape, generator=torch.Generator().manual_seed(seeds[i]), dtype=torch.int64,
                      out=part)

    _pool = _pool or ThreadPoolExecutor(WORD_PARTS, thread_name_prefix="random-words")
    list(_pool.map(fill, range(WORD_PARTS)))
    return out


def fast_dense(shape, key: str, seed: int, std: float) -> Iterator[torch.Tensor]:
    """bf16 values of magnitude ~std built from random bits: sign and 7 mantissa bits uniform, exponent
    uniform over 4 octaves around std. Done on int64 words, 4 bf16 lanes each (the exponent sum stays
    below 2^8 per lane, so lanes never carry into each other); ~10x cheaper than randn."""
    g = _gen(seed, key)
    e0 = int(math.floor(math.log2(std))) + 127 - 2  # lowest of the 4 biased exponents
    lanes = sum(e0 << (16 * i) for i in range(4))
    step = _rows(shape)
    inner = math.prod(shape[1:])
    for r in range(0, shape[0], step):
        n = min(step, shape[0] - r)
        w = random_words(-(-n * inner // 4), g)
        e = (w >> 7).bitwise_and_(LANE_LOW2).add_(lanes).bitwise_left_shift_(7)  # in place: no page-faulting temps
        w.bitwise_and_(SIGN_MANT).bitwise_or_(e)
        del e
        yield w.view(torch.bfloat16)[: n * inner].view((n, *shape[1:]))


def _quantized(t: LayoutTensor, key: str, seed: int, group: int) -> Iterator[torch.Tensor]:
    out_f, in_f = t.logical
    w = next(random_dense((out_f, in_f), key, seed, torch.float32)) if out_f * in_f <= CHUNK_ELEMS else None
    if w is None:
        w = torch.cat(list(random_dense((out_f, in_f), key, seed, torch.float32)))
    q, scale = quantize_int4(w, group)
    yield pack_int4(q) if t.kind == "packed" else scale


def _fast_int4(t: LayoutTensor, key: str, seed: int) -> Iterator[torch.Tensor]:
    out_f, in_f = t.logical
    if t.kind == "packed":
        g = _gen(seed, key + ".weight_packed")
        step = _rows(t.shape)
        for r in range(0, out_f, step):
            n = min(step, out_f - r)
            yield random_words(n * in_f // 16, g).view(torch.int32).view(n, in_f // 8)
    else:
        g = _gen(seed, key + ".weight_scale")
        s0 = 1.0 / (4.6 * math.sqrt(in_f))  # uniform nibbles have std ~4.6: rows of W get std ~1/sqrt(in)
        yield (s0 * (0.75 + 0.5 * torch.rand(t.shape, generator=g))).to(torch.bfloat16)


def _make(t: LayoutTensor, cfg: KimiConfig, seed: int, fast: bool) -> Iterator[torch.Tensor]:
    key = t.module.removeprefix(cfg.tensor_prefix)  # same values in every layout
    if t.kind == "shape":
        yield torch.tensor(list(t.logical), dtype=torch.int32)
    elif t.kind == "router_bias":
        yield 0.1 * torch.randn(t.shape, generator=_gen(seed, key + ".bias"))
    elif t.kind in ("packed", "scale"):
        yield from (_fast_int4(t, key, seed) if fast else _quantized(t, key, seed, cfg.quant.group_size))
    elif fast and len(t.shape) == 2:
        yield from fast_dense(t.shape, key, seed, 1.0 if t.kind == "embed" else t.shape[1] ** -0.5)
    elif t.kind == "embed":  # unit-scale rows, like a trained embedding table
        yield from (c * math.sqrt(t.shape[1]) for c in random_dense(t.shape, key, seed))
    else:
        yield from random_dense(t.shape, key, seed)


def _extra_specs(config: dict, cfg: KimiConfig, seed: int) -> list[TensorSpec]:
    """Tensors a real folder holds outside the text model: vision tower (K2.5/K2.6), MTP layer (DeepSeek-V3)."""
    shapes: dict[str, tuple[int, ...]] = {}
    vc = config.get("vision_config")
    if vc:
        vh, vi, th = vc["vt_hidden_size"], vc["vt_intermediate_size"], vc["text_hidden_size"]
        p, merged = vc["patch_size"], vc["mm_hidden_size"] * math.prod(vc["merge_kernel_size"])
        shapes |= {"vision_tower.patch_embed.proj.weight": (vh, 3, p, p), "vision_tower.patch_embed.proj.bias": (vh,)}
        for i in range(min(vc["vt_num_hidden_layers"], 2)):  # representative blocks, not the whole tower
            b = f"vision_tower.encoder.blocks.{i}."
            shapes |= {b + "wqkv.weight": (3 * vh, vh), b + "wo.weight": (vh, vh), b + "mlp.fc0.weight": (vi, vh),
                       b + "mlp.fc1.weight": (vh, vi), b + "norm0.weight": (vh,), b + "norm1.weight": (vh,)}
        shapes |= {"mm_projector.pre_norm.weight": (vc["mm_hidden_size"],),
                   "mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.2.weight": (th, merged)}
    text = config.get("text_config", config)
    for k in range(int(text.get("num_nextn_predict_layers") or 0)):
        m, D = f"{cfg.tensor_prefix}model.layers.{cfg.num_hidden_layers + k}.", cfg.hidden_size
        shapes |= {m + "enorm.weight": (D,), m + "hnorm.weight": (D,), m + "eh_proj.weight": (D, 2 * D),
                   m + "shared_head.norm.weight": (D,), m + "input_layernorm.weight": (D,),
                   m + "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_row_dim, D)}
    return [TensorSpec(n, s, torch.bfloat16, partial(random_dense, s, n, seed)) for n, s in shapes.items()]


def target_specs(config: dict, seed: int = 0, fast_int4: bool | None = None) -> list[TensorSpec]:
    """Every tensor of the checkpoint (text model in layout order, then the extras), lazily generated."""
    cfg = KimiConfig.from_dict(config)
    if fast_int4 is None:
        fast_int4 = cfg.moe_intermediate_size * cfg.hidden_size >= FAST_INT4_MIN
    specs = [TensorSpec(t.name, t.shape, t.dtype, partial(_make, t, cfg, seed, fast_int4)) for t in target_layout(cfg)]
    return specs + _extra_specs(config, cfg, seed)


def write_random_target(folder: str | Path, config: dict, seed: int = 0, max_shard_bytes: int = 5 << 30,
                        fast_int4: bool | None = None) -> list[str]:
    """config.json + sharded safetensors + index; returns the shard file names."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specs = target_specs(config, seed, fast_int4)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return write_sharded_lazy(folder, specs, max_shard_bytes)
