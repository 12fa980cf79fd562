"""The verify-step benchmark's floor (`bench/bench_verify_step.py`): the HBM bytes and the flops a decoder layer
must spend in a step (routed experts: the ones this step's routing touched), averaged over the layers and set against
the measured copy bandwidth and matmul rate."""

from __future__ import annotations

import torch

from verifier_service.forward_batch import ForwardBatch
from verifier_service.model import KimiForCausalLM
from verifier_service.moe import MoE, Router

ROUTED = ("w13_packed", "w13_scale", "w2_packed", "w2_scale", "w13", "w2")  # stacked [E, ...] expert tensors


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _routed(mlp) -> list[torch.Tensor]:
    return [getattr(mlp, n) for n in ROUTED if isinstance(getattr(mlp, n, None), torch.Tensor)]


def layer_bytes(layer, *, experts_touched: int, tokens: int, kv_rows_read: int, elt: int) -> dict:
    """HBM bytes one decoder layer must move in the step: weights (all but the routed experts, plus the
    touched experts' stored tensors: packed words + scales, as laid out), the latent KV rows read
    (prefix + tree rows of every session) and written (the tree rows), activations (4 x tokens x hidden:
    the residual read and written around attention and around the MLP). elt: activation/KV dtype bytes."""
    attn = layer.self_attn
    weights = _nbytes([*layer.parameters(), *layer.buffers()])
    if isinstance(layer.mlp, MoE):
        routed = _routed(layer.mlp)
        weights += experts_touched * _nbytes(t[0] for t in routed) - _nbytes(routed)
    kv = (kv_rows_read + tokens) * attn.cfg.kv_row_dim * elt
    act = 4 * tokens * attn.cfg.hidden_size * elt
    return dict(weights=weights, kv=kv, act=act, total=weights + kv + act)


def layer_flops(layer, *, tokens: int, visible_rows: int) -> dict:
    """2 x tokens x every matrix parameter used per token (routed experts: top-k of them, logical sizes) plus
    the absorbed MLA attention: per (query row, visible key row) 2 x heads x (Dl + Dr) for the scores and
    2 x heads x Dl for p . c_kv."""
    c = layer.self_attn.cfg
    mats = sum(p.numel() for p in layer.parameters() if p.dim() == 2)  # attention, dense/shared MLP, router
    linear = 2 * tokens * mats
    if isinstance(layer.mlp, MoE):
        linear += 2 * tokens * c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
    attention = 2 * c.num_attention_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim) * visible_rows
    return dict(linear=linear, attention=attention, total=linear + attention)


def step_floor(model: KimiForCausalLM, shape: dict, touched: list[int], elt: int, ceil: dict) -> dict:
    """Per-layer floor terms averaged over the model's decoder layers; touched = distinct experts per MoE
    layer, in layer order."""
    layers = list(model.model.layers)
    it = iter(touched)
    nb = nf = 0
    for layer in layers:
        k = next(it) if isinstance(layer.mlp, MoE) else 0
        nb += layer_bytes(layer, experts_touched=k, tokens=shape["tokens"], kv_rows_read=shape["kv_rows_read"],
                          elt=elt)["total"]
        nf += layer_flops(layer, tokens=shape["tokens"], visible_rows=shape["visible_rows"])["total"]
    nb, nf = nb / len(layers), nf / len(layers)
    bytes_ms = nb / (ceil["copy_bw_GBps"] * 1e9) * 1e3
    flops_ms = nf / (ceil["mm_tflops"] * 1e12) * 1e3
    return dict(bytes_per_layer=nb, flops_per_layer=nf, bytes_floor_ms=bytes_ms, flops_floor_ms=flops_ms,
                floor_ms=max(bytes_ms, flops_ms))


def lm_head_floor(w: torch.Tensor, tokens: int, ceil: dict) -> float:
    """The lm_head's floor in ms for `tokens` rows: max(bytes / copy bandwidth, flops / matmul rate), bytes = its
    weight, the hidden rows read and fp32 logits written."""
    nbytes = _nbytes([w]) + tokens * (w.shape[1] * w.element_size() + w.shape[0] * 4)
    return max(nbytes / (ceil["copy_bw_GBps"] * 1e9), 2 * tokens * w.numel() / (ceil["mm_tflops"] * 1e12)) * 1e3


def touched_experts(model: KimiForCausalLM, fb: ForwardBatch, kv: torch.Tensor) -> tuple[list[int], tuple]:
    """One eager forward with hooks on the routers: distinct routed experts per MoE layer (host syncs; not
    timed), and the forward's output."""
    counts: list[int] = []

    def hook(mod, inp, out):
        counts.append(int(out[0].unique().numel()))

    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Router)]
    try:
        out = model(fb, kv)
    finally:
        for h in hooks:
            h.remove()
    return counts, out
