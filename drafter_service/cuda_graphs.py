"""The drafter's step in CUDA graphs: the DFlash block forward and the DDTree build (DESIGN 3.1, 3.4).

At small batches a draft step is all launch overhead (about 9 ms at 1 session, 45 ms at 32 on an H200 for
kimi-mini, for a few ms of GPU work), so `DraftGraphRunner` replays `Drafter.logq` + `build_tree` from CUDA
graphs. Graphs have fixed shapes and addresses, so a step is copied into the static input buffer of its
bucket, `[4, Rb]` int64 (cache row, context length, root token, root position per request), and padded:

  requests    R real ones, then pad requests up to the bucket Rb (`request_buckets`: 1, 2, 4, ..., the
              powers of two below max_sessions, then max_sessions);
  pad request cache row `DraftContextCache.pad_row` (owned by no session, never written), context length 0
              (its whole window is masked out; its block rows keep the softmax finite), root token 0 at
              position 0, and the same budget / top-k as the real ones.
Pad requests are harmless because every op of the draft is row-local per request: embedding, norms,
GEMMs, rope and the MLP act on rows; attention reads request r's own cache row `cache.k[:, rows[r]]` and
its own block, masked by its own context length; the log-softmax and every step of `build_tree` (per-depth
sort, beam, global sort, FCNS) work within one request's row. So a real request's result does not depend
on the pad requests' values (tests/unit/test_draft_graphs.py: bitwise in fp32 on the CPU in padded-eager
mode with the pad row poisoned with NaN; graph replay == padded eager bitwise on the GPU). Its bits may depend on Rb through the GEMMs' kernel
choice, as the eager draft's already depend on R: drafts need not be batch invariant (the verifier decides
what is accepted), only the verifier's forward does.

Keys are (Rb, budget, top-k): `build_tree` bakes the budget and top-k into its shapes and fills. A step
whose requests do not share one (budget, top-k) runs one group per pair, each through its own graph (a
replay is cheap, so a mixed step costs a few replays instead of a full eager step); the groups' trees are
merged into one TreeBatch in request order, padded to the widest (the pad values of `build_tree`). At
most `max_graphs` graphs are captured (budget and top-k come from clients): past that, new keys run eagerly
(unpadded), logged once.

Outputs: the graph packs the six [Rb, M] tree arrays into one [6, Rb, M] int32 buffer (logw bit-cast), a
static buffer that the next replay of the key overwrites. `run` copies the real rows out with one copy
(merging groups costs one copy each), so the TreeBatch it returns belongs to the caller: the engine and
the drafter server consume trees within the step, but a caller may keep them (tests compare two drafts).

What the draft derives from host values, and how each is capture-safe: R -> padded to Rb (part of the key);
budget, top-k -> part of the key; context lengths, rows, roots and positions -> read on the device from the
static buffer; the window W and the block size -> fixed by the cache and the model. Nothing in `Drafter.logq`
or `build_tree` synchronises with the host (the rope table is moved to the model's device once, by the
Drafter). A capture that fails is logged once, recorded in `failed`, and its key runs eagerly (unpadded)
from then on; `stats` counts replays, captures, padded-eager runs and eager groups. Off CUDA there is
nothing to capture: `capture=False` pads into the same buffers and runs eagerly (the CPU tests' mode).
"""

from __future__ import annotations

import bisect
import collections
import logging
from collections.abc import Callable, Iterable

import torch

from drafter_service.api import DraftRequest
from drafter_service.context_cache import DraftContextCache
from drafter_service.device_copy import int64_to_device
from kernels.tree_build import TreeBatch, build_tree, tree_size

log = logging.getLogger(__name__)

NEG_INF_BITS = int(torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32))  # logw padding, as int32
MAX_GRAPHS = 64


def request_buckets(max_requests: int) -> list[int]:
    """Padded request counts: the powers of two below max_requests, then max_requests (1, 2, 4, ..., 32, 48)."""
    if max_requests < 1:
        raise ValueError(f"request_buckets: max_requests must be >= 1, got {max_requests}")
    out = [1]
    while out[-1] * 2 < max_requests:
        out.append(out[-1] * 2)
    if out[-1] != max_requests:
        out.append(max_requests)
    return out


def pack_trees(t: TreeBatch) -> torch.Tensor:
    """TreeBatch -> [6, R, M] int32 in TreeBatch._FIELDS order (logw bit-cast): one buffer, one copy out."""
    return torch.stack([t.tokens, t.parent, t.depth, t.first_child, t.next_sibling, t.logw.view(torch.int32)])


def unpack_trees(packed: torch.Tensor, n_nodes: list[int]) -> TreeBatch:
    """[6, R, M] int32 -> TreeBatch whose arrays are views of `packed` (contiguous [R, M] each)."""
    return TreeBatch(packed[0], packed[1], packed[2], packed[3], packed[4], packed[5].view(torch.float32),
                     list(n_nodes))


class DraftGraphRunner:
    """Runs draft steps (block forward -> per-depth log-probs -> DDTree) from CUDA graphs keyed by
    (padded requests, budget, top-k).

    logq: (rows, ctx_len, roots, root_pos), each [Rb] int64 on the cache's device -> fp32 [Rb, L, V]
    (`Drafter.logq`: device ops only); cache: the drafter's context cache (rows, lengths, the pad row);
    depth: L = block_size - 1; vocab_size: V (top-k caps are min'd with it); capture: True = CUDA graphs
    (the cache must be on CUDA), False = pad into the same buffers and run eagerly (CPU tests)."""

    def __init__(self, logq: Callable[..., torch.Tensor], cache: DraftContextCache, depth: int, vocab_size: int,
                 capture: bool, max_graphs: int = MAX_GRAPHS):
        dev = cache.k.device
        if capture and dev.type != "cuda":
            raise ValueError("DraftGraphRunner: CUDA graphs need the context cache on a CUDA device")
        self.logq, self.cache, self.depth, self.vocab_size = logq, cache, depth, vocab_size
        self.capture, self.max_graphs, self.device = capture, max_graphs, dev
        self.buckets = request_buckets(cache.max_sessions)
        self.pad_column = [cache.pad_row, 0, 0, 0]  # row, context length, root token, root position
        pad = torch.tensor(self.pad_column, dtype=torch.int64, device=dev)[:, None]
        self.inputs = {n: pad.expand(4, n).contiguous() for n in self.buckets}  # static inputs per bucket
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed: dict[tuple[int, int, int], str] = {}  # key -> why its capture failed (runs eagerly)
        self.stats: collections.Counter = collections.Counter()  # replays, captures, padded_eager, eager
        self.enabled = True
        self._mempool = None
        self._stream = None
        self._warned: set[str] = set()

    # --- public -------------------------------------------------------------------------------------
    def bucket(self, n_requests: int) -> int | None:
        """The padded request count of a group of n_requests, None past the largest bucket."""
        i = bisect.bisect_left(self.buckets, n_requests)
        return self.buckets[i] if i < len(self.buckets) else None

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
        parts = [(idx, *self._group([requests[i] for i in idx], budget, topk))
                 for (budget, topk), idx in groups.items()]
        if len(parts) == 1:
            _, packed, fresh = parts[0]
            return unpack_trees(packed if fresh else packed.clone(), n_nodes)
        out = torch.full((6, R, max(n_nodes)), -1, dtype=torch.int32, device=self.device)
        out[5] = NEG_INF_BITS
        for idx, packed, _ in parts:
            out[:, int64_to_device(idx, self.device), : packed.shape[2]] = packed
        return unpack_trees(out, n_nodes)

    @torch.no_grad()
    def warmup(self, budget: int, topk: int, buckets: Iterable[int] | None = None) -> list[tuple[int, int, int]]:
        """Capture now the graphs of these request counts (default: every bucket) for one (budget, top-k), over
        all-padding inputs (nothing is written). -> the keys that have a graph. A no-op in padded-eager mode."""
        if not self.capture or not self.enabled:
            return []
        keys = []
        for n in sorted({b for b in (self.bucket(x) for x in (buckets or self.buckets)) if b is not None},
                        reverse=True):  # largest first: later captures reuse its pool blocks
            key = (n, budget, topk)
            if key not in self.graphs and key not in self.failed and len(self.graphs) < self.max_graphs:
                int64_to_device(self._columns([], n), self.device, out=self.inputs[n])  # all padding
                self._capture(key)
            if key in self.graphs:
                keys.append(key)
        return keys

    def reset(self) -> None:
        """Drop every graph and failure record (after changing the drafter's methods or weights' storage)."""
        self.graphs.clear()
        self.failed.clear()
        self._warned.clear()
        self._mempool = None

    # --- internals ----------------------------------------------------------------------------------
    def _columns(self, requests: list[DraftRequest], n: int) -> list[list[int]]:
        """[4, n] host ints: the requests' (row, context length, root, root position), then pad columns."""
        cols = [[self.cache.row(r.session_id), self.cache.length(r.session_id), r.root_token, r.root_pos]
                for r in requests]
        cols += [self.pad_column] * (n - len(requests))
        return [list(c) for c in zip(*cols)]

    def _body(self, inputs: torch.Tensor, budget: int, topk: int) -> torch.Tensor:
        """What a graph holds: the forward and the tree build of inputs [4, n] -> packed trees [6, n, M]."""
        rows, ctx_len, roots, root_pos = inputs.unbind(0)
        logq = self.logq(rows, ctx_len, roots, root_pos)
        n = inputs.shape[1]
        return pack_trees(build_tree(logq, roots, [budget] * n, [topk] * n))

    def _group(self, requests: list[DraftRequest], budget: int, topk: int) -> tuple[torch.Tensor, bool]:
        """One (budget, top-k) group -> (packed trees [6, >= R, M] with the real rows first, fresh: True when
        the tensor is not a graph's static output)."""
        R = len(requests)
        n = self.bucket(R)
        key = (n, budget, topk)
        if self.capture and key not in self.graphs:
            if key not in self.failed and len(self.graphs) >= self.max_graphs:
                self._warn(f"CUDA graphs: {self.max_graphs} draft graphs captured already; new (requests, budget, "
                           "top-k) keys run eagerly")
            if key in self.failed or len(self.graphs) >= self.max_graphs:
                self.stats["eager"] += 1
                return self._body(int64_to_device(self._columns(requests, R), self.device), budget, topk), True
        inputs = self.inputs[n]
        int64_to_device(self._columns(requests, n), self.device, out=inputs)
        if not self.capture:
            self.stats["padded_eager"] += 1
            return self._body(inputs, budget, topk)[:, :R], True
        entry = self.graphs.get(key) or self._capture(key)
        if entry is None:  # this capture failed just now
            self.stats["eager"] += 1
            return self._body(int64_to_device(self._columns(requests, R), self.device), budget, topk), True
        graph, packed = entry
        graph.replay()
        self.stats["replays"] += 1
        return packed[:, :R], False

    def _warn(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning(msg)

    def _capture(self, key: tuple[int, int, int]):
        """Warm up on a side stream, then capture the body over the static inputs (already loaded)."""
        n, budget, topk = key
        try:
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._body(self.inputs[n], budget, topk)  # compiles the kernels (reads only)
            torch.cuda.current_stream().wait_stream(self._stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                out = self._body(self.inputs[n], budget, topk)
        except Exception as exc:  # noqa: BLE001 - recorded; this key runs eagerly from now on
            self.failed[key] = f"{type(exc).__name__}: {exc}"[:500]
            self._warn(f"CUDA graphs: capture of the draft step for {n} requests (budget {budget}, top-k {topk}) "
                       f"failed, running it eagerly: {self.failed[key]}")
            self._mempool = None  # later captures start a fresh pool
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - report the capture error, not this one
                pass
            return None
        self.graphs[key] = (graph, out)
        self.stats["captures"] += 1
        return self.graphs[key]
