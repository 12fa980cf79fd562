"""noaux_tc routing (DESIGN 2.1) against a brute-force per-token implementation, incl. grouped routing."""

from __future__ import annotations

import itertools

import pytest
import torch

from verifier_service.config import KimiConfig
from verifier_service.moe import Router
from verifier_service.presets import TINY_TEXT


def brute_force(x, w, bias, cfg):
    ids_all, w_all = [], []
    per_group = cfg.n_routed_experts // cfg.n_group
    for t in range(x.shape[0]):
        s = torch.sigmoid(x[t].double() @ w.double().T)
        c = s + bias.double()
        gscore = [sorted(c[g * per_group:(g + 1) * per_group].tolist(), reverse=True)[:2] for g in range(cfg.n_group)]
        gsum = [sum(v) for v in gscore]
        best_groups = None
        best = None
        for combo in itertools.combinations(range(cfg.n_group), cfg.topk_group):  # exhaustive group choice
            val = sum(gsum[g] for g in combo)
            if best is None or val > best:
                best, best_groups = val, combo
        allowed = [e for g in best_groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -c[e].item())[: cfg.num_experts_per_tok]
        ws = torch.stack([s[e] for e in chosen])
        ws = ws / ws.sum() * cfg.routed_scaling_factor
        order = sorted(range(len(chosen)), key=lambda i: chosen[i])
        ids_all.append([chosen[i] for i in order])
        w_all.append([ws[i].item() for i in order])
    return ids_all, w_all


@pytest.mark.parametrize("n_group,topk_group,experts,k", [(1, 1, 8, 2), (4, 2, 16, 4), (8, 4, 32, 8)])
def test_router_matches_brute_force(n_group, topk_group, experts, k):
    cfg = KimiConfig.from_dict({**TINY_TEXT, "n_group": n_group, "topk_group": topk_group, "n_routed_experts": experts,
                                "num_experts_per_tok": k})
    r = Router(cfg).double()
    g = torch.Generator().manual_seed(experts)
    r.weight.data = torch.randn(experts, cfg.hidden_size, generator=g, dtype=torch.float64) / 8
    r.e_score_correction_bias = torch.randn(experts, generator=g, dtype=torch.float32) * 0.3
    x = torch.randn(9, cfg.hidden_size, generator=g, dtype=torch.float64)
    ids, w = r(x)
    ref_ids, ref_w = brute_force(x, r.weight.data, r.e_score_correction_bias, cfg)
    for t in range(x.shape[0]):
        order = ids[t].argsort()
        assert ids[t][order].tolist() == ref_ids[t]
        assert torch.allclose(w[t][order].double(), torch.tensor(ref_w[t], dtype=torch.float64), rtol=1e-6)


def test_bias_only_selects():
    cfg = KimiConfig.from_dict(TINY_TEXT)
    r = Router(cfg).double()
    r.weight.data = torch.zeros_like(r.weight.data, dtype=torch.float64)
    r.e_score_correction_bias = torch.arange(cfg.n_routed_experts, dtype=torch.float32)
    ids, w = r(torch.ones(1, cfg.hidden_size, dtype=torch.float64))
    assert sorted(ids[0].tolist()) == [cfg.n_routed_experts - 2, cfg.n_routed_experts - 1]  # picked by bias
    assert torch.allclose(w, torch.full_like(w, cfg.routed_scaling_factor / 2))  # weighted by sigmoid(0) only
