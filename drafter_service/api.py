"""The drafter's request type, shared by every transport (in-process, co-located, gRPC).

One request per session per step carries the context the drafter has not seen yet (the target taps
of newly committed tokens, or their projected context rows) and what to draft next (root token, its
position, budget, top-k cap).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftRequest:
    session_id: str
    ctx_start: int  # absolute position of ctx_features[0]
    # [n, num_taps * D_target] taps of committed tokens (n may be 0), or with ctx_projected their context rows
    # [n, D] = hidden_norm(fc(taps)) (`drafter_service.context_projection`: what the verifier sends when it holds it)
    ctx_features: torch.Tensor
    root_token: int  # last committed token (not yet in the target's cache)
    root_pos: int  # its position = the session's committed length
    budget: int  # draft nodes N (tree has N + 1 nodes)
    topk: int  # per-depth top-k cap
    traceparent: str = ""  # W3C trace context of the session's request ("" = untraced); for the draft span
    ctx_projected: bool = False  # ctx_features are projected context rows, not taps
