"""Training forward of the DFlash drafter: many masked blocks per sequence in one pass (training only).

Serving (drafter_service/drafter.py) drafts one block per request: context = taps of the committed
tokens at positions < start, block = [token at start, MASK x (B-1)] at positions start..start+B-1,
attention bidirectional over [context ; block], output slot i predicts the token at start+i. Here a
sequence of S tokens carries K such blocks at once: queries are the K*B block tokens, keys are the S
context rows followed by the K*B block rows, and a mask lets block k see context rows j < start_k and
its own B rows only — the same attention pattern per block as serving, with the same module
parameters (`fc`, `hidden_norm`, per-layer `kv()`, norms, rope). `tests/unit/test_training_forward.py`
checks it against `Drafter.draft_logq`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafter_service.model import DFlashDrafter


def block_inputs(tokens: torch.Tensor, starts: torch.Tensor, block: int, mask_id: int):
    """tokens [N, S], starts [N, K] -> block tokens [N, K, B] ([tok at start, MASK...]), positions [N, K, B]."""
    N, K = starts.shape
    blk = torch.full((N, K, block), mask_id, dtype=tokens.dtype, device=tokens.device)
    blk[..., 0] = tokens.gather(1, starts)
    pos = starts[..., None] + torch.arange(block, device=starts.device)
    return blk, pos


def block_attention_mask(starts: torch.Tensor, S: int, block: int) -> torch.Tensor:
    """bool [N, 1, K*B, S + K*B]: block k sees context rows j < starts[k] and its own B rows."""
    N, K = starts.shape
    Q = K * block
    dev = starts.device
    ctx = torch.arange(S, device=dev)[None, None, :] < starts.repeat_interleave(block, 1)[..., None]  # [N, Q, S]
    bid = torch.arange(K, device=dev).repeat_interleave(block)
    own = (bid[:, None] == bid[None, :]).expand(N, Q, Q)
    return torch.cat((ctx, own), -1)[:, None]


def drafter_blocks(model: DFlashDrafter, embed_weight: torch.Tensor, taps: torch.Tensor, tokens: torch.Tensor,
                   starts: torch.Tensor) -> torch.Tensor:
    """taps [N, S, F] (target taps at every position), tokens [N, S], starts [N, K] (1 <= start <= S - B)
    -> normed drafter hidden [N, K, B, D]; apply the target lm_head to slots 1..B-1."""
    c = model.cfg
    N, S = tokens.shape
    K, B = starts.shape[1], c.block_size
    H, KV, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    blk, pos = block_inputs(tokens, starts, B, c.mask_token_id)
    Q = K * B
    x = F.embedding(blk.view(N, Q), embed_weight)
    qpos = pos.reshape(-1)
    cpos = torch.arange(S, device=tokens.device).repeat(N)
    ctx = model.hidden_norm(model.fc(taps)).reshape(N * S, -1)
    mask = block_attention_mask(starts, S, B)
    groups = H // KV
    for layer in model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(N * Q, H, hd))
        q = model.rope.apply(q, qpos).view(N, Q, H, hd)
        kc, vc = a.kv(ctx, cpos, model.rope)
        kb, vb = a.kv(h.reshape(N * Q, -1), qpos, model.rope)
        k = torch.cat((kc.view(N, S, KV, hd), kb.view(N, Q, KV, hd)), 1).repeat_interleave(groups, 2)
        v = torch.cat((vc.view(N, S, KV, hd), vb.view(N, Q, KV, hd)), 1).repeat_interleave(groups, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype),
                                           v.transpose(1, 2).to(q.dtype), attn_mask=mask)
        x = x + a.o_proj(o.transpose(1, 2).reshape(N, Q, H * hd))
        m = layer.mlp
        hm = layer.post_attention_layernorm(x)
        x = x + m.down_proj(F.silu(m.gate_proj(hm)) * m.up_proj(hm))
    return model.norm(x).view(N, K, B, -1)


def sample_starts(N: int, K: int, S: int, block: int, gen: torch.Generator, device) -> torch.Tensor:
    """K distinct block starts per sequence in [1, S - block], sorted (int64 [N, K])."""
    hi = S - block  # the last block's targets end at position S - 1
    if K > hi:
        raise ValueError(f"{K} blocks do not fit a sequence of {S} with block {block}")
    keys = torch.rand(N, hi, generator=gen)
    return (keys.topk(K, dim=1).indices + 1).sort(1).values.to(device)
