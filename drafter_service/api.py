"""The drafter's request type, shared by every transport (in-process, co-located, gRPC).

One request per session per step carries the context the drafter has not seen yet (the target taps
of newly committed tokens) and what to draft next (root token, its position, budget, top-k cap).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftRequest:
    session_id: str
    ctx_start: int  # absolute position of ctx_features[0]
    ctx_features: torch.Tensor  # [n, num_taps * D_target] taps of committed tokens (n may be 0)
    root_token: int  # last committed token (not yet in the target's cache)
    root_pos: int  # its position = the session's committed length
    budget: int  # draft nodes N (tree has N + 1 nodes)
    topk: int  # per-depth top-k cap
    traceparent: str = ""  # W3C trace context of the session's request ("" = untraced); for the draft span
