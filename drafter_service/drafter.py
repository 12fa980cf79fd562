"""The drafter engine: context updates, one batched DFlash pass per step, GPU tree construction.

`draft(requests)` appends each session's new context, runs the block `[root, MASK x (B-1)]` for all
requests in one forward, turns output slots 1..B-1 into per-depth log-probs and builds the DDTree
(`kernels.tree_build`). `draft_logq` is the one hook a different proposal source overrides.
"""

from __future__ import annotations

import torch

from drafter_service.api import DraftRequest
from drafter_service.context_cache import DraftContextCache
from drafter_service.model import DFlashDrafter
from kernels.tree_build import TreeBatch, build_tree


class Drafter:
    def __init__(self, model: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 max_sessions: int = 64, window: int = 2048):
        self.model = model
        self.cfg = model.cfg
        self.embed_weight = embed_weight  # [V, D] the target's embed_tokens
        self.lm_head_weight = lm_head_weight  # [V, D] the target's lm_head
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache = DraftContextCache(self.cfg.num_hidden_layers, max_sessions, window,
                                       self.cfg.num_key_value_heads, self.cfg.head_dim, self.dtype, self.device)

    @property
    def depth(self) -> int:
        return self.cfg.block_size - 1

    @torch.no_grad()
    def draft(self, requests: list[DraftRequest]) -> TreeBatch:
        for r in requests:
            self.add_context(r.session_id, r.ctx_start, r.ctx_features)
        logq = self.draft_logq(requests)
        roots = torch.tensor([r.root_token for r in requests], dtype=torch.int64).to(self.device)
        return build_tree(logq, roots, [r.budget for r in requests], [r.topk for r in requests])

    @torch.no_grad()
    def add_context(self, sid: str, start: int, feats: torch.Tensor) -> None:
        self.cache.row(sid)
        if feats.shape[0] == 0:
            return
        pos = torch.arange(start, start + feats.shape[0], device=self.device)
        self.cache.append(sid, self.model.context_kv(feats.to(self.device, self.dtype), pos))

    def draft_logq(self, requests: list[DraftRequest]) -> torch.Tensor:
        """-> fp32 [R, B-1, V]: log q_i of the token at position root_pos + i, i = 1..B-1."""
        B = self.cfg.block_size
        rows = torch.tensor([self.cache.row(r.session_id) for r in requests], device=self.device)
        ctx_len = torch.tensor([self.cache.length(r.session_id) for r in requests], device=self.device)
        block = torch.full((len(requests), B), self.cfg.mask_token_id, dtype=torch.int64)
        block[:, 0] = torch.tensor([r.root_token for r in requests])
        pos = torch.tensor([r.root_pos for r in requests])[:, None] + torch.arange(B)[None, :]
        block, pos = block.to(self.device), pos.to(self.device)
        embeds = torch.nn.functional.embedding(block, self.embed_weight).to(self.dtype)
        ctx_k = self.cache.k[:, rows]  # [layers, R, W, KV, hd]
        ctx_v = self.cache.v[:, rows]
        h = self.model(embeds, pos, ctx_k, ctx_v, ctx_len)  # [R, B, D]
        logits = h[:, 1:] @ self.lm_head_weight.to(h.dtype).T
        return torch.log_softmax(logits.float(), dim=-1)

    def release(self, sid: str) -> None:
        self.cache.release(sid)
