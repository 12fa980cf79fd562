"""The verifier's step loop: continuous batching of sessions, one tree-verify forward per step.

Each step (DESIGN 3):
  1. ask the drafter for one tree per drafting session (sending the taps it has not seen yet, projected to the
     drafter's context rows first when the engine holds its projection: one GEMM for all drafting sessions,
     `drafter_service.context_projection`);
     autoregressive sessions (budget 0, or no drafter) contribute their root alone; while a drafter in
     another process works, lay out the tree-independent part of the batch (slots, block tables, offsets);
  2. run the target once over the flat batch of all nodes (positions start + depth, ancestor masks
     derived here from `parent`, never taken from the wire), through `forward`; with
     `EngineConfig.cuda_graphs` this forward and the logits replay from CUDA graphs padded to a token
     bucket (`verifier_service.cuda_graphs`);
  3. posterior token per node (argmax, or the session's seeded sample: `verifier_service.sampler`),
     acceptance walk, KV compaction of the accepted path;
  4. one host read of the step's results: emitted tokens, new roots, taps queued for the drafter.
Autoregressive decoding is this same loop with trees of one node.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from drafter_service.api import DraftRequest
from drafter_service.context_projection import ContextProjection
from drafter_service.device_copy import int64_to_device
from kernels.kv_compact import commit_moves, compact_kv
from kernels.step_impl import STEP_IMPLS
from kernels.tree_accept import accept_tree
from kernels.tree_build import TreeBatch, tree_size
from kernels.tree_inputs import tree_inputs
from telemetry import host_timeline
from verifier_service import draft_ahead
from verifier_service.cuda_graphs import GraphRunner
from verifier_service.forward_batch import ForwardBatch
from verifier_service.kv_cache import KVPool
from verifier_service.model import KimiForCausalLM
from verifier_service.sampler import SamplerTable
from verifier_service.sampling_params import resolve_seed
from verifier_service.session import MAX_BUDGET, DecodeParams, Session


class DraftClient(Protocol):
    """What the engine needs from a drafter, whatever the transport. A client may also offer
    `draft_begin(requests) -> (() -> TreeBatch)`: send now, wait for the trees when called (a drafter in
    another process); the engine then lays out the verify batch in between."""

    depth: int  # tree depth L = block_size - 1

    def draft(self, requests: list[DraftRequest]) -> TreeBatch: ...

    def release(self, session_id: str) -> None: ...


@dataclass
class _StepLayout:
    """A verify batch's tree-independent tensors for given node counts (`Engine._layout`)."""

    n: list[int]
    gather: torch.Tensor  # flat node <- [S, M] padded index
    rows: torch.Tensor
    committed: torch.Tensor
    cu_q: torch.Tensor
    write_slots: torch.Tensor
    block_table: torch.Tensor
    n_t: torch.Tensor  # [S] node counts
    starts: torch.Tensor  # [S] each session's first flat node (cu[:-1])


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int = 2048
    max_sessions: int = 64
    max_session_len: int = 8192
    draft_window: int = 2048
    # Verify forwards (and their logits) through CUDA graphs padded to token buckets
    # (`verifier_service.cuda_graphs`). None: the builder decides (`build_local_engine` and the verifier
    # server turn them on for CUDA); an Engine built directly treats None as off. True on a CPU target pads
    # the batches the same way and runs them eagerly (what the graphs compute; for tests).
    cuda_graphs: bool | None = None
    cuda_graph_max_tokens: int = 2048  # larger verify batches run eagerly (compute bound anyway)
    # the forward's tree inputs (token ids, positions, ancestor bits): "auto" (`kernels.tree_inputs`: one Triton
    # launch on CUDA, the torch code elsewhere; the same values; 0.14-0.19 ms a step faster than "torch" at K2.6
    # shapes, C = 1, H100, in every engine), "torch" (~40 launches at 17 nodes) or "triton" (the kernel everywhere: on
    # CPU under TRITON_INTERPRET=1, for tests)
    tree_inputs: str = "auto"
    # when an in-process drafter's work is queued: "eager" (first: its GPU work runs while the host prepares the rest
    # of the step) or "lazy" (after the step's layout, whose small host-bound launches then leave the GPU idle
    # before the draft: ~0.6 ms a step at K2.6 shapes, C = 1, profiled on an H100). A drafter in another process is
    # always asked first
    local_draft: str = "eager"
    # the step's acceptance (`kernels.tree_accept.accept_tree`): "auto" (one Triton launch on CUDA, the torch code
    # elsewhere; the same results: checked on an H100, where a call costs 33 us back to back against 630 us for the
    # torch code's ~40 launches), "torch" (`accept_greedy`) or "triton" (the kernel everywhere, for tests)
    tree_accept: str = "auto"
    # the step's KV moves as physical slots (`kernels.kv_compact.commit_moves`): "auto" (one Triton launch on CUDA, the
    # torch code elsewhere; the same slots: checked on an H100, where a C = 1 step at K2.6 shapes took 7.98 against
    # 8.28 ms with the torch code), "torch" (~25 launches) or "triton" (the kernel everywhere, for tests)
    commit_moves: str = "auto"
    # queue the next step's draft right after this step's acceptance, before the host reads the step
    # (`verifier_service.draft_ahead`): the GPU goes from the acceptance straight into the next draft. Taken by the
    # next step when it drafts the same sessions, or some of them, at one (budget, top-k); a session joining costs a
    # wasted draft. A drafter in another process that cannot (`drafts_ahead` false: gRPC, or sessions at different
    # budgets) is sent the next step's usual requests right after the host read instead (`draft_ahead.ask_early`,
    # untraced sessions only); an in-process one that cannot drafts as without it.
    # Measured on an H100 at K2.6 shapes (4 layers, steady-state blocks): in-process -3.4% / -3.3% a step at
    # C = 1 / 32, co-located -0.9% / -10.1%, gRPC (early asks) -11.9% / -6.9%. A small, host-bound pair loses
    # (kimi-mini: in-process +32% / +3.8%): measure `--draft-ahead off` there
    draft_ahead: bool = True
    # with a draft queued ahead in a co-located drafter (another process on this GPU, ringing a GPU doorbell): the
    # step's stream waits for that draft's ring before the step's first GPU work (`DraftStreamClient.hold_for_ahead`),
    # so that none of the step's preparation (KV pages, layout uploads) runs while the drafter's GPU works (a profiled
    # H100 step showed such work waiting ~2.4 ms for a time slice, then interrupting the draft). The price: that work
    # then follows the ring (the last step's verdicts are read before the wait; any other host read of the stream in
    # the step's preparation would wait for the whole draft). Measured on an H100 at K2.6 shapes (4 layers, blocks of
    # 6, two runs, e911f2c): the co-located step -3.8% / -3.3% at C = 1, -2.8% / -3.0% at C = 32 against off
    ahead_gpu_wait: bool = True

    def __post_init__(self):
        for f in ("tree_inputs", "tree_accept", "commit_moves"):
            if getattr(self, f) not in STEP_IMPLS:
                raise ValueError(f"engine config: {f} must be one of {STEP_IMPLS}, got {getattr(self, f)!r}")
        if self.local_draft not in ("eager", "lazy"):
            raise ValueError(f"engine config: local_draft must be eager or lazy, got {self.local_draft!r}")
        for f in ("page_size", "num_pages", "max_sessions", "max_session_len", "draft_window",
                  "cuda_graph_max_tokens"):
            if getattr(self, f) <= 0:
                raise ValueError(f"engine config: {f} must be positive, got {getattr(self, f)}")


class Engine:
    def __init__(self, target: KimiForCausalLM, drafter: DraftClient | None, tap_layers: tuple[int, ...],
                 cfg: EngineConfig = EngineConfig(), projection: ContextProjection | None = None):
        """projection: the drafter's context projection; with it the drafter is sent projected context rows
        (`DraftRequest.ctx_projected`), without it the taps. A stream client must have offered the same one."""
        self.target = target
        self.drafter = drafter
        self.projection = projection
        self.tap_layers = tuple(tap_layers)
        self.cfg = cfg
        p = next(target.parameters())
        self.device, self.dtype = p.device, p.dtype
        tc = target.cfg
        self.kv = KVPool(tc.num_hidden_layers, tc.kv_row_dim, cfg.num_pages, cfg.page_size, cfg.max_sessions,
                         cfg.max_session_len, self.dtype, self.device)
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self.sampler = SamplerTable(cfg.max_sessions, self.device)  # per-KV-row sampling params
        self.draft_ns: tuple[int, int] | None = None  # time.time_ns() around the last step's draft call (tracing)
        self.graphs: GraphRunner | None = None  # verify forwards through CUDA graphs (cfg.cuda_graphs)
        self.ahead: draft_ahead.AheadDraft | None = None  # the next step's draft, queued ahead (cfg.draft_ahead)
        if cfg.cuda_graphs:
            self.graphs = GraphRunner(
                lambda fb: self.forward(fb), lambda h: self.target.logits(h), self.kv, cfg.max_sessions,
                min(cfg.cuda_graph_max_tokens, cfg.max_sessions * (MAX_BUDGET + 1)),
                capture=self.device.type == "cuda", vocab_size=tc.vocab_size, target=target)

    def _verify_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A verify step's `forward` and logits: replayed from the CUDA-graph runner when it takes the batch
        (outputs are its static buffers, consumed within the step), else eagerly -> (hidden, taps, logits)."""
        out = self.graphs.run(fb) if self.graphs is not None else None
        if out is None:
            hidden, taps = self.forward(fb)
            logits = None
        else:
            hidden, taps, logits = out
        return hidden, taps, self.target.logits(hidden) if logits is None else logits

    # --- admission ---------------------------------------------------------------------------------
    def validate(self, prompt: list[int], params: DecodeParams) -> None:
        """Raise ValueError naming the field before any model work."""
        if not prompt:
            raise ValueError("prompt is empty")
        V = self.target.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
        if not isinstance(params, DecodeParams):
            raise TypeError("params must be DecodeParams")

    def tree_nodes(self, params: DecodeParams) -> int:
        if self.drafter is None or params.budget == 0:
            return 1
        return tree_size(params.budget, params.topk, self.drafter.depth)

    @torch.no_grad()
    def add(self, prompt: list[int], params: DecodeParams, sid: str | None = None,
            persistent: bool = False) -> Session:
        """Admit a session: prefill the prompt (a causal chain) and emit the first token.

        persistent: keep the KV after the turn finishes, for `extend`, until `release`."""
        self.validate(prompt, params)
        sid = sid if sid is not None else f"s{next(self._ids)}"
        if sid in self.sessions:
            raise ValueError(f"session id {sid!r} is already in use")
        row = self.kv.open()
        try:
            self.kv.ensure(row, len(prompt) + self.tree_nodes(params))
        except Exception:
            self.kv.release(row)
            raise
        s = Session(sid=sid, row=row, params=params, prompt_len=len(prompt), seed=resolve_seed(params.sampling),
                    persistent=persistent)
        self.sampler.set(row, params.sampling, s.seed)
        self.sessions[sid] = s
        self._prefill(s, prompt)
        if s.done and not s.persistent:
            self.finish(sid)
        return s

    @torch.no_grad()
    def extend(self, sid: str, tokens: list[int], params: DecodeParams) -> Session:
        """Next turn of a persistent session whose last turn finished: prefill [last emitted token] +
        tokens right after the cached prefix and emit the turn's first token. Greedy output equals a
        one-shot generation of the concatenated prompt. Raises before changing anything (ValueError,
        KVCapacityError) when the turn cannot start."""
        s = self.sessions.get(sid)
        if s is None or s.row < 0:
            raise ValueError(f"session {sid!r} does not hold a KV cache (never opened, or released)")
        if not s.done:
            raise ValueError(f"session {sid!r} is still generating its current turn")
        chain = [s.root, *tokens]
        self.validate(chain, params)
        self.kv.ensure(s.row, s.committed + len(chain) + self.tree_nodes(params))
        s.params, s.output, s.accepted_per_step, s.tree_sizes, s.finish_reason = params, [], [], [], None
        s.seed = resolve_seed(params.sampling)
        self.sampler.set(s.row, params.sampling, s.seed)
        self._prefill(s, chain)
        if s.done and not s.persistent:
            self.finish(sid)
        return s

    def _prefill(self, s: Session, tokens: list[int]) -> None:
        """Run `tokens` as a causal chain at positions s.committed.. (after the cached prefix), emit
        the first generated token and queue the chain's taps for the drafter."""
        start, P, row = s.committed, len(tokens), s.row
        pos = torch.arange(start, start + P, device=self.device)
        fb = ForwardBatch(
            tokens=torch.tensor(tokens, dtype=torch.int64).to(self.device), positions=pos,
            write_slots=self.kv.slots(torch.tensor([row], device=self.device), pos[None])[0],
            cu_q=torch.tensor([0, P], dtype=torch.int32, device=self.device),
            prefix_lens=torch.tensor([start], dtype=torch.int32, device=self.device),
            block_table=self.kv.block_table[row : row + 1], page_size=self.kv.page_size, tree_bits=None)
        hidden, taps = self.forward(fb)
        # the last chain token (position start+P-1) predicts position start+P
        first = int(self.sampler.posterior(self.target.logits(hidden[-1:]), [row], [start + P],
                                           not s.params.sampling.greedy)[0])
        s.committed, s.root = start + P, first
        s.add_pending(start, taps, self.cfg.draft_window)
        s.emit([first])

    def release(self, sid: str) -> None:
        """Free the session's KV on both services and forget it (idempotent)."""
        self.finish(sid)
        self.sessions.pop(sid, None)

    def finish(self, sid: str) -> None:
        """Free the session's KV on both services (idempotent)."""
        s = self.sessions.get(sid)
        if s is None or s.row < 0:
            return
        self.kv.release(s.row)
        s.row = -1
        if self.drafter is not None:
            self.drafter.release(sid)
        if s.finish_reason is None:
            s.finish_reason = "cancelled"

    # --- the two operations that change the target's state (the seam `distributed.LeaderEngine` mirrors) ---
    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over a flat batch; writes the batch's latent KV at fb.write_slots -> (hidden, taps)."""
        return self.target(fb, self.kv.kv, self.tap_layers)

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Commit: KV rows src -> dst (physical slots, all layers at once)."""
        compact_kv(self.kv.kv, src, dst)

    # --- one verify step ---------------------------------------------------------------------------
    def _draft_begin(self, active: list[Session]) -> tuple[list[int], Callable[[], TreeBatch] | None]:
        """Ask the drafter for one tree per drafting session -> (their indices in `active`, a function that
        returns the trees). A drafter with `draft_begin` (another process) starts working now and the engine
        prepares the rest of the step meanwhile; an in-process drafter queues its GPU work now too (cfg.local_draft
        "eager"), or when the function is called ("lazy")."""
        drafting = [i for i, s in enumerate(active) if self.drafter is not None and s.params.budget > 0]
        ahead, self.ahead = self.ahead, None
        taken = ahead.take(active, drafting) if ahead is not None else None
        if taken is not None:
            host_timeline.mark("draft_asked")
            self.draft_ns = (time.time_ns(), 0)
            return drafting, taken
        if ahead is not None:
            ahead.drop()
        if not drafting:
            return drafting, None
        host_timeline.mark("draft_asked")
        pending = [active[i].take_pending() for i in drafting]
        feats = self._context_rows([f for _, f in pending])
        host_timeline.mark("rows_ready")
        projected = self.projection is not None
        reqs = [DraftRequest(s.sid, start, f, s.root, s.committed, s.params.budget, s.params.topk, s.traceparent,
                             projected) for s, (start, _), f in zip((active[i] for i in drafting), pending, feats)]
        self.draft_ns = (time.time_ns(), 0)
        begin = getattr(self.drafter, "draft_begin", None)
        if begin is not None:
            return drafting, begin(reqs)
        if self.cfg.local_draft == "lazy":
            return drafting, lambda: self.drafter.draft(reqs)
        trees = self.drafter.draft(reqs)
        return drafting, lambda: trees

    def _context_rows(self, taps: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each drafting session's pending taps (None: none) -> what its request carries: the taps, or their
        projected rows (all sessions' through one GEMM)."""
        empty = torch.zeros(0, 0, device=self.device, dtype=self.dtype)
        rows = [t for t in taps if t is not None and t.shape[0]]
        if self.projection is None or not rows:
            return [empty if t is None else t for t in taps]
        out = iter(self.projection(rows[0] if len(rows) == 1 else torch.cat(rows)).split([t.shape[0] for t in rows]))
        return [next(out) if t is not None and t.shape[0] else empty for t in taps]

    def _trees(self, active: list[Session], drafting: list[int], trees_of: Callable[[], TreeBatch] | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], int]:
        """Padded per-session trees [S, M] (tokens, parent, depth), node counts, max depth."""
        n = [1] * len(active)
        trees = None
        if trees_of is not None:
            trees = trees_of()
            host_timeline.mark("trees_taken")
            self.draft_ns = (self.draft_ns[0], time.time_ns())
            for j, i in enumerate(drafting):
                n[i] = trees.n_nodes[j]
        S, M = len(active), max(n)
        dev = self.device
        if trees is not None and len(drafting) == S and trees.tokens.shape[1] >= M:
            # every session has a tree, in order (the usual step): the trees' own columns, three ops in all (after a
            # remote drafter's answer these launches are on the step's critical path)
            tok, parent, depth = (getattr(trees, f)[:, :M].to(dev, torch.int64, copy=True)
                                  for f in ("tokens", "parent", "depth"))
            return tok, parent, depth, n, self.drafter.depth
        tok = torch.full((S, M), -1, dtype=torch.int64, device=dev)
        parent = torch.full((S, M), -1, dtype=torch.int64, device=dev)
        depth = torch.full((S, M), -1, dtype=torch.int64, device=dev)
        tok[:, 0] = int64_to_device([s.root for s in active], dev)
        depth[:, 0] = 0
        max_depth = 0
        if trees is not None:
            idx = int64_to_device(drafting, dev)
            mt = trees.tokens.shape[1]
            tok[idx, :mt] = trees.tokens[:, :M].to(dev, torch.int64)
            parent[idx, :mt] = trees.parent[:, :M].to(dev, torch.int64)
            depth[idx, :mt] = trees.depth[:, :M].to(dev, torch.int64)
            max_depth = self.drafter.depth
        return tok, parent, depth, n, max_depth

    def _layout(self, active: list[Session], n: list[int]) -> _StepLayout:
        """The parts of the verify batch that depend on the node counts only, not on the trees. Its host values go
        up with one pinned copy that does not make the host wait for the GPU."""
        dev = self.device
        S, M = len(active), max(n)
        cu = [0, *itertools.accumulate(n)]
        gather = [s * M + j for s in range(S) for j in range(n[s])]  # flat <- padded
        host = [s.row for s in active] + [s.committed for s in active] + list(n) + cu + gather
        rows, committed, n_t, cu_t, gather_t = int64_to_device(host, dev).split([S, S, S, S + 1, len(gather)])
        local = torch.arange(M, device=dev)[None, :]
        return _StepLayout(list(n), gather_t, rows, committed, cu_q=cu_t.to(torch.int32),
                           write_slots=self.kv.slots(rows, committed[:, None] + local).view(-1)[gather_t],
                           block_table=self.kv.block_table[rows], n_t=n_t, starts=cu_t[:-1])

    @torch.no_grad()
    def step(self) -> dict[str, list[int]]:
        """Run one verify step over all running sessions; returns the tokens each one emitted."""
        host_timeline.mark("step_begin")
        active = [s for s in self.sessions.values() if not s.done]
        self.draft_ns = None
        if not active:
            return {}
        if self.ahead is not None and not self.ahead.early and self.cfg.ahead_gpu_wait:
            hold = getattr(self.drafter, "hold_for_ahead", None)
            if hold is not None:
                hold()
        self.kv.ensure_many([s.row for s in active], [s.committed + self.tree_nodes(s.params) for s in active])
        drafting, trees_of = self._draft_begin(active)
        # while a remote drafter works: the batch layout for full trees (what a drafter sends unless it fails)
        planned = self._layout(active, [self.tree_nodes(s.params) for s in active])
        host_timeline.mark("layout_queued")
        tok, parent, depth, n, max_depth = self._trees(active, drafting, trees_of)
        host_timeline.mark("trees_in")
        lay = planned if n == planned.n else self._layout(active, n)
        S, M = tok.shape
        dev = self.device
        gather, rows, committed = lay.gather, lay.rows, lay.committed
        # a tree refused by the device checks has token -1 past its root (never accepted, see
        # verifier_service.tree_verdicts): the forward embeds a real id there (0), acceptance compares -1
        node_tokens, positions, tree_bits = tree_inputs(tok, parent, depth, committed, gather, self.cfg.tree_inputs)
        host_timeline.mark("inputs_queued")
        fb = ForwardBatch(tokens=node_tokens, positions=positions, write_slots=lay.write_slots, cu_q=lay.cu_q,
                          prefix_lens=committed.to(torch.int32), block_table=lay.block_table,
                          page_size=self.kv.page_size, tree_bits=tree_bits)
        hidden, taps, logits = self._verify_forward(fb)
        host_timeline.mark("forward_queued")
        posterior = torch.full((S * M,), -1, dtype=torch.int64, device=dev)
        # node at position p predicts p + 1; nodes at one depth share (seed, p + 1) and so the noise
        sampled = any(not s.params.sampling.greedy for s in active)
        posterior[gather] = self.sampler.posterior(logits, rows[gather // M], fb.positions + 1, sampled)
        res = accept_tree(tok, parent, lay.n_t, posterior.view(S, M), max_depth, self.cfg.tree_accept)
        path = res.path.long()  # [S, D+1] node indices, -1 padded

        # commit: move the accepted rows down to committed + depth (all layers at once)
        # (padded moves go to the scratch slot: they must not alias rows outside the session's pages)
        src, dst = commit_moves(res.path, res.accept_len, rows, committed, self.kv.block_table, self.kv.page_size,
                                self.kv.scratch_slot, self.cfg.commit_moves)
        self.compact(src.view(-1), dst.view(-1))
        path_taps = taps[(lay.starts[:, None] + path.clamp(min=0)).view(-1)].view(S, path.shape[1], -1)
        path_tokens = tok.gather(1, path.clamp(min=0))

        # the step's one host read (the tree depth is for the per-depth acceptance metrics); with a draft queued
        # ahead, the drafter's counts too (checked against the host's below)
        host_timeline.mark("verify_queued")
        values = torch.cat((res.accept_len.long()[:, None], res.bonus.long()[:, None], depth.amax(1, keepdim=True),
                            path_tokens), 1)
        ahead = trees_of is not None and self._ahead_ok(active, drafting)
        early = not ahead and trees_of is not None and self._early_ok(active, drafting)
        rows = None  # with `early`: the paths' context rows for the next requests, queued behind the host's read
        if ahead:
            counts, roots, root_pos = draft_ahead.emitted_counts(active, path_tokens, res.accept_len, res.bonus,
                                                                 committed)
            host, ahead = self._read_then(torch.cat((values, counts[:, None]), 1),
                                          lambda: self._queue_ahead(active, path_taps, counts, roots, root_pos))
        elif early:
            host, rows = self._read_then(values, lambda: self._project(path_taps))
        else:
            host = values.cpu().tolist()
        if ahead:
            self.drafter.advance([s.sid for s in active], [h[-1] for h in host])
        host_timeline.mark("verify_read")
        out: dict[str, list[int]] = {}
        asks: list[DraftRequest] = []  # with `early`: the next step's requests, sent right after this loop
        for i, s in enumerate(active):
            a, bonus, s.tree_depth, ptoks = host[i][0], host[i][1], host[i][2], host[i][3 : 3 + path.shape[1]]
            new = ptoks[1 : a + 1] + [bonus]
            out[s.sid] = emitted = s.emit(new)
            # a turn that ends mid-path (EOS, max_new_tokens) keeps only what it emitted: its last
            # emitted token becomes the root, so a later turn (`extend`) continues from exactly there
            k = len(emitted)
            if ahead:
                if k != host[i][-1]:  # the drafter appended the device's count of rows: they must agree
                    raise RuntimeError(f"draft ahead: session {s.sid!r} emitted {k} tokens, the device counted "
                                       f"{host[i][-1]}")
            elif early and not s.done:
                asks.append(DraftRequest(s.sid, s.committed, rows[i, :k], new[k - 1], s.committed + k, s.params.budget,
                                         s.params.topk, "", self.projection is not None))
            else:
                s.add_pending(s.committed, path_taps[i, :k], self.cfg.draft_window)
            s.committed += k
            s.root = new[k - 1]
            s.accepted_per_step.append(a + 1)
            s.tree_sizes.append(n[i])
            if s.done and not s.persistent:
                self.finish(s.sid)
        if asks:
            self.ahead = draft_ahead.ask_early(self.drafter, asks)
        if ahead:
            self.ahead.requests = [DraftRequest(s.sid, 0, path_taps[:0, 0], s.root, s.committed, s.params.budget,
                                                s.params.topk, s.traceparent) for s in active]
            if all(s.done for s in active):  # no step will take it: let it go now, not after an idle spell
                self.ahead, ahead = None, self.ahead
                ahead.drop()
        host_timeline.mark("step_done")
        return out

    def _ahead_ok(self, active: list[Session], drafting: list[int]) -> bool:
        """Whether this step queues the next one's draft before its host read (cfg.draft_ahead)."""
        return (self.cfg.draft_ahead and getattr(self.drafter, "drafts_ahead", False)
                and draft_ahead.eligible(active, drafting))

    def _early_ok(self, active: list[Session], drafting: list[int]) -> bool:
        """Whether this step sends the next one's requests right after its host read (cfg.draft_ahead with a drafter
        in another process that cannot draft from device values, e.g. over gRPC): every session drafts and none is
        traced (a request carries the traceparent of the step that verifies its trees, not known yet)."""
        return (self.cfg.draft_ahead and getattr(self.drafter, "draft_begin", None) is not None
                and len(drafting) == len(active) and not any(s.traceparent for s in active))

    def _project(self, taps: torch.Tensor) -> torch.Tensor:
        """[S, P, F] taps -> what a request carries for them: the drafter's context rows when the engine holds its
        projection (one GEMM), else the taps."""
        if self.projection is None:
            return taps
        S, P, F = taps.shape
        return self.projection(taps.reshape(S * P, F)).view(S, P, -1)

    def wait_ahead(self) -> None:
        """Until the draft asked ahead of the next step is done: its trees in, or (a drafter in another process
        drafting from device values) written (for a benchmark that times each block of steps with the drafter work
        it started)."""
        if self.ahead is not None and self.ahead.early:
            self.ahead.begin([])()
        wait = getattr(self.drafter, "wait_ahead", None)
        if wait is not None:
            wait()

    def _queue_ahead(self, active: list[Session], path_taps: torch.Tensor, counts: torch.Tensor,
                     roots: torch.Tensor, root_pos: torch.Tensor) -> bool:
        """Queue the next step's draft from this step's device values (`draft_ahead`: the accepted paths' taps,
        projected here when the engine holds the projection, the device's emitted counts and roots) -> whether the
        drafter took it (one in another process may not: no stream, a session it does not know yet)."""
        rows, projected = self._project(path_taps), self.projection is not None
        p = active[0].params
        sent_ns = time.time_ns()  # before the request leaves: a drafter in another process may start at once
        out = self.drafter.draft_ahead([s.sid for s in active], [s.committed for s in active], rows,
                                       torch.stack((counts, roots, root_pos)), p.budget, p.topk, projected)
        if out is None:
            return False
        # an in-process drafter's trees, or a remote drafter's way to them
        begin = (lambda requests: lambda: out) if isinstance(out, TreeBatch) else out
        self.ahead = draft_ahead.AheadDraft([s.sid for s in active], [(p.budget, p.topk)] * len(active), begin,
                                            sent_ns=sent_ns)
        return True

    def _read_then(self, values: torch.Tensor, queue: Callable[[], bool]) -> tuple[list[list[int]], bool]:
        """values -> (host lists, what `queue` returned), with `queue`'s GPU work queued behind the copy and before the
        host waits for it (on a GPU: a pinned copy and an event; elsewhere the copy, then `queue`)."""
        if values.device.type != "cuda":
            host = values.tolist()
            return host, queue()
        buf = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        buf.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        queued = queue()
        copied.synchronize()
        return buf.tolist(), queued

    def run_until_done(self) -> None:
        while any(not s.done for s in self.sessions.values()):
            self.step()

    def generate(self, prompts: list[list[int]], params: DecodeParams | list[DecodeParams]) -> list[Session]:
        """Convenience: admit all prompts, run them concurrently to completion."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        for p, q in zip(prompts, plist, strict=True):
            self.validate(p, q)
        sessions = [self.add(p, q) for p, q in zip(prompts, plist, strict=True)]
        self.run_until_done()
        return sessions
