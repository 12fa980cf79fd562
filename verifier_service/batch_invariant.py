"""Transform: make the Kimi target's GPU forward batch invariant (DESIGN 3.5), around the pure model.

Greedy DDTree equals AR only if a token's logits do not depend on how many rows share its forward.
`make_batch_invariant(model)` rebinds, per instance, every operation of `KimiForCausalLM.forward`
and `.logits` whose CUDA implementation picks its reduction order from the row count:

  op (where)                                       torch on CUDA                    swapped to
  nn.Linear: q_a/q_b/kv_a/kv_b/o_proj, dense MLP,  cuBLAS, kernel/split-K by M      kernels.matmul.matmul
    shared experts, lm_head (module forward)
  model.logits (hidden @ lm_head.weight^T)         cuBLAS                           matmul, then fp32
  Router.score_logits (fp32 x @ W_g^T)             cuBLAS fp32                      matmul, fp32 out
  MLAAttention.absorb_uk / apply_uv (einsums)      cuBLAS batched GEMM              kernels.matmul.head_matmul
  RMSNorm (every norm)                             torch mean: layout by #rows      kernels.rmsnorm kernel, used
                                                                                    by the module on CUDA already
The transform also runs the linears that read one input as one GEMM over their weights stacked in one
buffer (each weight then a view of its rows, no second copy): q_a and kv_a (`MLAAttention.project_a`), the gate
and up projections of the dense MLPs and shared experts (`MLP.forward`). One launch streams both weights (at a
decode step each is a few microseconds of bytes behind a launch and a pipeline ramp). The stacked weight has its
own split-K (`kernels.matmul.split_k` of the stacked shape), so its bits differ from the separate GEMMs', and
every step of the transformed model, AR or tree, runs the same way.
Checked and left alone, because each output element is computed from its own row only, by a
launch whose per-row work does not depend on the number of rows:
  - embedding gather, rope (cos/sin of the row's position, one program per token), SiLU * up, residual adds,
    sigmoid, the correction-bias add, concat/view/index_put of the KV rows: elementwise or copies;
  - the router's selection after its GEMM (`kernels.router.route`): on CUDA one program per token (its top-k
    and the sum of its k weights in slot order); grouped routing (torch): exact selections over one row, and the
    sum of the k (<= 8) weights, which torch reduces with one fixed 8-lane tree whatever the row count;
  - routed experts (`kernels.int4_moe`) and attention (`kernels.mla_attention`): batch-invariant
    Triton kernels (fixed K and KV-chunk orders); the attention is also position aligned, below;
  - sampler: argmax (exact, first index on ties) and `kernels.sampling` (one program per row).
Attention: `mla_attention` reduces a query's keys by absolute position (committed rows, then its
tree ancestors by depth, then itself) in an order that depends only on the query's position, so a
tree node at depth d gets the bits of the AR step at L + d, and once accepted (path compacted to
L + depth) writes the KV rows AR writes. With the default `attention="kernel"` greedy DDTree ==
AR bit for bit (tests/unit/test_gpu_exact.py, H200, bf16). `attention="aligned"` swaps in
`verifier_service.aligned_attention`, an independent exact construction built on the invariant
GEMMs: O(tokens x context) memory and time, kept as a cross-check for small models.

`remove_batch_invariance(model)` undoes the swaps. The CPU path never needs this (torch's CPU
kernels here are row-invariant for the fp32/fp64 tests), but the swapped model also runs there:
every launcher falls back to its torch reference off CUDA. Whenever autograd needs gradients
(training on the same modules) the swapped forwards fall back to the torch ops.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from kernels.matmul import CONFIGS, head_matmul, matmul
from verifier_service.aligned_attention import aligned_mla_attention
from verifier_service.mla import MLAAttention
from verifier_service.moe import MLP, Router

ATTENTION = ("kernel", "aligned")
_SWAPPED = ("forward", "score_logits", "absorb_uk", "apply_uv", "attention", "logits", "project_a")  # instance attrs


def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through the invariant GEMM: x [..., in] -> [..., out]."""
    if _needs_grad(x, self.weight) or x.dtype != self.weight.dtype:
        return F.linear(x, self.weight, self.bias)
    y = matmul(x.reshape(-1, x.shape[-1]), self.weight)
    if self.bias is not None:
        y = y + self.bias
    return y.view(*x.shape[:-1], y.shape[-1])


def stack_weights(*linears: nn.Linear) -> torch.Tensor | None:
    """The weights of bias-free linears that read one input, copied into one [sum of N, K] buffer, each module's
    weight becoming a view of its rows (so no second copy stays); None where they cannot share one (a bias, another
    K, dtype or device)."""
    ws = [lin.weight for lin in linears]
    w0 = ws[0]
    if (any(lin.bias is not None for lin in linears)
            or any(w.dim() != 2 or w.shape[1] != w0.shape[1] or w.dtype != w0.dtype or w.device != w0.device
                   for w in ws)):
        return None
    stacked = torch.cat([w.data for w in ws])
    start = 0
    for w in ws:
        w.data = stacked[start:start + w.shape[0]]
        start += w.shape[0]
    return stacked


def _project_a(self: MLAAttention, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """MLAAttention.project_a as one GEMM over q_a and kv_a stacked (`stack_weights`)."""
    w = self.__dict__.get("stacked_a")
    if w is None or _needs_grad(x, self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight) or x.dtype != w.dtype:
        return MLAAttention.project_a(self, x)
    y = matmul(x.reshape(-1, x.shape[-1]), w)
    q = self.cfg.q_lora_rank
    return y[:, :q], y[:, q:]


def _mlp_forward(self: MLP, x: torch.Tensor) -> torch.Tensor:
    """MLP.forward with gate and up as one GEMM over their stacked weights."""
    w = self.__dict__.get("stacked_gate_up")
    if w is None or _needs_grad(x, self.gate_proj.weight, self.up_proj.weight) or x.dtype != w.dtype:
        return MLP.forward(self, x)
    y = matmul(x.reshape(-1, x.shape[-1]), w)
    inter = self.gate_proj.weight.shape[0]
    h = F.silu(y[:, :inter]) * y[:, inter:]
    return self.down_proj(h).view(*x.shape[:-1], -1)


def _router_logits(self: Router, x: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> fp32 (or wider) router logits [T, E]. 16-bit x and W: their products are exact
    in fp32, so the 16-bit GEMM with fp32 output is the fp32 GEMM up to summation order."""
    acc = torch.promote_types(x.dtype, torch.float32)
    if _needs_grad(x, self.weight):
        return x.to(acc) @ self.weight.to(acc).T
    if x.dtype == self.weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return matmul(x, self.weight, out_dtype=acc)
    return matmul(x.to(acc), self.weight.to(acc))


def _absorb_uk(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[T, H, nope] x [H, nope, Dl] -> [T, H, Dl] (= einsum thn,hnl->thl)."""
    if _needs_grad(q_nope, w_uk):
        return MLAAttention.absorb_uk(q_nope, w_uk)
    return head_matmul(q_nope, w_uk.transpose(1, 2))


def _apply_uv(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """[T, H, Dl] x [H, v, Dl] -> [T, H, v] (= einsum thl,hvl->thv)."""
    if _needs_grad(o_lat, w_uv):
        return MLAAttention.apply_uv(o_lat, w_uv)
    return head_matmul(o_lat.to(w_uv.dtype), w_uv)


def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
    """KimiForCausalLM.logits: [T, D] -> fp32 (or fp64) logits [T, V], rounded to the hidden dtype
    first, exactly like `hidden @ lm_head.weight.T` followed by the promotion."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    w = self.lm_head.weight
    if _needs_grad(hidden, w) or hidden.dtype != w.dtype:
        return (hidden @ w.T).to(acc)
    return matmul(hidden, w).to(acc)


def make_batch_invariant(model: nn.Module, attention: str = "kernel") -> nn.Module:
    """Rebind the target's row-count-dependent ops to batch-invariant kernels, in place; returns model.

    attention: "kernel" keeps `kernels.mla_attention` (fast, position aligned: DDTree == AR), "aligned"
    uses `aligned_mla_attention` (the same exactness by another route; O(tokens x context), for checks)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    params = list(model.parameters())
    bad = {p.dtype for p in params if p.is_cuda and p.is_floating_point() and p.dtype not in CONFIGS}
    if bad:
        raise ValueError(f"make_batch_invariant: CUDA weights in {sorted(map(str, bad))}; the invariant "
                         f"kernels take {sorted(map(str, CONFIGS))}")
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            mod.forward = types.MethodType(_linear_forward, mod)
        elif isinstance(mod, Router):
            mod.score_logits = types.MethodType(_router_logits, mod)
        elif isinstance(mod, MLP):
            mod.stacked_gate_up = stack_weights(mod.gate_proj, mod.up_proj)
            mod.forward = types.MethodType(_mlp_forward, mod)
        elif isinstance(mod, MLAAttention):
            if mod.cfg.q_lora_rank:
                mod.stacked_a = stack_weights(mod.q_a_proj, mod.kv_a_proj_with_mqa)
                mod.project_a = types.MethodType(_project_a, mod)
            mod.absorb_uk = _absorb_uk
            mod.apply_uv = _apply_uv
            if attention == "aligned":
                mod.attention = aligned_mla_attention
            else:
                mod.__dict__.pop("attention", None)  # the class default: kernels.mla_attention
    if hasattr(model, "lm_head"):
        model.logits = types.MethodType(_logits, model)
    model.batch_invariant = attention
    return model


def remove_batch_invariance(model: nn.Module) -> nn.Module:
    """Undo `make_batch_invariant`: every module runs its class's own forward again."""
    for mod in model.modules():
        for name in (*_SWAPPED, "stacked_a", "stacked_gate_up"):  # the weights stay views of their stacked buffer
            mod.__dict__.pop(name, None)
    model.__dict__.pop("batch_invariant", None)
    return model


def is_batch_invariant(model: nn.Module) -> str | None:
    """The attention mode `make_batch_invariant` applied, or None."""
    return model.__dict__.get("batch_invariant")
