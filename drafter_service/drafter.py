"""The drafter engine: context updates, one batched DFlash pass per step, GPU tree construction.

`draft(requests)` appends all sessions' new context in one batched update (`add_contexts`: one
projection of the kept rows of every session when they come as taps (`DFlashDrafter.project`; a verifier that
holds the projection sends them projected, `drafter_service.context_projection`), one `context_kv_from` forward
over them and one ring scatter for K and one for V, so the cost in launches does not grow with the sessions),
runs the block `[root, MASK x (B-1)]` for all requests in one forward, turns output slots 1..B-1 into
per-depth log-probs and builds the DDTree (`kernels.tree_build`). With CUDA graphs (`cuda_graphs`, default on for
a CUDA device) the append (up to max_sessions x block_size rows: a decode step's) and the forward + tree build
replay from `drafter_service.cuda_graphs.DraftGraphRunner`.

`draft_logq(requests)` is the one hook a different proposal source overrides (tests' oracle drafters); such
a subclass drafts eagerly, since a graph would replay the model instead. `logq(rows, ctx_len, roots,
root_pos)` is the device-only part the graphs capture.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from drafter_service.api import DraftRequest
from drafter_service.context_cache import DraftContextCache
from drafter_service.cuda_graphs import AheadStaged, DraftGraphRunner, ahead_draft
from drafter_service.device_copy import int64_to_device, rows_to_device
from drafter_service.model import DFlashDrafter
from kernels.tree_build import TreeBatch, build_tree

log = logging.getLogger(__name__)


@dataclass
class AheadStage:
    """A `Drafter.stage_ahead`: the plan of S sessions' P candidate rows each (index [S * P, 3]), their cache rows
    and context lengths before, the step's budget and top-k, and its graph's stage (None: eagerly)."""

    drafter: Drafter
    index: torch.Tensor
    rows: list[int]
    lengths: list[int]
    budget: int
    topk: int
    graph: AheadStaged | None

    @property
    def replays(self) -> bool:
        """Whether `draft` replays a graph captured already: it then runs no kernel for the first time and reads
        nothing back on the host (a stream waiting on a GPU doorbell may hold it: `DraftStream.queue_request_wait`)."""
        g = self.drafter.graphs
        return self.graph is not None and g is not None and g.captured(self.graph)

    @torch.no_grad()
    def draft(self, feats: torch.Tensor, values: torch.Tensor, projected: bool = False) -> TreeBatch:
        """The device part (`Drafter.draft_ahead`): the candidate rows feats [S, P, F] and values [3, S] -> trees."""
        d, S = self.drafter, len(self.rows)
        if tuple(feats.shape[:2]) != (S, self.index.shape[0] // max(S, 1)):
            raise ValueError(f"draft_ahead: rows {list(feats.shape)} for a stage of {S} sessions x "
                             f"{self.index.shape[0] // max(S, 1)} rows")
        rows = feats.reshape(-1, feats.shape[-1]).to(d.dtype)
        if not projected:
            rows = d.model.project(rows)
        if self.graph is not None:
            trees = d.graphs.ahead_launch(self.graph, rows, values)
            if trees is not None:
                return trees
        # eagerly: what the graph computes (one upload of the host values)
        host = torch.cat((self.index.reshape(-1), d.cache.pad_index(rows.shape[0]).reshape(-1),
                          torch.tensor([self.rows, self.lengths], dtype=torch.int64).reshape(-1)))
        index, pad, cols = int64_to_device(host, d.device).split([3 * rows.shape[0], 3 * rows.shape[0], 2 * S])
        cols = cols.view(2, S)
        return ahead_draft(d.cache, d.model.context_kv_from, d.logq, d.cfg.vocab_size, index.view(-1, 3),
                           pad.view(-1, 3), cols[0], cols[1], values, rows, self.budget, self.topk)


class Drafter:
    """cuda_graphs: the context append and the draft forward + tree build through CUDA graphs
    (`drafter_service.cuda_graphs`). None (the default): on for a CUDA device, off otherwise (the one place
    this rule lives; builders pass their own switch through); True on a CPU drafter pads the steps the same
    way and runs them eagerly (what the graphs compute; tests)."""

    def __init__(self, model: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 max_sessions: int = 64, window: int = 2048, cuda_graphs: bool | None = None):
        self.model = model
        self.cfg = model.cfg
        self.embed_weight = embed_weight  # [V, D] the target's embed_tokens
        self.lm_head_weight = lm_head_weight  # [V, D] the target's lm_head
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if model.rope.inv_freq.device != self.device:  # else every rope call copies it (and blocks a capture)
            model.rope = dataclasses.replace(model.rope, inv_freq=model.rope.inv_freq.to(self.device))
        self.cache = DraftContextCache(self.cfg.num_hidden_layers, max_sessions, window,
                                       self.cfg.num_key_value_heads, self.cfg.head_dim, self.dtype, self.device)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and type(self).draft_logq is not Drafter.draft_logq:
            log.info("%s overrides draft_logq: drafting eagerly (no CUDA graphs)", type(self).__name__)
            cuda_graphs = False
        self.graphs: DraftGraphRunner | None = None
        if cuda_graphs:
            self.graphs = DraftGraphRunner(self.logq, model.context_kv_from, self.cache, self.depth,
                                           self.cfg.vocab_size, self.cfg.hidden_size, self.dtype,
                                           max_sessions * self.cfg.block_size,
                                           capture=self.device.type == "cuda")

    @property
    def depth(self) -> int:
        return self.cfg.block_size - 1

    @torch.no_grad()
    def draft(self, requests: list[DraftRequest]) -> TreeBatch:
        """Append each request's new context rows, then draft one tree per request (the caller owns it)."""
        groups: dict[bool, list] = {}  # taps and projected rows (one kind per caller, in practice)
        for r in requests:
            groups.setdefault(r.ctx_projected, []).append((r.session_id, r.ctx_start, r.ctx_features))
        for projected, appends in groups.items():
            self.add_contexts(appends, projected=projected)
        trees = self.graphs.run(requests) if self.graphs is not None else None
        if trees is not None:
            return trees
        logq = self.draft_logq(requests)
        roots = int64_to_device([r.root_token for r in requests], self.device)
        return build_tree(logq, roots, [r.budget for r in requests], [r.topk for r in requests])

    @property
    def drafts_ahead(self) -> bool:
        """Whether `draft_ahead` works here: it runs the device-level `logq`, so a subclass that proposes through
        `draft_logq` (an oracle that needs the host's requests) cannot."""
        return type(self).draft_logq is Drafter.draft_logq

    @torch.no_grad()
    def draft_ahead(self, sids: list[str], starts: list[int], feats: torch.Tensor, values: torch.Tensor, budget: int,
                    topk: int, projected: bool = False) -> TreeBatch:
        """Append and draft from values the host has not read yet (the verifier's acceptance, still on the device):
        session sids[i] gets the first counts[i] of its candidate rows feats[i] ([S, P, F] taps, or projected rows
        with `projected`) at positions starts[i].., the other rows go to the pad row; then one tree per session at
        (budget, topk) from roots[i] at root_pos[i]. values: [3, S] int64 on the device, (counts, roots, root_pos),
        clamped into 1..P, the vocabulary and 0..2**31 (a peer's values never index out of range). Device work
        and host-known values only, so the host never waits; one graph with CUDA graphs (`DraftGraphRunner`).
        The cache's counts stay where they were until `advance(sids, counts)` gives the same counts from the host
        (the caller reads them later). `stage_ahead`, then its `draft`."""
        return self.stage_ahead(sids, starts, feats.shape[1], budget, topk).draft(feats, values, projected)

    @torch.no_grad()
    def stage_ahead(self, sids: list[str], starts: list[int], P: int, budget: int, topk: int) -> AheadStage:
        """`draft_ahead`'s host part, which needs neither the rows nor the values (a drafter serving another process
        runs it before that process's writes have landed): the places of every session's P candidate rows, as if all
        were committed, with the cache rows and lengths, in one host block (no GPU work: a drafter may stage while
        another process's GPU work decides the values). These sessions' cache entries must not change before its
        `draft` (other sessions' steps may run in between)."""
        if P > self.cache.window:
            raise ValueError(f"draft_ahead: {P} candidate rows per session exceed the draft window {self.cache.window}")
        plan = self.cache.plan(sids, starts, [P] * len(sids))
        base = [self.cache.length(s) for s in sids]
        cache_rows = [self.cache.row(s) for s in sids]
        graph = None
        if self.graphs is not None:
            graph = self.graphs.ahead_stage(plan.index, cache_rows, base, budget, topk)
        return AheadStage(self, plan.index, cache_rows, base, budget, topk, graph)

    def advance(self, sids: list[str], counts: list[int]) -> None:
        """The host's counts of a `draft_ahead`'s committed rows (the values it drafted from): advance the cache."""
        self.cache.advance(sids, counts)

    @torch.no_grad()
    def warmup(self, budget: int, topk: int) -> int:
        """Capture now the draft graphs of every request bucket for one (budget, top-k) (e.g. the serving
        defaults, at server start) and the append graphs -> the number of graphs held (0 without CUDA graphs)."""
        return len(self.graphs.warmup(budget, topk)) if self.graphs is not None else 0

    @torch.no_grad()
    def add_context(self, sid: str, start: int, feats: torch.Tensor, projected: bool = False) -> None:
        """feats [n, num_taps * D_target]: taps of session sid's committed tokens at positions start.. (n may be
        0: the session gets its cache row); with `projected` their context rows [n, D] instead."""
        self.add_contexts([(sid, start, feats)], projected=projected)

    @torch.no_grad()
    def add_contexts(self, appends: list[tuple[str, int, torch.Tensor]], projected: bool = False) -> None:
        """(session id, start, feats) per session (distinct ids): one context_kv forward over the rows every
        session keeps (its last `window`), one scatter of K and one of V into the ring cache; replayed from a
        graph when the runner takes it. feats are taps, projected first (one eager `fc` + `hidden_norm` over all
        sessions' kept rows), or with `projected` context rows already (`DFlashDrafter.project`)."""
        plan = self.cache.plan([a[0] for a in appends], [a[1] for a in appends], [a[2].shape[0] for a in appends])
        if plan.num_rows:
            parts = [f[skip:] if skip else f for (_, _, f), skip in zip(appends, plan.skip) if f.shape[0]]
            if not projected:
                parts = [self.model.project(rows_to_device(parts, self.device, self.dtype))]
            if self.graphs is None or not self.graphs.append(plan.index, parts):
                index = int64_to_device(plan.index, self.device)
                feats = rows_to_device(parts, self.device, self.dtype)
                self.cache.scatter(index, self.model.context_kv_from(feats, index[:, 2]))
        self.cache.commit(plan)

    def draft_logq(self, requests: list[DraftRequest]) -> torch.Tensor:
        """-> fp32 [R, B-1, V]: log q_i of the token at position root_pos + i, i = 1..B-1."""
        cols = [(self.cache.row(r.session_id), self.cache.length(r.session_id), r.root_token, r.root_pos)
                for r in requests]
        columns = [list(c) for c in zip(*cols)] or [[], [], [], []]
        rows, ctx_len, roots, root_pos = int64_to_device(columns, self.device).unbind(0)
        return self.logq(rows, ctx_len, roots, root_pos)

    def logq(self, rows: torch.Tensor, ctx_len: torch.Tensor, roots: torch.Tensor,
             root_pos: torch.Tensor) -> torch.Tensor:
        """rows, ctx_len, roots, root_pos: [R] int64 on the device (cache row, valid context rows, root token,
        its position) -> fp32 [R, B-1, V] log-probs. Device ops only, row-local per request (capturable)."""
        B, R = self.cfg.block_size, rows.shape[0]
        block = torch.full((R, B), self.cfg.mask_token_id, dtype=torch.int64, device=self.device)
        block[:, 0] = roots
        pos = root_pos[:, None] + torch.arange(B, device=self.device)[None, :]
        embeds = torch.nn.functional.embedding(block, self.embed_weight).to(self.dtype)
        h = self.model(embeds, pos, self.cache.k, self.cache.v, rows, ctx_len)  # [R, B, D]; reads rows in place
        # one [R (B-1), D] x [D, V] GEMM: a [R, B-1, D] @ [D, V] matmul of the strided slice runs as a bmm that
        # reads the head once per request (K2.6, R = 32: 18 ms instead of 0.6 ms on an H200)
        logits = (h[:, 1:].reshape(R * (B - 1), -1) @ self.lm_head_weight.to(h.dtype).T).view(R, B - 1, -1)
        return torch.log_softmax(logits.float(), dim=-1)

    def release(self, sid: str) -> None:
        self.cache.release(sid)
