"""The flat (varlen) batch one target forward runs over (DESIGN 3.4).

Prefill and tree verify are the same forward: session s contributes n_s new tokens whose latent KV
is written right after its committed rows; a prefill is a chain (causal, `tree_bits is None`), a
verify step is a tree (ancestor bitmask per node, positions = start + depth).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    tokens: torch.Tensor  # [T] int64 token ids, sessions concatenated
    positions: torch.Tensor  # [T] int64 rope positions (start + depth for tree nodes)
    write_slots: torch.Tensor  # [T] int64 physical cache slots for the new tokens' latent KV
    cu_q: torch.Tensor  # [S+1] int32 offsets of each session's tokens
    prefix_lens: torch.Tensor  # [S] int32 committed rows visible without mask
    block_table: torch.Tensor  # [S, max_pages] int32 pages of each session
    page_size: int
    tree_bits: torch.Tensor | None  # [T, W] int64 ancestor bitmask per node; None = causal

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]
