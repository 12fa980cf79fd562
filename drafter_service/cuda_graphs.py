"""The drafter's step in CUDA graphs: the context append, the DFlash block forward and the DDTree build
(DESIGN 2.2, 3.1, 3.4).

At small batches a draft step is all launch overhead (about 9 ms at 1 session, 45 ms at 32 on an H200 for
kimi-mini, for a few ms of GPU work), so `DraftGraphRunner` replays both halves of a step from CUDA graphs:
the context append (`context_kv_from` + the ring scatter) and the draft (`Drafter.logq` + `build_tree`). Graphs
have fixed shapes and addresses, so each half is copied into static buffers and padded:

  draft       per request bucket Rb (`pow2_buckets(max_sessions)`: 1, 2, 4, ..., max_sessions), an int64
              [4, Rb] input (cache row, context length, root token, root position per request): R real
              requests, then pad requests: cache row `DraftContextCache.pad_row` (owned by no session),
              context length 0 (its window is masked out; its block rows keep the softmax finite), root
              token 0 at position 0, and the same budget / top-k as the real ones;
  append      per row bucket Tb (`pow2_buckets(max_context_rows)`), the first Tb rows of a static feature
              buffer [max_context_rows, F] and of an int64 index [max_context_rows, 3] (cache row, ring slot,
              position; `DraftContextCache.plan`): T real rows, then pad rows that write the pad row
              (`DraftContextCache.pad_index`) from whatever features the buffer holds there.
Padding is harmless because every op is row-local: embedding, norms, GEMMs, rope and the MLP act on rows;
attention reads request r's own cache row `cache.k[:, rows[r]]` and its own block, masked by its own
context length; the log-softmax and every step of `build_tree` (per-depth sort, beam, global sort, FCNS)
work within one request's row; the scatter writes a real row only where its plan says, pad rows only into
the pad row, which sessions never read. So a real result does not depend on the pad values
(tests/unit/test_draft_graphs.py: bitwise in fp32 on the CPU in padded-eager mode with the pad row poisoned
with NaN; graph replay == padded eager bitwise on the GPU). Its bits may depend on the bucket through the
GEMMs' kernel choice, as the eager draft's depend on R: drafts need not be batch invariant (the verifier
decides what is accepted), only the verifier's forward does.

Keys: (Rb, budget, top-k) for drafts (`build_tree` bakes budget and top-k into shapes and fills), ("context",
Tb) for appends. A step whose requests do not share one (budget, top-k) runs one group per pair, each
through its own graph (a replay is cheap, so a mixed step costs a few replays instead of a full eager step);
the groups' trees are merged into one TreeBatch in request order, padded to the widest (`build_tree`'s pad
values). At most `max_graphs` draft graphs are captured (budget and top-k come from clients): past that, new
keys run eagerly (unpadded), logged once. Appends of more than max_context_rows rows (prefills) run eagerly.

Outputs: a draft graph packs the six [Rb, M] tree arrays into one [6, Rb, M] int32 buffer (logw bit-cast), a
static buffer that the next replay of the key overwrites. `run` copies the real rows out with one copy
(merging groups costs one copy each), so the TreeBatch it returns belongs to the caller: the engine and
the drafter server consume trees within the step, but a caller may keep them (tests compare two drafts).
All graphs share one memory pool, which is only safe for outputs read before any other graph replays (a
graph captured earlier may keep its intermediates where a later one's output lives): so a mixed step
copies each group's rows out right after that group's replay. (Reading them all after the last replay
broke greedy DDTree == AR on the H200 when the groups replayed in another order than they were captured.)
An append graph writes the cache in place (its capture's warm-up run on a side stream already does the
write; replaying it writes the same values again).

Host values and capture safety: R, T -> padded to buckets (part of the key); budget, top-k -> key; rows,
lengths, roots, positions, ring slots -> read on the device from the static buffers; the window and the
block size -> fixed by the cache and the model. Nothing in `Drafter.logq`, `context_kv_from`, the scatter or
`build_tree` synchronises with the host (the rope table is moved to the model's device once, by the
Drafter). A capture that fails is logged once, recorded in `failed`, and its key runs eagerly (unpadded)
from then on; `stats` counts replays, captures, padded-eager runs and eager runs (`context_*` for appends).
Off CUDA there is nothing to capture: `capture=False` pads into the same buffers and runs eagerly (the CPU
tests' mode).
"""

from __future__ import annotations

import bisect
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter_service.api import DraftRequest
from drafter_service.context_cache import DraftContextCache
from drafter_service.device_copy import host_to_device, int64_to_device, rows_to_device
from kernels.graph_capture import GraphCapture, warn_once
from kernels.tree_build import TreeBatch, build_tree, tree_size

log = logging.getLogger(__name__)

NEG_INF_BITS = int(torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32))  # logw padding, as int32
MAX_GRAPHS = 64


def ahead_draft(cache: DraftContextCache, context_kv: Callable, logq: Callable[..., torch.Tensor], vocab_size: int,
                index: torch.Tensor, pad_index: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                values: torch.Tensor, feats: torch.Tensor, budget: int, topk: int) -> TreeBatch:
    """The device part of `Drafter.draft_ahead` for S sessions of P candidate rows (an ahead graph's body, and the
    eager path): index [S * P, 3] (a plan of every candidate row) and pad_index [S * P, 3], rows and lengths [S] (cache
    row, context length before), values [3, S] (committed rows, root, root position: clamped here into 1..P, the
    vocabulary, 0..2**31), feats [S * P, D] projected rows -> the trees. Rows past a session's count go to the pad
    row; a padded session (cache row = the pad row) reads nothing. Device ops only, row-local per session."""
    S = rows.shape[0]
    P = index.shape[0] // S
    counts = values[0].clamp(1, P)
    roots = values[1].clamp(0, vocab_size - 1)
    root_pos = values[2].clamp(0, (1 << 31) - 1)
    keep = torch.arange(P, device=index.device)[None, :] < counts[:, None]
    idx = torch.where(keep.reshape(-1, 1), index, pad_index)
    cache.scatter(idx, context_kv(feats, idx[:, 2]))
    ctx_len = (lengths + counts).clamp(max=cache.window)
    ctx_len = torch.where(rows == cache.pad_row, 0, ctx_len)
    return build_tree(logq(rows, ctx_len, roots, root_pos), roots, [budget] * S, [topk] * S)


@dataclass(eq=False)
class AheadStaged:
    """An ahead step staged (`DraftGraphRunner.ahead_stage`): its graph's key ("ahead", padded sessions, P, budget,
    top-k), its sessions S and candidate rows P each, and its host values (index, cache rows, lengths; pinned on a
    GPU), uploaded at its launch."""

    key: tuple
    sessions: int
    rows: int
    block: torch.Tensor


def pow2_buckets(limit: int) -> list[int]:
    """Padded sizes: the powers of two below limit, then limit (1, 2, 4, ..., 32, 48 for 48)."""
    if limit < 1:
        raise ValueError(f"pow2_buckets: limit must be >= 1, got {limit}")
    out = [1]
    while out[-1] * 2 < limit:
        out.append(out[-1] * 2)
    if out[-1] != limit:
        out.append(limit)
    return out


class DraftGraphRunner:
    """Runs draft steps (block forward -> per-depth log-probs -> DDTree) and context appends from CUDA graphs.

    logq: (rows, ctx_len, roots, root_pos), each [Rb] int64 on the cache's device -> fp32 [Rb, L, V]
    (`Drafter.logq`: device ops only); context_kv: (context rows [T, F], positions [T]) -> per layer (K, V)
    (`DFlashDrafter.context_kv_from`: rows already projected); cache: the drafter's context cache; depth:
    L = block_size - 1; vocab_size: V (top-k caps are min'd with it); feature_dim F and dtype: those rows';
    max_context_rows: the largest append replayed (larger ones run eagerly); capture: True = CUDA graphs (the
    cache must be on CUDA), False = pad into the same buffers and run eagerly (CPU tests)."""

    def __init__(self, logq: Callable[..., torch.Tensor], context_kv: Callable, cache: DraftContextCache,
                 depth: int, vocab_size: int, feature_dim: int, dtype: torch.dtype, max_context_rows: int,
                 capture: bool, max_graphs: int = MAX_GRAPHS):
        dev = cache.k.device
        if capture and dev.type != "cuda":
            raise ValueError("DraftGraphRunner: CUDA graphs need the context cache on a CUDA device")
        self.logq, self.context_kv, self.cache, self.depth, self.vocab_size = logq, context_kv, cache, depth, vocab_size
        self.capture, self.max_graphs, self.device = capture, max_graphs, dev
        self.buckets = pow2_buckets(cache.max_sessions)
        self.row_buckets = pow2_buckets(max_context_rows)
        self.pad_column = [cache.pad_row, 0, 0, 0]  # row, context length, root token, root position
        pad = torch.tensor(self.pad_column, dtype=torch.int64, device=dev)[:, None]
        self.inputs = {n: pad.expand(4, n).contiguous() for n in self.buckets}  # static draft inputs per bucket
        self.ctx_feats = torch.zeros(self.row_buckets[-1], feature_dim, dtype=dtype, device=dev)  # static rows
        self.pad_index = cache.pad_index(self.row_buckets[-1])  # host; its first k rows are pad_index(k)
        self.ctx_index = self.pad_index.to(dev, copy=True)  # static [rows, 3]: row, ring slot, position (not an alias)
        self.pad_index_device = self.pad_index.to(dev, copy=True)  # `append_device`'s padding (never written)
        # ahead steps (`ahead_stage`, `ahead_launch`): per candidate rows P, the static index and columns (flat),
        # and [rows, D] rows (made on first use)
        self._ahead_index: dict[int, torch.Tensor] = {}
        self._ahead_feats: dict[int, torch.Tensor] = {}
        # and the peer's per-request values: committed count, root, root position ([3, max_sessions], from the device)
        self.ahead_columns = torch.zeros(3, self.buckets[-1], dtype=torch.int64, device=dev)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.failed: dict[tuple, str] = {}  # key -> why its capture failed (runs eagerly)
        self.stats: collections.Counter = collections.Counter()  # replays, captures, padded_eager, eager, context_*,
        # ahead_* (ahead_queued: ahead replays queued behind the verifier's request doorbell, `DraftStream`)
        self.enabled = True
        self._capturer = GraphCapture(dev)
        self._warned: set[str] = set()

    # --- public -------------------------------------------------------------------------------------
    def bucket(self, n_requests: int) -> int | None:
        """The padded request count of a group of n_requests, None past the largest bucket."""
        i = bisect.bisect_left(self.buckets, n_requests)
        return self.buckets[i] if i < len(self.buckets) else None

    def row_bucket(self, n_rows: int) -> int | None:
        """The padded row count of an append of n_rows, None past the largest bucket."""
        i = bisect.bisect_left(self.row_buckets, n_rows)
        return self.row_buckets[i] if i < len(self.row_buckets) else None

    @torch.no_grad()
    def append(self, index: torch.Tensor, parts: list[torch.Tensor]) -> bool:
        """Write context rows: index [T, 3] on the host (a `DraftContextCache.plan`'s), parts: the kept feature
        rows in plan order (T in all). -> False when the append is not for the runner (disabled, too many
        rows, a failed capture): the caller then appends eagerly. Counts are the caller's to commit."""
        T = index.shape[0]
        n = self.row_bucket(T)
        key = ("context", n)
        if not self.enabled or T == 0:
            return False
        if n is None or key in self.failed:
            self.stats["context_eager"] += 1
            return False
        int64_to_device(torch.cat((index, self.pad_index[: n - T])), self.device, out=self.ctx_index[:n])
        rows_to_device(parts, self.device, self.ctx_feats.dtype, out=self.ctx_feats[:T])
        return self._append_replay(n)

    @torch.no_grad()
    def append_device(self, index: torch.Tensor, feats: torch.Tensor) -> bool:
        """`append` of an index [T, 3] and rows [T, F] already on the device (`Drafter.draft_ahead`: rows past a
        session's device-side count point at the pad row): two device copies into the static buffers."""
        T = index.shape[0]
        n = self.row_bucket(T)
        if not self.enabled or T == 0:
            return False
        if n is None or ("context", n) in self.failed:
            self.stats["context_eager"] += 1
            return False
        self.ctx_index[:T].copy_(index)
        if n > T:
            self.ctx_index[T:n].copy_(self.pad_index_device[: n - T])
        self.ctx_feats[:T].copy_(feats)
        return self._append_replay(n)

    def _append_replay(self, n: int) -> bool:
        """Replay (capturing first) the append of the first n static rows; False when its capture failed."""
        key = ("context", n)
        if not self.capture:
            self.stats["context_padded_eager"] += 1
            self._append_body(n)
            return True
        entry = self.graphs.get(key) or self._capture(key, lambda: self._append_body(n))
        if entry is None:  # this capture failed just now
            self.stats["context_eager"] += 1
            return False
        entry[0].replay()
        self.stats["context_replays"] += 1
        return True

    @torch.no_grad()
    def run(self, requests: list[DraftRequest]) -> TreeBatch | None:
        """Draft trees for requests whose context is already in the cache -> a TreeBatch the caller owns;
        None when the step is not for the runner (disabled, no requests, more requests than sessions): the
        caller then drafts eagerly."""
        R = len(requests)
        if not self.enabled or R == 0 or self.bucket(R) is None:
            return None
        groups: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.budget, r.topk), []).append(i)
        n_nodes = [tree_size(r.budget, min(r.topk, self.vocab_size), self.depth) for r in requests]
        if len(groups) == 1:
            (budget, topk), = groups
            packed, fresh = self._group(R, budget, topk, self._fill_requests(requests))
            return TreeBatch.from_packed(packed if fresh else packed.clone(), n_nodes)
        # Each group's trees are copied out right after its replay, before the next group's: the graphs share
        # one memory pool, so a graph captured earlier than this one may hold its intermediates where this
        # one's output lives, and groups replay in request order, not in capture order.
        out = torch.full((6, R, max(n_nodes)), -1, dtype=torch.int32, device=self.device)
        out[5] = NEG_INF_BITS
        for (budget, topk), idx in groups.items():
            packed, _ = self._group(len(idx), budget, topk, self._fill_requests([requests[i] for i in idx]))
            out[:, int64_to_device(idx, self.device), : packed.shape[2]] = packed
        return TreeBatch.from_packed(out, n_nodes)

    @torch.no_grad()
    def run_device(self, rows: list[int], columns: torch.Tensor, budget: int, topk: int) -> TreeBatch | None:
        """Draft one (budget, top-k) tree per cache row `rows` whose context length, root token and root position
        are on the device (columns [3, R] int64: `Drafter.draft_ahead`) -> a TreeBatch the caller owns; None when
        the step is not for the runner (as `run`)."""
        R = len(rows)
        if not self.enabled or R == 0 or self.bucket(R) is None:
            return None

        def fill(out: torch.Tensor) -> None:
            n = out.shape[1]
            int64_to_device([rows + [self.cache.pad_row] * (n - R), *([0] * n for _ in range(3))], self.device,
                            out=out)
            out[1:, :R] = columns

        packed, fresh = self._group(R, budget, topk, fill)
        n_nodes = [tree_size(budget, min(topk, self.vocab_size), self.depth)] * R
        return TreeBatch.from_packed(packed if fresh else packed.clone(), n_nodes)

    @torch.no_grad()
    def ahead_stage(self, index: torch.Tensor, rows: list[int], lengths: list[int], budget: int, topk: int
                    ) -> AheadStaged | None:
        """The host part of `Drafter.draft_ahead` as one graph, before its rows and values exist: S sessions' P
        candidate rows' places index [S * P, 3] on the host (a plan of all P rows), each session's cache row and
        context length before -> the stage (its host values in one pinned block), for `ahead_launch`; None when not
        for the runner (as `run`). No GPU work."""
        S = len(rows)
        P, n = index.shape[0] // max(S, 1), self.bucket(S)
        if not self.enabled or S == 0 or n is None:
            return None
        key = ("ahead", n, P, budget, topk)
        if key in self.failed or (self.capture and key not in self.graphs and self._draft_graphs() >= self.max_graphs):
            return None
        pad = n * P - S * P
        host = torch.cat((index, self.cache.pad_index(pad))) if pad else index
        cols = [rows + [self.cache.pad_row] * (n - S), lengths + [0] * (n - S)]
        block = torch.cat((host.reshape(-1), torch.tensor(cols, dtype=torch.int64).reshape(-1)))
        # uploaded at the launch: a copy queued now would be GPU work of this process's while the peer's GPU still
        # computes the values, and the GPU would switch contexts for it mid-step
        return AheadStaged(key, S, P, block.pin_memory() if self.device.type == "cuda" else block)

    def captured(self, staged: AheadStaged) -> bool:
        """Whether `ahead_launch` of this stage replays a graph held already (no capture, no eager body)."""
        return self.capture and staged.key in self.graphs

    @torch.no_grad()
    def ahead_launch(self, staged: AheadStaged, feats: torch.Tensor, values: torch.Tensor) -> TreeBatch | None:
        """A staged ahead step's device part: its candidate rows feats [S * P, D] (projected) and values [3, S]
        int64 on the device (committed rows, root, root position: clamped into 1..P, the vocabulary, 0..2**31 in
        the graph) -> the trees (the caller's); None when its graph's capture failed. Inside the graph: rows past a
        session's count go to the pad row; the context lengths, the draft and the tree build follow from the device
        values. Padded sessions are pad rows with context length 0. The stage's host values go up first (one copy)."""
        key, S, P = staged.key, staged.sessions, staged.rows
        n, budget, topk = key[1], key[3], key[4]
        self._upload_ahead(staged)
        feat_buf = self._ahead_rows(P, feats.shape[1], feats.dtype)
        feat_buf[: S * P].copy_(feats)
        # padding's values are whatever an earlier step left: clamped, and its rows and reads go to the pad row
        self.ahead_columns[:, :S].copy_(values)
        if not self.capture:
            self.stats["ahead_padded_eager"] += 1
            packed = self._ahead_body(n, P, budget, topk)
            fresh = True
        else:
            entry = self.graphs.get(key) or self._capture(key, lambda: self._ahead_body(n, P, budget, topk))
            if entry is None:
                return None
            entry[0].replay()
            self.stats["ahead_replays"] += 1
            packed, fresh = entry[1], False
        n_nodes = [tree_size(budget, min(topk, self.vocab_size), self.depth)] * S
        return TreeBatch.from_packed(packed[:, :S] if fresh else packed[:, :S].clone(), n_nodes)

    @torch.no_grad()
    def warmup(self, budget: int, topk: int) -> list[tuple]:
        """Capture now the draft graphs of every request bucket for one (budget, top-k) and the append graphs
        of every row bucket, over all-padding inputs (only the pad row is written). -> the keys that have a
        graph. A no-op in padded-eager mode."""
        if not self.capture or not self.enabled:
            return []
        keys = []
        for n in reversed(self.buckets):  # largest first: later captures reuse its pool blocks
            key = (n, budget, topk)
            if key not in self.graphs and key not in self.failed and self._draft_graphs() < self.max_graphs:
                int64_to_device(self._columns([], n), self.device, out=self.inputs[n])  # all padding
                self._capture(key, lambda n=n: self._draft_body(self.inputs[n], budget, topk))
            keys += [key] if key in self.graphs else []
        for n in reversed(self.row_buckets):
            key = ("context", n)
            if key not in self.graphs and key not in self.failed:
                int64_to_device(self.pad_index[:n], self.device, out=self.ctx_index[:n])
                self._capture(key, lambda n=n: self._append_body(n))
            keys += [key] if key in self.graphs else []
        return keys

    def reset(self) -> None:
        """Drop every graph and failure record (after changing the drafter's methods or weights' storage)."""
        self.graphs.clear()
        self.failed.clear()
        self._warned.clear()
        self._capturer.reset()

    # --- internals ----------------------------------------------------------------------------------
    def _draft_graphs(self) -> int:
        return sum(1 for k in self.graphs if k[0] != "context")

    def _columns(self, requests: list[DraftRequest], n: int) -> list[list[int]]:
        """[4, n] host ints: the requests' (row, context length, root, root position), then pad columns."""
        cols = [[self.cache.row(r.session_id), self.cache.length(r.session_id), r.root_token, r.root_pos]
                for r in requests]
        cols += [self.pad_column] * (n - len(requests))
        return [list(c) for c in zip(*cols)]

    def _draft_body(self, inputs: torch.Tensor, budget: int, topk: int) -> torch.Tensor:
        """A draft graph: the forward and the tree build of inputs [4, n] -> packed trees [6, n, M]."""
        rows, ctx_len, roots, root_pos = inputs.unbind(0)
        logq = self.logq(rows, ctx_len, roots, root_pos)
        n = inputs.shape[1]
        return build_tree(logq, roots, [budget] * n, [topk] * n).pack()

    def _upload_ahead(self, staged: AheadStaged) -> None:
        """A stage's host values into the static input of ahead steps of its P rows: index, cache rows, lengths."""
        n, P = staged.key[1], staged.rows
        flat = self._ahead_index.get(P)
        if flat is None:  # index [max_sessions * P, 3], then the per-request columns (cache row, length): one upload
            flat = torch.zeros(self.buckets[-1] * (P * 3 + 2), dtype=torch.int64, device=self.device)
            self._ahead_index[P] = flat
        host_to_device(staged.block, self.device, out=flat[: n * P * 3 + 2 * n])

    def _ahead_rows(self, P: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The static rows [max_sessions * P, width] of ahead steps of P rows."""
        rows = self._ahead_feats.get(P)
        if rows is None or rows.shape[1] != width or rows.dtype != dtype:
            rows = torch.zeros(self.buckets[-1] * P, width, dtype=dtype, device=self.device)
            self._ahead_feats[P] = rows
        return rows

    def _ahead_inputs(self, n: int, P: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the static index [n * P, 3], the host columns [2, n]: cache row, context length before)."""
        flat = self._ahead_index[P]
        index = flat[: n * P * 3].view(n * P, 3)
        host = flat[n * P * 3 : n * P * 3 + 2 * n].view(2, n)
        return index, host

    def _ahead_body(self, n: int, P: int, budget: int, topk: int) -> torch.Tensor:
        """An ahead graph: the masked append of n sessions' P rows each, then their draft and trees -> packed."""
        index, host = self._ahead_inputs(n, P)
        return ahead_draft(self.cache, self.context_kv, self.logq, self.vocab_size, index,
                           self.pad_index_device[: n * P], host[0], host[1], self.ahead_columns[:, :n],
                           self._ahead_feats[P][: n * P], budget, topk).pack()

    def _append_body(self, n: int) -> None:
        """An append graph: each layer's K/V of the first n static context rows, scattered by the static index."""
        index = self.ctx_index[:n]
        self.cache.scatter(index, self.context_kv(self.ctx_feats[:n], index[:, 2]))

    def _fill_requests(self, requests: list[DraftRequest]) -> Callable[[torch.Tensor], None]:
        """A group's input filler (`_group`) from host requests: one upload of their columns and the padding."""
        return lambda out: int64_to_device(self._columns(requests, out.shape[1]), self.device, out=out)

    def _group(self, R: int, budget: int, topk: int, fill: Callable[[torch.Tensor], None]
               ) -> tuple[torch.Tensor, bool]:
        """One (budget, top-k) group of R requests, whose [4, n] inputs `fill` writes (n >= R: the real columns
        first, then padding) -> (packed trees [6, >= R, M] with the real rows first, fresh: True when the tensor
        is not a graph's static output)."""
        n = self.bucket(R)
        key = (n, budget, topk)
        if self.capture and key not in self.graphs:
            full = self._draft_graphs() >= self.max_graphs
            if full and key not in self.failed:
                self._warn(f"CUDA graphs: {self.max_graphs} draft graphs captured already; new (requests, budget, "
                           "top-k) keys run eagerly")
            if full or key in self.failed:
                return self._eager(R, budget, topk, fill), True
        inputs = self.inputs[n]
        fill(inputs)
        if not self.capture:
            self.stats["padded_eager"] += 1
            return self._draft_body(inputs, budget, topk)[:, :R], True
        entry = self.graphs.get(key) or self._capture(key, lambda: self._draft_body(inputs, budget, topk))
        if entry is None:  # this capture failed just now
            return self._eager(R, budget, topk, fill), True
        graph, packed = entry
        graph.replay()
        self.stats["replays"] += 1
        return packed[:, :R], False

    def _eager(self, R: int, budget: int, topk: int, fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
        self.stats["eager"] += 1
        inputs = torch.empty(4, R, dtype=torch.int64, device=self.device)
        fill(inputs)
        return self._draft_body(inputs, budget, topk)

    def _warn(self, msg: str) -> None:
        warn_once(log, self._warned, msg)

    def _capture(self, key: tuple, body: Callable[[], torch.Tensor | None]):
        """Run `body` once on a side stream (compiles the kernels; an append writes what its replay writes),
        then capture it over the static buffers (already loaded) -> (graph, output) or None (logged)."""
        entry = self._capturer.capture_or_record(key, body, self.graphs, self.failed, self._warn,
                                                 f"the drafter's {key} graph")
        self.stats["captures"] += entry is not None
        return entry
