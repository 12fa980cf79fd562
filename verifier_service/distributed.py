"""The verifier as a torch.distributed group (DESIGN 7): rank 0 leads, ranks > 0 replay its target calls.

Every rank holds the replicated parts of the target (attention, dense layers, shared experts, router,
embeddings, lm_head) and its slice of the routed experts (`expert_parallel`). Rank 0 is the whole
single-process verifier (engine, scheduler, gRPC server, drafter client); its engine is a
`LeaderEngine`, an `Engine` whose two operations that change the target's state are broadcast before
they run:
  - `forward(fb)`: the target over a flat ForwardBatch, which also writes the batch's latent KV;
  - `compact(src, dst)`: the commit's KV row moves.
Followers (`Follower.run`) replay them on their own model and KV pool, so the replicated attention and
KV stay bitwise identical and every MoE layer's all-reduce has all ranks in it. Cache addresses travel
as physical slots and pages chosen by rank 0: page allocation and release, sessions, sampling,
acceptance and the drafter exist on rank 0 only; acceptance is decided once, from rank 0's logits, and
reaches the followers as the KV moves it implies.

Two process groups:
  control  gloo (host): one int64[8] header per operation (`Op`), sent by rank 0; small and ordered;
  data     the default group (NCCL on GPUs, gloo on CPU): one int64 payload per operation (the
           ForwardBatch tensors packed, or the moves) and the MoE all-reduces inside the forward.
Startup: each rank loads at its own pace; rank 0's HELLO (KV pool shape, dtype, world, experts) is
checked by every follower and acknowledged on the control group, within `startup_timeout_s`, before any
forward. Liveness: rank 0 pings on the control group whenever it has sent nothing for `ping_s` (an idle
server), so a follower that hears nothing for `timeout_s` knows rank 0 is gone or hung, logs it and exits;
a dead peer's closed socket fails the next gloo operation at once; a hung NCCL collective is ended by
the data group's timeout (NCCL's watchdog aborts the process). A failure on rank 0 marks the leader
failed and calls `on_failure` (the server then exits): a torch.distributed world cannot lose a member
and carry on, the launcher (torchrun, the LeaderWorkerSet) restarts the whole group.
Shutdown: `LeaderEngine.close()` sends STOP; followers return from `run`.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from drafter_service.context_projection import ContextProjection
from kernels.kv_compact import compact_kv
from verifier_service.engine import DraftClient, Engine, EngineConfig
from verifier_service.expert_parallel import use_expert_group
from verifier_service.forward_batch import ForwardBatch
from verifier_service.kv_cache import KVPool
from verifier_service.model import KimiForCausalLM

log = logging.getLogger(__name__)
HEADER = 8  # int64 words per control message
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


class Op(enum.IntEnum):
    HELLO = 1  # [op, world, layers, kv slots, kv row dim, dtype code, routed experts]
    FORWARD = 2  # [op, T tokens, S sessions, block-table width, tree-mask words (0 = causal), page size]
    COMPACT = 3  # [op, moves]
    PING = 4  # [op]
    STOP = 5  # [op]


class GroupError(RuntimeError):
    """The torch.distributed group is broken (a rank died, hung or disagrees): restart the whole group."""


@dataclass(frozen=True)
class DistConfig:
    """One rank's place in the group; built from torchrun's environment by the CLI."""

    rank: int
    world_size: int
    local_rank: int = 0
    backend: str = "gloo"  # the data group: "nccl" on GPUs, "gloo" on CPU
    init_method: str = "env://"  # env:// = MASTER_ADDR/MASTER_PORT (torchrun); tests use file:// or tcp://
    timeout_s: float = 300.0  # a collective, or rank 0's silence, longer than this fails the group
    startup_timeout_s: float = 3 * 3600.0  # the startup handshake waits this long for the slowest rank to load

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"distributed: need 0 <= rank < world_size, got rank {self.rank} of {self.world_size}")
        if self.local_rank < 0:
            raise ValueError(f"distributed: local_rank must be >= 0, got {self.local_rank}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"distributed: backend must be gloo or nccl, got {self.backend!r}")
        if self.timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("distributed: timeouts must be positive")

    @property
    def ping_s(self) -> float:
        return min(30.0, self.timeout_s / 5)


@dataclass(frozen=True)
class Groups:
    cfg: DistConfig
    ctrl: dist.ProcessGroup  # gloo, host tensors: headers
    data: dist.ProcessGroup  # payloads and the MoE all-reduces


def init_groups(cfg: DistConfig) -> Groups:
    """Join the group (blocks until every rank has arrived) and make the control group."""
    if cfg.backend == "nccl":
        torch.cuda.set_device(cfg.local_rank)
    dist.init_process_group(cfg.backend, init_method=cfg.init_method, rank=cfg.rank, world_size=cfg.world_size,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.startup_timeout_s))
    log.info("rank %d of %d joined the verifier group (%s)", cfg.rank, cfg.world_size, cfg.backend)
    return Groups(cfg, ctrl, dist.group.WORLD)


def load_rank_target(groups: Groups, target_dir, dtype: torch.dtype, device: str | torch.device,
                     cfg=None) -> KimiForCausalLM:
    """This rank's target: replicated weights + its experts (only those are read), the MoE all-reduce over
    the data group. Every rank must then apply the same transforms (`make_batch_invariant` on CUDA): the
    replicated parts must compute the same bits everywhere, or the ranks would route tokens differently."""
    from verifier_service.checkpoint import load_target

    c = groups.cfg
    target = load_target(target_dir, dtype, device, cfg, ep_rank=c.rank, ep_size=c.world_size)
    use_expert_group(target, groups.data)
    return target


def _hello(kv: torch.Tensor, groups: Groups, n_experts: int) -> list[int]:
    L, slots, row = kv.shape
    return [Op.HELLO, groups.cfg.world_size, L, slots, row, DTYPE_CODES[kv.dtype], n_experts]


def _pack_forward(fb: ForwardBatch) -> tuple[list[int], torch.Tensor]:
    T, S = fb.num_tokens, fb.prefix_lens.shape[0]
    W = 0 if fb.tree_bits is None else fb.tree_bits.shape[1]
    parts = [fb.tokens, fb.positions, fb.write_slots, fb.cu_q, fb.prefix_lens, fb.block_table.reshape(-1)]
    if fb.tree_bits is not None:
        parts.append(fb.tree_bits.reshape(-1))
    return [Op.FORWARD, T, S, fb.block_table.shape[1], W, fb.page_size], torch.cat([p.long() for p in parts])


def _unpack_forward(h: list[int], payload: torch.Tensor) -> ForwardBatch:
    T, S, P, W, page = h[1:6]
    tok, pos, slots, cu, pre, bt, bits = payload.split([T, T, T, S + 1, S, S * P, T * W])
    return ForwardBatch(tokens=tok, positions=pos, write_slots=slots, cu_q=cu.int(), prefix_lens=pre.int(),
                        block_table=bt.view(S, P).int(), page_size=page, tree_bits=bits.view(T, W) if W else None)


def _payload_len(h: list[int]) -> int:
    if h[0] == Op.FORWARD:
        T, S, P, W = h[1:5]
        return 3 * T + 2 * S + 1 + S * P + T * W
    return 2 * h[1]  # COMPACT: src then dst


def _all_agree(ok: bool, groups: Groups, timeout_s: float) -> bool:
    """Every rank's `ok`, and-ed (a MIN all-reduce on the control group); blocks until all ranks answer."""
    t = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=groups.ctrl, async_op=True).wait(
        datetime.timedelta(seconds=timeout_s))
    return bool(t.item())


class Leader:
    """Rank 0's end: broadcasts each operation's header (control) and payload (data), pings when idle."""

    def __init__(self, groups: Groups, on_failure: Callable[[GroupError], None] | None = None):
        if groups.cfg.rank != 0:
            raise ValueError(f"the leader is rank 0, this is rank {groups.cfg.rank}")
        self.groups = groups
        self.on_failure = on_failure
        self.failed: GroupError | None = None
        self._lock = threading.Lock()  # control messages come from the engine thread and the pinger
        self._last = time.monotonic()
        self._closing = threading.Event()
        self._pinger: threading.Thread | None = None

    def start(self, kv: torch.Tensor, n_experts: int) -> None:
        """HELLO, then wait (up to the startup timeout: ranks load at their own pace) until every follower has
        loaded and checked its KV pool against it; then ping whenever idle."""
        c = self.groups.cfg
        self._send(_hello(kv, self.groups, n_experts), timeout_s=c.startup_timeout_s)
        try:
            agreed = _all_agree(True, self.groups, c.startup_timeout_s)
        except RuntimeError as e:
            self.fail(e)
            raise self.failed from e
        if not agreed:
            self.fail(RuntimeError("a follower's model or KV pool differs from rank 0's (see its log)"))
            raise self.failed
        self._pinger = threading.Thread(target=self._ping_loop, name="verifier-group-ping", daemon=True)
        self._pinger.start()

    def _send(self, header: list[int], payload: torch.Tensor | None = None, timeout_s: float | None = None) -> None:
        if self.failed is not None:
            raise self.failed
        h = torch.zeros(HEADER, dtype=torch.int64)
        h[: len(header)] = torch.tensor([int(v) for v in header])
        timeout = datetime.timedelta(seconds=timeout_s or self.groups.cfg.timeout_s)
        try:
            with self._lock:
                dist.broadcast(h, 0, group=self.groups.ctrl, async_op=True).wait(timeout)
                self._last = time.monotonic()
                if payload is not None:  # only the engine thread sends payloads: data order = control order
                    dist.broadcast(payload, 0, group=self.groups.data)
        except RuntimeError as e:  # DistBackendError (a peer closed), gloo's wait timeout
            self.fail(e)
        if self.failed is not None:
            raise self.failed

    def fail(self, e: BaseException) -> None:
        """Mark the group broken (once): later sends raise, `on_failure` is told."""
        if self.failed is not None:
            return
        self.failed = GroupError(f"rank 0: the verifier's torch.distributed group failed ({e}); a rank died or "
                                 "hung: the whole group must be restarted")
        log.error("%s", self.failed)
        if self.on_failure is not None:
            self.on_failure(self.failed)

    def _ping_loop(self) -> None:
        ping_s = self.groups.cfg.ping_s
        while not self._closing.wait(ping_s / 4):
            if time.monotonic() - self._last >= ping_s:
                try:
                    self._send([Op.PING])
                except GroupError:
                    return

    def forward(self, fb: ForwardBatch) -> None:
        header, payload = _pack_forward(fb)
        self._send(header, payload)

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._send([Op.COMPACT, src.numel()], torch.cat([src.reshape(-1), dst.reshape(-1)]).long())

    def stop(self) -> None:
        """STOP to the followers (they return from `run`); idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._pinger is not None:
            self._pinger.join()
        if self.failed is None:
            try:
                self._send([Op.STOP])
            except GroupError:
                pass


class LeaderEngine(Engine):
    """Rank 0's engine: an `Engine` whose target forward and KV moves are first sent to the followers."""

    def __init__(self, target: KimiForCausalLM, drafter: DraftClient | None, tap_layers: tuple[int, ...],
                 cfg: EngineConfig, leader: Leader, projection: ContextProjection | None = None):
        # every target forward must pass through `forward` below to reach the followers: no CUDA-graph
        # replays here (a graph would also have to hold the MoE's NCCL all-reduce)
        super().__init__(target, drafter, tap_layers, dataclasses.replace(cfg, cuda_graphs=False), projection)
        self.leader = leader
        leader.start(self.kv.kv, target.cfg.n_routed_experts)

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.leader.forward(fb)
        try:
            return super().forward(fb)
        except Exception as e:  # an MoE all-reduce failed (a peer is gone), or rank 0 stopped half-way while
            self.leader.fail(e)  # the followers run on: either way the ranks no longer agree
            raise self.leader.failed from e

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.leader.compact(src, dst)
        try:
            super().compact(src, dst)
        except Exception as e:  # the followers moved their rows: rank 0's KV no longer matches theirs
            self.leader.fail(e)
            raise self.leader.failed from e

    def close(self) -> None:
        self.leader.stop()


class Follower:
    """Ranks > 0: the same target (its own experts) and a KV pool of the leader's shape, replaying rank 0."""

    def __init__(self, target: KimiForCausalLM, cfg: EngineConfig, groups: Groups):
        if groups.cfg.rank == 0:
            raise ValueError("rank 0 leads; followers are ranks > 0")
        p = next(target.parameters())
        self.target, self.groups, self.device = target, groups, p.device
        tc = target.cfg
        self.kv = KVPool(tc.num_hidden_layers, tc.kv_row_dim, cfg.num_pages, cfg.page_size, cfg.max_sessions,
                         cfg.max_session_len, p.dtype, p.device).kv  # addresses come from rank 0: no bookkeeping
        self.ops = 0  # operations replayed (forwards + compactions)
        self._started = False

    def _recv(self, timeout_s: float) -> list[int]:
        h = torch.zeros(HEADER, dtype=torch.int64)
        try:
            dist.broadcast(h, 0, group=self.groups.ctrl, async_op=True).wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise GroupError(f"rank {self.groups.cfg.rank}: no word from rank 0 within {timeout_s:.0f} s or its "
                             f"connection broke ({e}); rank 0 died or hung: exiting") from e
        return h.tolist()

    def start(self) -> bool:
        """Wait for rank 0's HELLO (up to the startup timeout), check it against this rank, tell rank 0.
        False: rank 0 stopped before it started. Raises GroupError on a mismatch."""
        if self._started:
            return True
        c = self.groups.cfg
        want = _hello(self.kv, self.groups, self.target.cfg.n_routed_experts)
        got = self._recv(c.startup_timeout_s)
        if got[0] == Op.STOP:  # rank 0 stopped before it started serving
            return False
        same = got[: len(want)] == want
        try:
            _all_agree(same, self.groups, c.startup_timeout_s)  # rank 0 waits for every rank's answer
        except RuntimeError as e:
            raise GroupError(f"rank {c.rank}: the group broke during startup ({e})") from e
        if not same:
            raise GroupError(f"rank {c.rank}: rank 0 announced [op, world, layers, kv slots, row dim, dtype, "
                             f"experts] = {got[:len(want)]}, this rank has {want}: start every rank with the same "
                             "flags and checkpoint")
        log.info("rank %d following rank 0", c.rank)
        self._started = True
        return True

    @torch.no_grad()
    def run(self) -> int:
        """`start`, then replay rank 0's operations until STOP; returns the number replayed. Raises GroupError."""
        c = self.groups.cfg
        if not self.start():
            return self.ops
        while True:
            h = self._recv(c.timeout_s)
            op = h[0]
            if op == Op.STOP:
                log.info("rank %d: stop from rank 0 after %d operations", c.rank, self.ops)
                return self.ops
            if op == Op.PING:
                continue
            if op not in (Op.FORWARD, Op.COMPACT):
                raise GroupError(f"rank {c.rank}: unknown operation {op} from rank 0")
            try:
                payload = torch.empty(_payload_len(h), dtype=torch.int64, device=self.device)
                dist.broadcast(payload, 0, group=self.groups.data)
                if op == Op.FORWARD:
                    self.target(_unpack_forward(h, payload), self.kv, ())  # taps are rank 0's business
                else:
                    src, dst = payload.view(2, -1)
                    compact_kv(self.kv, src, dst)
            except RuntimeError as e:  # a peer closed or a collective timed out mid-operation
                raise GroupError(f"rank {c.rank}: replaying rank 0's {Op(op).name} failed ({e}): exiting") from e
            self.ops += 1
