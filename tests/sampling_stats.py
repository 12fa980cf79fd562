"""Statistics helpers for the sampling tests: the warped target distribution and chi-square bounds."""

from __future__ import annotations

import math

import torch

from verifier_service.sampling_params import SamplingParams


def warped_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Independent float64 statement of the definition: rank by z desc (ties: lower index first),
    judge top-k and top-p on the full softmax(z), keep the shorter prefix, renormalise."""
    z = logits.double() / p.temperature
    V = z.numel()
    order = sorted(range(V), key=lambda i: (-z[i].item(), i))
    probs = torch.softmax(z, 0)
    keep = torch.zeros(V, dtype=torch.bool)
    before = 0.0
    for rank, i in enumerate(order):
        if (0 < p.top_k < V and rank >= p.top_k) or (p.top_p < 1 and before >= p.top_p):
            break
        keep[i] = True
        before += probs[i].item()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def chi2_threshold(df: int, fail: float) -> float:
    """Laurent & Massart (2000), Lemma 1: P(X >= df + 2 sqrt(df x) + 2x) <= exp(-x) for X ~ chi2(df)."""
    x = math.log(1 / fail)
    return df + 2 * math.sqrt(df * x) + 2 * x


def pearson(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    """Pearson's chi-square statistic of n draws against probs, over the cells with probs > 0."""
    keep = probs > 0
    exp = probs[keep] * n
    return (((counts[keep].double() - exp) ** 2) / exp).sum().item()
