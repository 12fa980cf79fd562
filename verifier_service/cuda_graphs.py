"""The verify forward in CUDA graphs (DESIGN 3.4): static input buffers, padded token buckets, lazy capture.

A verify step's forward (`Engine.forward` over a tree batch, plus the lm_head logits) is launch bound at
small batches, so `GraphRunner` replays it from CUDA graphs. Graphs have fixed shapes and addresses, so
every step is copied into static input buffers sized for the largest batch and padded:

  tokens      T real tokens, then pad tokens up to the bucket Tb (`token_buckets`: 1, 2, 4, ..., 32, 48,
              64, 96, 128, 192, ...: powers of two and 1.5x of them);
  sessions    always max_sessions + 1: the step's S sessions, then empty sessions (cu_q repeats T), then
              the padding session (index max_sessions) that owns the pad tokens [T, Tb).
The padding session is harmless by construction: its block-table row is the KV pool's scratch page
(`KVPool.scratch_page`, owned by no session), its committed length is 0, its tokens are id 0 at
position 0, they write their latent KV to `KVPool.scratch_slot`, and their ancestor bits are bit 0 only
(each sees the padding session's row 0 = the scratch slot, at position 0). So pad tokens read and write
the scratch page and nothing else; real rows only see real rows (attention reads a row's own session
only). Every other op of the forward is row-local (norms, GEMMs, rope, router) or, for the routed
experts, groups pad tokens with real ones without mixing rows; with the batch-invariant kernels
(`verifier_service.batch_invariant`, the default on CUDA) a real row's bits do not depend on the pad rows
at all (tests/unit/test_cuda_graphs.py checks it bitwise on the GPU; on the CPU, whose torch GEMMs pick
other kernels for 1 or 3 rows, to 1e-12 in fp64, and the greedy tokens exactly).

What the forward derives from host values, and how each is made capture-safe:
  - T (total tokens): every activation shape, the MoE grouping size (`kernels._moe_align`: P = T * topk
    picks the one-program kernel or the torch path and its P_PAD constexpr), the grids of all kernels
    -> padded to the bucket Tb, part of the graph key;
  - the ancestor-mask width W = ceil(max nodes / 64) (1 or 2 words): the MLA kernel's NB constexpr
    -> part of the graph key (T, W);
  - S (sessions): the MLA kernel's S_PAD constexpr and the cu_q / prefix_lens / block-table shapes
    -> fixed at max_sessions + 1 (S_PAD = next_pow2(max_sessions + 1) loads per query tile: cheap);
  - the MLA split-KV grid: sized by `max_chunks(block-table width * page_size)`, a static bound, never by
    a prefix length; prefix lengths, positions, offsets and tree bits are read on the device only;
  - the page size and the block-table width: fixed by the pool (a batch with other values runs eagerly).
Host syncs that would break a capture, and where they are:
  - `verifier_service.aligned_attention` (int(cu[-1]), n.max(), count.max(), nonzero): the "aligned"
    cross-check mode -> `capture_blockers` reports it and such steps run eagerly;
  - dense (non-INT4) routed experts on CUDA run the reference loop (`bincount().tolist()`, a Python loop
    over experts) -> reported by `capture_blockers`, eager;
  - the CPU references (`mla_attention_ref`: cu_q.tolist(); `moe_dense_ref`) run only off CUDA, where
    there is nothing to capture: the runner then pads and runs eagerly (the "padded eager" mode that
    the CPU tests use to check the padding).
Outputs live in the graph's memory pool and are overwritten by the next replay of the same graph: `run`
returns slices [:T] that the engine consumes within its step (logits -> posterior tokens, taps ->
gathered path taps, fresh tensors) before it replays again. Graphs bake in the target's kernels as they
were at capture: after changing the target's methods (e.g. `make_batch_invariant`), call `reset()`.

A capture that fails is logged once, recorded in `failed` and its bucket runs eagerly (unpadded) from then
on; `stats` counts replays, captures, padded-eager runs and eager fallbacks.
"""

from __future__ import annotations

import bisect
import collections
import logging
from collections.abc import Callable, Iterable

import torch

from kernels.graph_capture import GraphCapture, warn_once
from verifier_service.forward_batch import ForwardBatch
from verifier_service.kv_cache import KVPool

log = logging.getLogger(__name__)

LOGITS_MAX_BYTES = 128 << 20  # the lm_head logits join a bucket's graph while [Tb, V] fp32 fits in this
MAX_TREE_WORDS = 2  # the MLA kernel reads at most two 64-bit words of ancestor bits (128 nodes)


def token_buckets(limit: int) -> list[int]:
    """Padded token counts up to the first one >= limit: 1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, ..."""
    if limit < 1:
        raise ValueError(f"token_buckets: limit must be >= 1, got {limit}")
    out = [1]
    while out[-1] < limit:
        b = out[-1]
        if b < 32:
            out.append(2 * b)
        elif b & (b - 1) == 0:  # a power of two: next is 1.5x
            out.append(b + b // 2)
        else:
            out.append(b // 3 * 4)  # 1.5 * 2^k -> 2^(k+1)
    return out


def capture_blockers(target: torch.nn.Module) -> list[str]:
    """Parts of the target known to synchronise with the host in their CUDA forward (not capturable)."""
    from verifier_service.aligned_attention import aligned_mla_attention
    from verifier_service.mla import MLAAttention
    from verifier_service.moe import MoE

    out = set()
    for m in target.modules():
        if isinstance(m, MLAAttention) and getattr(m, "attention", None) is aligned_mla_attention:
            out.add("aligned attention (verifier_service.aligned_attention) reads sizes on the host")
        elif isinstance(m, MoE):
            if not m.quantized:
                out.add("dense routed experts run the reference loop (bincount().tolist()) on CUDA")
            if len(m.expert_ids) != m.gate.cfg.n_routed_experts:
                out.add("the MoE holds an expert-parallel slice")
    return sorted(out)


class GraphRunner:
    """Runs tree-verify forwards from CUDA graphs keyed by (padded tokens, ancestor-mask words).

    forward: ForwardBatch -> (hidden [T, D], taps [T, F]) (the engine's `forward`; it writes the batch's
    latent KV at fb.write_slots); logits: hidden -> [T, V] logits, or None to leave them out of the graph;
    capture: True = CUDA graphs (the pool must be on CUDA), False = pad into the same buffers and run
    eagerly (CPU tests of the padding; no speed gain). `target`, when given, is checked by
    `capture_blockers` before each capture."""

    def __init__(self, forward: Callable, logits: Callable | None, pool: KVPool, max_sessions: int,
                 max_tokens: int, capture: bool, vocab_size: int = 0, target: torch.nn.Module | None = None,
                 logits_max_bytes: int = LOGITS_MAX_BYTES):
        if capture and pool.kv.device.type != "cuda":
            raise ValueError("GraphRunner: CUDA graphs need the KV pool on a CUDA device")
        if max_sessions < 1 or max_sessions > pool.block_table.shape[0]:
            raise ValueError(f"GraphRunner: max_sessions {max_sessions} must be in 1..{pool.block_table.shape[0]}")
        self.forward, self.logits, self.pool, self.capture, self.target = forward, logits, pool, capture, target
        self.vocab_size, self.logits_max_bytes = vocab_size, logits_max_bytes
        self.max_sessions = max_sessions
        self.pad_session = max_sessions  # index of the padding session; 0..max_sessions-1 hold the step's
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        dev, Tm, S = pool.kv.device, self.buckets[-1], max_sessions + 1
        i64 = dict(dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(Tm, **i64)
        self.positions = torch.zeros(Tm, **i64)
        self.write_slots = torch.full((Tm,), pool.scratch_slot, **i64)
        self.tree_bits = torch.zeros(Tm, MAX_TREE_WORDS, **i64)
        self.tree_bits[:, 0] = 1  # pad tokens see the padding session's row 0 only
        self.cu_q = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.zeros(S, dtype=torch.int32, device=dev)
        self.block_table = torch.full((S, pool.max_pages_per_session), pool.scratch_page, dtype=torch.int32,
                                      device=dev)
        self._dirty = 0  # token rows [0, _dirty) may hold a real batch's values (else: pad values)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.failed: dict[tuple[int, int], str] = {}  # key -> why its capture failed (runs eagerly)
        self.stats: collections.Counter = collections.Counter()  # replays, captures, padded_eager, eager
        self.enabled = True
        self._capturer = GraphCapture(pool.kv.device)
        self._warned: set[str] = set()
        self._blockers: list[str] | None = None  # capture_blockers(target), once (reset() forgets it)

    # --- public -------------------------------------------------------------------------------------
    def bucket(self, n_tokens: int) -> int | None:
        """The padded token count of a batch of n_tokens, None past the largest bucket."""
        i = bisect.bisect_left(self.buckets, n_tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    @torch.no_grad()
    def run(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The padded forward of a tree batch -> (hidden [T, D], taps [T, F], logits [T, V] or None), slices
        of static outputs valid until the next run; None when the batch is not for the runner (prefill,
        too many tokens or sessions, another pool geometry, disabled, a failed or blocked capture): the
        caller then runs it eagerly."""
        key = self._key(fb)
        if key is None:
            self.stats["eager"] += 1
            return None
        T = fb.num_tokens
        if not self.capture:
            self._load(fb, key[0])
            self.stats["padded_eager"] += 1
            hidden, taps, logits = self._body(*key)
        else:
            if key not in self.graphs and (key in self.failed or self._blocked()):
                self.stats["eager"] += 1
                return None
            self._load(fb, key[0])
            entry = self.graphs.get(key) or self._capture(key)
            if entry is None:
                self.stats["eager"] += 1
                return None
            graph, (hidden, taps, logits) = entry
            graph.replay()
            self.stats["replays"] += 1
        return hidden[:T], taps[:T], None if logits is None else logits[:T]

    @torch.no_grad()
    def warmup(self, buckets: Iterable[int] | None = None, words: int = 1) -> list[tuple[int, int]]:
        """Capture now the graphs of these token counts (default: every bucket) for trees of `words` mask
        words, over an all-padding batch (every token in the padding session: only the scratch page is
        written). -> the keys that have a graph. A no-op in padded-eager mode."""
        if not self.capture or not self.enabled or self._blocked():
            return []
        if not 1 <= words <= MAX_TREE_WORDS:
            raise ValueError(f"warmup: words must be 1..{MAX_TREE_WORDS}, got {words}")
        keys = []
        for n in sorted({b for b in (self.bucket(x) for x in (buckets or self.buckets)) if b is not None},
                        reverse=True):  # largest first: later captures reuse its pool blocks
            key = (n, words)
            if key not in self.graphs and key not in self.failed:
                self._load_padding(n)
                self._capture(key)
            if key in self.graphs:
                keys.append(key)
        return keys

    def reset(self) -> None:
        """Drop every graph and failure record (after changing the target's methods or weights' storage)."""
        self.graphs.clear()
        self.failed.clear()
        self._warned.clear()
        self._blockers = None
        self._capturer.reset()

    # --- internals ----------------------------------------------------------------------------------
    def _key(self, fb: ForwardBatch) -> tuple[int, int] | None:
        if not self.enabled or fb.tree_bits is None:
            return None
        T, S, W = fb.num_tokens, fb.prefix_lens.shape[0], fb.tree_bits.shape[1]
        n = self.bucket(T)
        if (n is None or T == 0 or S > self.max_sessions or W > MAX_TREE_WORDS or fb.page_size != self.pool.page_size
                or fb.block_table.shape[1] != self.block_table.shape[1]):
            return None
        return n, W

    def _with_logits(self, n: int) -> bool:
        return self.logits is not None and n * max(self.vocab_size, 1) * 4 <= self.logits_max_bytes

    def _static_batch(self, n: int, W: int) -> ForwardBatch:
        return ForwardBatch(tokens=self.tokens[:n], positions=self.positions[:n], write_slots=self.write_slots[:n],
                            cu_q=self.cu_q, prefix_lens=self.prefix_lens, block_table=self.block_table,
                            page_size=self.pool.page_size, tree_bits=self.tree_bits[:n, :W])

    def _body(self, n: int, W: int) -> tuple:
        """What a graph holds: the forward over the static buffers (n tokens, W mask words), then logits."""
        hidden, taps = self.forward(self._static_batch(n, W))
        return hidden, taps, self.logits(hidden) if self._with_logits(n) else None

    def _reset_tokens(self, start: int) -> None:
        """Pad values in token rows [start, _dirty)."""
        if self._dirty > start:
            sl = slice(start, self._dirty)
            self.tokens[sl] = 0
            self.positions[sl] = 0
            self.write_slots[sl] = self.pool.scratch_slot
            self.tree_bits[sl, 0] = 1
            self.tree_bits[sl, 1:] = 0
        self._dirty = min(self._dirty, start)

    def _load(self, fb: ForwardBatch, n: int) -> None:
        """Copy the step into the static buffers, padded to n tokens (device copies; nothing is synced)."""
        T, S, W = fb.num_tokens, fb.prefix_lens.shape[0], fb.tree_bits.shape[1]
        self.tokens[:T].copy_(fb.tokens)
        self.positions[:T].copy_(fb.positions)
        self.write_slots[:T].copy_(fb.write_slots)
        self.tree_bits[:T, :W].copy_(fb.tree_bits)
        self._reset_tokens(T)  # rows a larger earlier batch left behind become pad rows again
        self._dirty = T
        self.cu_q[: S + 1].copy_(fb.cu_q)
        self.cu_q[S + 1 : -1] = T  # empty sessions S..max_sessions-1 (their other rows are never read)
        self.cu_q[-1:] = n  # the padding session owns [T, n)
        self.prefix_lens[:S].copy_(fb.prefix_lens)
        self.block_table[:S].copy_(fb.block_table)

    def _load_padding(self, n: int) -> None:
        """An all-padding batch of n tokens (warm-up captures)."""
        self._reset_tokens(0)
        self.cu_q[:-1] = 0
        self.cu_q[-1:] = n

    def _blocked(self) -> bool:
        if self.target is None:
            return False
        if self._blockers is None:
            self._blockers = capture_blockers(self.target)
        reasons = self._blockers
        for r in reasons:
            self._warn(f"CUDA graphs: running the verify forward eagerly: {r}")
        return bool(reasons)

    def _warn(self, msg: str) -> None:
        warn_once(log, self._warned, msg)

    def _capture(self, key: tuple[int, int]):
        """Warm up on a side stream, then capture the body over the static buffers (already loaded)."""
        entry = self._capturer.capture_or_record(key, lambda: self._body(*key), self.graphs, self.failed,
                                                 self._warn, f"{key[0]} tokens x {key[1]} mask words")
        self.stats["captures"] += entry is not None
        return entry
