"""Feed-forward blocks of the Kimi target: dense SwiGLU MLP, noaux_tc router, routed + shared experts.

Routed experts are stacked over experts at load time: INT4 (compressed-tensors pack-quantized,
`w13_packed`/`w13_scale`/`w2_packed`/`w2_scale`) or dense (`w13`/`w2`, bf16 checkpoints such as
DeepSeek-V3). gate and up are concatenated on the output axis (rows 0..I-1 gate, I..2I-1 up).
Under expert parallelism (`verifier_service.expert_parallel`) a MoE holds a contiguous slice of the
experts (`expert_ids`) and a process group (`ep_group`) whose ranks hold the rest.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels import int4_moe_wgmma as int4_moe_wgmma_module
from kernels.int4_moe import int4_moe, moe_dense_ref, repack_int4_moe_for_gpu, unrepack_int4_moe
from kernels.int4_moe_gluon import gluon_dense_experts, repack_int4_moe_for_gluon
from kernels.int4_moe_wgmma import (
    HAVE_GLUON,
    check_schedule,
    repack_int4_moe_for_wgmma,
    repack_int4_moe_for_wgmma_steps,
    wgmma_dense_experts,
    wgmma_steps_dense_experts,
)
from kernels.int4_pack import dequantize_int4
from kernels.router import route
from verifier_service.config import KimiConfig

# the INT4 layout `MoE.repack_for_gpu` makes on CUDA: "auto" (the default: "wgmma_steps" on sm_90, else "gpu"),
# "gpu" (the Triton kernels of kernels/int4_moe.py), "gluon" (the mma.sync Gluon kernels of kernels/int4_moe_gluon.py),
# "wgmma" (kernels/int4_moe_wgmma.py, sm_90 only: warpgroup MMAs with the activations in shared memory; on the
# H200 as fast as "gpu" at one session and faster at 16, docs/performance.md) or "wgmma_steps" (the same kernels
# and bits, each expert's weights in step-major order: contiguous reads per K step, 7% faster layers on the H100).
# "gpu", "gluon" and the wgmma pair give three sets of bits; one deployment uses one, so AR and DDTree run the same
# kernels (batch invariance holds within each). The environment
# variable DDTREE_MOE_LAYOUT sets it for a process (read at import; checked at the first repack).
GPU_LAYOUT = os.environ.get("DDTREE_MOE_LAYOUT", "auto")


def schedule_from_env(raw: str | None) -> dict:
    """DDTREE_MOE_SCHEDULE: a JSON object of `int4_moe_wgmma` schedule options for every launch of the wgmma kernels,
    laid over their `auto_schedule` (e.g. '{"pdl": true}'); a schedule changes speed, never bits. Checked here, so a
    bad one stops the process at import with the reason."""
    if not raw:
        return {}
    try:
        sched = json.loads(raw)
        if not isinstance(sched, dict):
            raise ValueError("not a JSON object")
        check_schedule(sched)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"DDTREE_MOE_SCHEDULE={raw!r}: {exc}") from None
    return sched


int4_moe_wgmma_module.DEFAULT_SCHEDULE = schedule_from_env(os.environ.get("DDTREE_MOE_SCHEDULE"))
_REPACK = {"gpu": repack_int4_moe_for_gpu, "gluon": repack_int4_moe_for_gluon, "wgmma": repack_int4_moe_for_wgmma,
           "wgmma_steps": repack_int4_moe_for_wgmma_steps}
_DENSE = {"gluon": gluon_dense_experts, "wgmma": wgmma_dense_experts,
          "wgmma_steps": wgmma_steps_dense_experts}  # their CPU decode (the "gpu" one: below)


def _wgmma_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" and HAVE_GLUON and torch.cuda.get_device_capability(device)[0] == 9


def resolve_gpu_layout(layout: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """`layout` ("auto" or one of the layouts above) -> the layout the weights on `device` get, for a model computing
    in `dtype`; ValueError for an unknown one, or for "wgmma" on a GPU without wgmma (its kernels are sm_90 only; on
    CPU every layout decodes) or for a model that is not bf16 (the wgmma kernels take bf16 activations; "auto" gives
    such a model on the GPU the Triton kernels, which take any float dtype)."""
    if layout == "auto":
        return "wgmma_steps" if _wgmma_runs_on(device) and dtype == torch.bfloat16 else "gpu"
    if layout not in _REPACK:
        raise ValueError(f"MoE layout {layout!r}: 'auto' or one of {sorted(_REPACK)} (DDTREE_MOE_LAYOUT)")
    if layout in int4_moe_wgmma_module.LAYOUTS and device.type == "cuda":
        if not _wgmma_runs_on(device):
            raise ValueError(f"MoE layout {layout!r} needs an sm_90 GPU and Triton with Gluon; {device} is "
                             f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}: use 'gpu' or 'auto'")
        if dtype != torch.bfloat16:
            raise ValueError(f"MoE layout {layout!r}: its kernels take bf16 activations, the model computes in "
                             f"{dtype}: use 'gpu' or 'auto'")
    return layout


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); used for dense layers and the shared expert."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """DeepSeek-V3 noaux_tc routing: sigmoid scores in fp32; the correction bias only selects."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def score_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> router logits [T, E] in at least fp32 (a method: `batch_invariant` swaps the GEMM)."""
        acc = torch.promote_types(x.dtype, torch.float32)
        return x.to(acc) @ self.weight.to(acc).T

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (topk_ids [T, k] int64, topk_w [T, k] fp32): `kernels.router.route` of the logits (one
        kernel on CUDA, the torch reference elsewhere)."""
        c = self.cfg
        return route(self.score_logits(x), self.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
                     c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)


class MoE(nn.Module):
    def __init__(self, cfg: KimiConfig, quantized: bool):
        super().__init__()
        E, D, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.quantized = quantized
        # global ids of the experts stacked below (all of them; expert_parallel.shard_experts keeps a range)
        self.expert_ids: tuple[int, ...] = tuple(range(E))
        self.ep_group: dist.ProcessGroup | None = None  # set by expert_parallel.use_expert_group
        self.gate = Router(cfg)
        self.layout = "checkpoint"  # INT4 buffers' layout; "gpu" / "gluon" / "wgmma" after repack_for_gpu()
        if quantized:
            g = cfg.quant.group_size
            self.register_buffer("w13_packed", torch.zeros(E, 2 * inter, D // 8, dtype=torch.int32))
            self.register_buffer("w13_scale", torch.zeros(E, 2 * inter, D // g, dtype=torch.bfloat16))
            self.register_buffer("w2_packed", torch.zeros(E, D, inter // 8, dtype=torch.int32))
            self.register_buffer("w2_scale", torch.zeros(E, D, inter // g, dtype=torch.bfloat16))
        else:
            self.w13 = nn.Parameter(torch.empty(E, 2 * inter, D))
            self.w2 = nn.Parameter(torch.empty(E, D, inter))
        self.shared_experts = MLP(D, inter * cfg.n_shared_experts) if cfg.n_shared_experts else None

    @torch.no_grad()
    def repack_for_gpu(self, layout: str | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        """Once, at load on CUDA: INT4 buffers -> the INT4 kernels' layout, `layout` or GPU_LAYOUT, resolved for
        the weights' device and the model's compute dtype (`resolve_gpu_layout`). The checkpoint layout would be
        repacked on every call."""
        layout = resolve_gpu_layout(layout or GPU_LAYOUT, (self.w13_packed if self.quantized else self.w13).device,
                                    dtype)
        if not self.quantized or self.layout == layout:
            return
        if self.layout != "checkpoint":
            raise RuntimeError(f"MoE weights are in the {self.layout!r} layout already")
        w13, s13, w2, s2 = _REPACK[layout](self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)
        self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale = w13, s13, w2, s2
        self.layout = layout

    def _dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU path: the reference dequant of every expert, done once per weights version and dtype."""
        acc = torch.promote_types(dtype, torch.float32)
        key = (self.w13_packed.data_ptr(), self.w13_packed._version, self.w2_scale._version, self.layout, acc)
        cache = getattr(self, "_dense_cache", None)
        if cache is None or cache[0] != key:
            w13p, s13, w2p, s2 = self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale
            D = self.w2_packed.shape[1]
            if self.layout in _DENSE:
                cache = (key, *_DENSE[self.layout](w13p, s13, w2p, s2, D, acc))
            else:
                if self.layout == "gpu":
                    w13p, s13, w2p, s2 = unrepack_int4_moe(w13p, s13, w2p, s2, D)
                cache = (key, dequantize_int4(w13p, s13, acc), dequantize_int4(w2p, s2, acc))
            self._dense_cache = cache
        return cache[1], cache[2]

    def _reduce_pairs(self):
        """(global ids held, in-place sum of the per-pair rows over the ranks) or (None, None): all experts here."""
        if self.ep_group is None:
            if len(self.expert_ids) != self.gate.cfg.n_routed_experts:
                raise RuntimeError("MoE holds an expert-parallel slice of the experts but no process group: "
                                   "call expert_parallel.use_expert_group(model, group) first")
            return None, None
        held = range(self.expert_ids[0], self.expert_ids[-1] + 1)
        return held, lambda rows: dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=self.ep_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.gate(x)  # every rank routes every token (same inputs, same bits)
        held, reduce = self._reduce_pairs()
        if self.quantized and not x.is_cuda:  # CPU: the reference on cached weights
            y = moe_dense_ref(x, ids, w, *self._dequantized(x.dtype), experts=held, reduce_pairs=reduce)
        elif self.quantized:
            y = int4_moe(x, ids, w, self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale,
                         layout=self.layout, experts=held, reduce_pairs=reduce)
        else:
            y = moe_dense_ref(x, ids, w, self.w13, self.w2, experts=held, reduce_pairs=reduce)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
