"""Shared test fixtures' machinery: tiny model pairs on disk and an oracle drafter.

The oracle knows each session's reference (autoregressive) continuation and proposes it with
controlled corruption, so DDTree trees get accepted deep and rejected at every depth — random
drafters would be rejected at the root almost always and prove nothing.
"""

from __future__ import annotations

import torch

from drafter_service.api import DraftRequest
from kernels.tree_build import TreeBatch, build_tree


class OracleDrafter:
    """DraftClient whose per-depth distributions favour the true continuation.

    At depth i the true token gets rank 0 with probability 1 - p_wrong, otherwise a rank in
    1..max_rank (so a top-k cap > rank still finds it inside the tree), or is pushed far down.
    """

    def __init__(self, reference: dict[str, list[int]], vocab: int, block_size: int, p_wrong: float = 0.3,
                 max_rank: int = 3, seed: int = 0):
        self.reference = reference  # session id -> prompt + AR output
        self.vocab = vocab
        self.depth = block_size - 1
        self.p_wrong = p_wrong
        self.max_rank = max_rank
        self.gen = torch.Generator().manual_seed(seed)
        self.released: list[str] = []
        self.requests: list[DraftRequest] = []

    def draft_logq(self, requests: list[DraftRequest]) -> torch.Tensor:
        R, L, V = len(requests), self.depth, self.vocab
        logits = torch.randn(R, L, V, generator=self.gen, dtype=torch.float64)
        for r, req in enumerate(requests):
            seq = self.reference[req.session_id]
            for i in range(1, L + 1):
                p = req.root_pos + i
                if p >= len(seq):
                    continue
                true = seq[p]
                order = logits[r, i - 1].argsort(descending=True)
                top = logits[r, i - 1, order[0]].item()
                if torch.rand((), generator=self.gen).item() >= self.p_wrong:
                    logits[r, i - 1, true] = top + 5.0  # confident: q(true) ~ 0.8
                else:
                    rank = int(torch.randint(1, self.max_rank + 4, (), generator=self.gen))
                    if rank <= self.max_rank:  # inside the top-k list at this rank
                        logits[r, i - 1, true] = (logits[r, i - 1, order[rank - 1]] + logits[r, i - 1, order[rank]]) / 2
                    else:  # far down: rejected here
                        logits[r, i - 1, true] = logits[r, i - 1].min() - 1.0
        return torch.log_softmax(logits, -1).float()

    def draft(self, requests: list[DraftRequest]) -> TreeBatch:
        self.requests.extend(requests)
        logq = self.draft_logq(requests)
        roots = torch.tensor([r.root_token for r in requests])
        return build_tree(logq, roots, [r.budget for r in requests], [r.topk for r in requests])

    def release(self, session_id: str) -> None:
        self.released.append(session_id)


def row_invariant_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Make every nn.Linear of `module` compute each output row alone (broadcast multiply, then a sum over the
    inputs), in place. torch's CPU GEMMs pick other kernels for 1, 2-4, ... rows, so a row's last bits depend
    on how many rows share the call; with these, they do not, and a batched path can be checked bitwise
    against a per-session one. Test-only (slow, memory [rows, out, in])."""

    def forward(self, x):
        y = (x[..., None, :] * self.weight).sum(-1)
        return y if self.bias is None else y + self.bias

    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = forward.__get__(m)
    return module


def random_drafter(seed: int = 0, dtype: torch.dtype = torch.float32, row_invariant: bool = False):
    """A tiny DFlash drafter (the `tiny` preset) with random weights, plus random target embed / lm_head:
    (model, embed [V, D], lm_head [V, D]) on the CPU."""
    from drafter_service.config import DFlashConfig
    from drafter_service.model import DFlashDrafter
    from verifier_service import presets

    cfg = DFlashConfig.from_dict(presets.drafter_config("tiny"))
    g = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg, presets.TINY_TEXT["hidden_size"]).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * (0.3 if p.dim() > 1 else 0.1) + (p.dim() == 1))
    V, D = cfg.vocab_size, cfg.hidden_size
    embed = torch.randn(V, D, generator=g, dtype=dtype)
    head = torch.randn(V, D, generator=g, dtype=dtype) * 0.2
    if row_invariant:
        row_invariant_linears(model)
    return model.eval(), embed, head
