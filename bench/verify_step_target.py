"""The verify-step benchmark's target and inputs (`bench/bench_verify_step.py`): the Kimi target built by the
loader's `build_empty_target` with random weights made on the device (each MoE repacked as `load_target` leaves it),
the serving KV pool with interleaved sessions of random rows, and a flat verify batch of random trees."""

from __future__ import annotations

import math

import torch

from kernels.tree_mask import ancestor_mask, pack_mask_bits
from verifier_service.checkpoint import build_empty_target
from verifier_service.config import KimiConfig
from verifier_service.forward_batch import ForwardBatch
from verifier_service.kv_cache import KVPool
from verifier_service.model import KimiForCausalLM
from verifier_service.moe import MoE

MAX_DEPTH = 7  # DFlash block size 8: at most 7 draft positions below the root


# --- the target, random weights made on the device ----------------------------------------------------------
def _fill_(name: str, t: torch.Tensor, cfg: KimiConfig, gen: torch.Generator) -> None:
    """Random values in place, at the scales of random_checkpoint's fast mode (rows of W ~ 1/sqrt(in))."""
    leaf = name.rsplit(".", 1)[-1]
    if t.dtype == torch.int32:  # packed INT4 words: any bit pattern is a valid packing of 8 nibbles
        t.random_(-(2**31), 2**31, generator=gen)
    elif leaf in ("w13_scale", "w2_scale"):
        fan_in = cfg.hidden_size if leaf == "w13_scale" else cfg.moe_intermediate_size
        s0 = 1.0 / (4.6 * math.sqrt(fan_in))  # uniform nibbles have std ~4.6
        t.uniform_(0.75 * s0, 1.25 * s0, generator=gen)
    elif leaf == "e_score_correction_bias":
        t.normal_(0.0, 0.01, generator=gen)
    elif t.dim() == 1:  # norm weights
        t.normal_(1.0, 0.05, generator=gen)
    elif "embed_tokens" in name:
        t.normal_(0.0, 1.0, generator=gen)
    else:
        t.normal_(0.0, t.shape[-1] ** -0.5, generator=gen)


@torch.no_grad()
def build_target(cfg: KimiConfig, dtype: torch.dtype, device: str, seed: int = 0, log=print) -> KimiForCausalLM:
    """The loader's `build_empty_target`, every tensor filled with random values on `device`, then (on any
    device) each MoE repacked into the INT4 kernel's "gpu" layout by `MoE.repack_for_gpu`, as `load_target`
    does on CUDA. Peak memory: all layers in the checkpoint layout + one layer's repack."""
    model = build_empty_target(cfg, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        _fill_(name, t.data, cfg, gen)
    del t  # hold no checkpoint-layout tensor past its repack
    model.build_rope()  # rope tables were created on the meta device
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            layer.mlp.repack_for_gpu()
            if str(device).startswith("cuda"):
                torch.cuda.synchronize()
                log(f"  layer {i}: repacked, {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated")
    return model.eval()


# --- the step's inputs ----------------------------------------------------------------------------------------
def random_parents(n: int, max_depth: int, gen: torch.Generator) -> list[int]:
    """A tree of n nodes, parents before children: a chain root..depth min(n-1, max_depth) (the draft's main
    path), the other nodes hung below uniformly chosen nodes of depth < max_depth."""
    chain = min(n, max_depth + 1)
    parent = [-1, *range(chain - 1)]
    depth = list(range(chain))
    for _ in range(chain, n):
        cand = [j for j, d in enumerate(depth) if d < max_depth]
        p = cand[int(torch.randint(len(cand), (1,), generator=gen))]
        parent.append(p)
        depth.append(depth[p] + 1)
    return parent


def make_pool(cfg: KimiConfig, layers: int, sessions: int, rows_per_session: int, page_size: int,
              max_session_len: int, dtype: torch.dtype, device: str, seed: int = 0) -> KVPool:
    """The serving KV pool with `sessions` sessions of `rows_per_session` rows, their pages interleaved
    page by page (as in a pool where sessions grew together), filled with random rows."""
    pages_per = -(-rows_per_session // page_size)
    pool = KVPool(layers, cfg.kv_row_dim, sessions * pages_per, page_size, sessions,
                  max(max_session_len, rows_per_session), dtype, device)
    rows = [pool.open() for _ in range(sessions)]
    for k in range(1, pages_per + 1):
        for r in rows:
            pool.ensure(r, k * page_size)
    pool.kv.normal_(generator=torch.Generator(device=device).manual_seed(seed + 1))
    return pool


def make_batch(pool: KVPool, cfg: KimiConfig, batch: int, prefix: int, n: int, gen: torch.Generator,
               max_depth: int = MAX_DEPTH) -> tuple[ForwardBatch, dict]:
    """The flat verify batch of `batch` sessions (pool rows 0..batch-1) with `prefix` committed rows and an
    n-node tree each (n = 1: the AR step, a 1-node tree as the engine runs it); plus its shape stats."""
    dev = pool.kv.device
    parent = torch.tensor([random_parents(n, max_depth, gen) for _ in range(batch)])  # [B, n]
    anc = ancestor_mask(parent)  # [B, n, n]
    depth = anc.sum(-1) - 1
    rows = torch.arange(batch, device=dev)
    local = torch.arange(n, device=dev)[None, :].expand(batch, n)
    fb = ForwardBatch(
        tokens=torch.randint(0, cfg.vocab_size, (batch * n,), generator=gen).to(dev),
        positions=(prefix + depth).view(-1).to(dev),
        write_slots=pool.slots(rows, prefix + local).view(-1),
        cu_q=torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=dev),
        prefix_lens=torch.full((batch,), prefix, dtype=torch.int32, device=dev),
        block_table=pool.block_table[:batch], page_size=pool.page_size,
        tree_bits=pack_mask_bits(anc).view(batch * n, -1).contiguous().to(dev))
    shape = dict(tokens=batch * n, kv_rows_read=batch * (prefix + n),
                 visible_rows=batch * n * prefix + int((depth + 1).sum()), max_depth=int(depth.max()))
    return fb, shape
