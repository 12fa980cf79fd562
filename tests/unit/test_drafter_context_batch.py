"""The batched context append (`Drafter.add_contexts`: one `context_kv` forward over all sessions' kept rows,
one ring scatter for K and one for V) writes exactly what the per-session path wrote (one forward and one
ring write per layer per session, kept here as the reference), fp32 on the CPU; also padded to a row bucket
as the CUDA-graph runner does (`cuda_graphs=True` on the CPU: pad rows write only the pad row).

Bitwise with row-invariant linears (`tests.helpers.row_invariant_linears`): torch's CPU GEMMs pick other
kernels for 1, 2-4, ... rows, so with stock linears a row's last bits depend on how many rows share the call
(the per-session path projects 1 row where the batch projects 40); the projections are row-local, so any
other difference is a bug in positions, ring slots, windowing or rows. With stock linears: equal to fp32
rounding. Awkward sizes: sessions with 0 rows, appends longer than the window (only the last `window` rows
are kept), ring wrap-around, sessions joining late, a released row reused.
"""

from __future__ import annotations

import pytest
import torch

from drafter_service import context_cache
from drafter_service.drafter import Drafter
from tests.helpers import random_drafter

WINDOW = 12
# rows sent per session per step; None = the session is not in that step
STEPS = [
    {"a": 5, "b": 0, "c": 1, "d": 3, "e": 17},  # e: more than the window at once
    {"a": 1, "b": 1, "c": 0, "d": 2, "e": 1},
    {"a": 13, "b": 4, "c": 9, "d": 1, "e": 0},  # a: wraps past the window boundary
    {"a": 0, "b": 0, "c": 0, "d": 0, "e": 0},  # nothing new anywhere
    {"a": 2, "b": 25, "f": 0, "c": 1, "e": 3},  # f joins with no rows; d sits out
    {"f": 4, "a": 1, "b": 1, "c": 11, "d": 12},
]


class PerSessionRing:
    """The per-session path before batching: per append, context_kv over all n rows at positions start.., then
    per layer a ring write of the last min(n, window) rows at (count + n - keep + i) % window."""

    def __init__(self, model, like: torch.Tensor):
        self.model, self.k, self.v = model, torch.zeros_like(like), torch.zeros_like(like)
        self.count: dict[str, int] = {}

    def append(self, row: int, sid: str, start: int, feats: torch.Tensor) -> None:
        self.count.setdefault(sid, 0)
        n = feats.shape[0]
        if n == 0:
            return
        kv = self.model.context_kv(feats, torch.arange(start, start + n))
        keep = min(n, WINDOW)
        ring = (torch.arange(keep) + self.count[sid] + n - keep) % WINDOW
        for layer, (k, v) in enumerate(kv):
            self.k[layer, row, ring] = k[n - keep :]
            self.v[layer, row, ring] = v[n - keep :]
        self.count[sid] += n


def run_steps(drafter: Drafter, ref: PerSessionRing, seed: int = 0, release_after: int | None = None):
    g = torch.Generator().manual_seed(seed)
    F = drafter.cfg.num_taps * 64
    pos: dict[str, int] = {}
    for i, step in enumerate(STEPS):
        appends = []
        for sid, n in step.items():
            start = pos.get(sid, 0)
            appends.append((sid, start, torch.randn(n, F, generator=g)))
            pos[sid] = start + n
        drafter.add_contexts(appends)
        for sid, start, feats in appends:
            ref.append(drafter.cache.row(sid), sid, start, feats)
        if release_after == i:  # "b" leaves (and comes back later as a new session); "g" reuses its row
            drafter.release("b")
            ref.count.pop("b")
            pos.pop("b")
            feats = torch.randn(3, F, generator=g)
            drafter.add_context("g", 0, feats)
            ref.append(drafter.cache.row("g"), "g", 0, feats)
            pos["g"] = 3
    return pos


@pytest.mark.parametrize("small_plan_rows", [0, 10_000])  # every plan with tensor ops / every plan from a list
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("release_after", [None, 2])
def test_batched_append_equals_per_session_bitwise(release_after, graphs, small_plan_rows, monkeypatch):
    monkeypatch.setattr(context_cache, "SMALL_PLAN_ROWS", small_plan_rows)
    model, embed, head = random_drafter(seed=3, row_invariant=True)
    d = Drafter(model, embed, head, max_sessions=8, window=WINDOW, cuda_graphs=graphs)
    ref = PerSessionRing(model, d.cache.k)
    pos = run_steps(d, ref, release_after=release_after)
    real = slice(0, d.cache.pad_row)
    assert torch.equal(d.cache.k[:, real], ref.k[:, real]), (d.cache.k[:, real] - ref.k[:, real]).abs().max()
    assert torch.equal(d.cache.v[:, real], ref.v[:, real]), (d.cache.v[:, real] - ref.v[:, real]).abs().max()
    for sid, count in ref.count.items():
        assert d.cache.length(sid) == min(count, WINDOW) and pos[sid] == count
    if graphs:  # every append fits a row bucket (8 sessions x block 8 = 64 rows): all went through the runner
        assert d.graphs.stats["context_padded_eager"] == 5 + (release_after is not None)  # not the empty step
        assert d.graphs.stats["context_eager"] == 0
    else:
        assert not d.cache.k[:, d.cache.pad_row].any(), "the pad row was written"


def test_batched_append_matches_per_session_with_stock_linears():
    """The real GEMMs: equal to fp32 rounding (bits differ only by the GEMM kernel a row count picks)."""
    model, embed, head = random_drafter(seed=4)
    d = Drafter(model, embed, head, max_sessions=8, window=WINDOW, cuda_graphs=False)
    ref = PerSessionRing(model, d.cache.k)
    run_steps(d, ref, seed=1)
    scale = ref.k.abs().max()
    assert (d.cache.k - ref.k).abs().max() <= 1e-6 * scale
    assert (d.cache.v - ref.v).abs().max() <= 1e-6 * ref.v.abs().max()
    assert torch.equal(d.cache.k == 0, ref.k == 0)  # the same slots written


def test_one_session_call_and_feature_dtypes():
    """add_context (the `context` message's path) is the batch of one; rows in another dtype are converted
    exactly as before (per part, before the concatenation when parts differ)."""
    model, embed, head = random_drafter(seed=5, row_invariant=True)
    a = Drafter(model, embed, head, max_sessions=4, window=WINDOW, cuda_graphs=False)
    b = Drafter(model, embed, head, max_sessions=4, window=WINDOW, cuda_graphs=False)
    g = torch.Generator().manual_seed(0)
    F = a.cfg.num_taps * 64
    x, y = torch.randn(7, F, generator=g, dtype=torch.float64), torch.randn(3, F, generator=g)
    a.add_context("x", 0, x)
    a.add_context("y", 10, y)
    b.add_contexts([("x", 0, x), ("y", 10, y)])
    assert torch.equal(a.cache.k, b.cache.k) and torch.equal(a.cache.v, b.cache.v)
    with pytest.raises(ValueError, match="twice"):
        b.add_contexts([("x", 7, x[:1]), ("x", 8, x[:1])])
    assert b.cache.length("x") == 7  # a refused plan changes nothing
    b.add_context("z", 0, torch.zeros(0, 0))  # the engine's "no new rows": reserves a row, writes nothing
    assert "z" in b.cache and b.cache.length("z") == 0


def test_plan_from_a_list_equals_plan_by_tensor_ops(monkeypatch):
    """The two ways `DraftContextCache.plan` builds its index agree on random appends (rows past the window,
    ring wrap-around, empty appends, late joiners)."""
    g = torch.Generator().manual_seed(7)
    caches = [context_cache.DraftContextCache(1, 16, WINDOW, 1, 2, torch.float32, "cpu") for _ in range(2)]
    for _ in range(40):
        sids = [f"s{i}" for i in torch.randperm(16, generator=g)[: int(torch.randint(1, 9, (1,), generator=g))]]
        starts = [int(x) for x in torch.randint(0, 1000, (len(sids),), generator=g)]
        counts = [int(x) for x in torch.randint(0, 2 * WINDOW + 3, (len(sids),), generator=g)]
        plans = []
        for cache, limit in zip(caches, (0, 10_000)):
            monkeypatch.setattr(context_cache, "SMALL_PLAN_ROWS", limit)
            plans.append(cache.plan(sids, starts, counts))
            cache.commit(plans[-1])
        a, b = plans
        kept = sum(min(n, WINDOW) for n in counts)
        assert a.index.dtype == b.index.dtype == torch.int64 and a.index.shape == (kept, 3)
        assert torch.equal(a.index, b.index) and a.skip == b.skip and a.counts == b.counts
