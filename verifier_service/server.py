"""The verifier as a gRPC service (`ddtree.v1.Verifier`): the session API the gateway uses.

Startup: the server listens at once (health NOT_SERVING), loads the target, connects to the
drafter (waiting for it while NOT_SERVING: the drafter decides which target layers to tap),
builds the engine, runs one warm-up step through the chosen transport, starts the scheduler's
engine thread and only then reports SERVING. Generate streams one message per verify step; its
cancellation or deadline releases the session on both services (`Scheduler.cancel`). SIGTERM
drains: NOT_SERVING, new calls refused, running turns get the grace period to finish.

Observability (DESIGN 6): every RPC runs in a SERVER span continuing the caller's W3C context
(`telemetry.grpc_tracing`); Generate puts the GenAI attributes on it and hands its context to the
scheduler, whose `TurnTelemetry` records the queue, prefill, per-step and transport spans. Metrics
go to the process registry, served on `--metrics-listen`: requests by final status, TTFT and
inter-token latency as this service streams, prompt and generated tokens here; the step loop's
families in `TurnTelemetry`; drafter fallbacks in the stream client.

Expert parallel (`cfg.dist`, DESIGN 7, `verifier_service.distributed`): rank 0 runs `serve` with a
`LeaderEngine` (and alone binds the gRPC and metrics ports); ranks > 0 run `follow`, which loads the
rank's experts and replays rank 0's forwards until rank 0 stops or the group breaks.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from opentelemetry import trace

from kernels import mla_attention
from protos.ddtree.v1 import verifier_pb2, verifier_pb2_grpc
from protos.serving import GrpcServer
from protos.verifier_codec import event_to_pb, params_from_pb
from telemetry import tracing
from telemetry.grpc_tracing import TracingServerInterceptor
from telemetry.metrics import STATUSES, Metrics, parse_hostport, process_metrics
from telemetry.torch_trace import StepTrace, parse_spec
from verifier_service.distributed import DistConfig
from verifier_service.engine import Engine, EngineConfig
from verifier_service.scheduler import Scheduler, TurnError
from verifier_service.session import MAX_BUDGET, DecodeParams
from verifier_service.transport import TRANSPORTS, check_drafter_pair
from verifier_service.turn_telemetry import TurnTelemetry

log = logging.getLogger(__name__)
SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
SESSION_ID = re.compile(r"^[A-Za-z0-9._:@/-]{1,128}$")
WARMUP_SID = "__warm-up__"


@dataclass(frozen=True)
class VerifierServerConfig:
    listen: str
    target_dir: str
    transport: str
    drafter_address: str | None = None  # colocated / grpc
    drafter_dir: str | None = None  # inprocess
    device: str | None = None
    dtype: str | None = None
    max_sessions: int = 64
    kv_pages: int = 2048
    page_size: int = 16
    max_session_len: int = 8192
    draft_window: int = 2048
    draft_timeout_s: float = 5.0
    control_spin_ms: float = 0.0  # co-located: poll the control socket this long for the drafter's answer
    max_message_bytes: int = 64 << 20
    grace_s: float = 30.0
    metrics_listen: str | None = None  # HOST:PORT of the Prometheus endpoint; None = not served
    dist: DistConfig | None = None  # this rank's place in an expert-parallel group; None = one process
    cuda_graphs: bool | None = None  # verify forwards and tree checks through CUDA graphs; None = on for CUDA
    mla_kernel: str = "auto"  # MLA tile kernel (`kernels.mla_attention.IMPLS`): auto = gluon_seesaw where it runs
    tree_inputs: str = "auto"  # the forward's tree inputs: EngineConfig.tree_inputs (auto = one Triton launch on CUDA)
    tree_accept: str = "auto"  # the step's acceptance: EngineConfig.tree_accept (auto = one Triton launch on CUDA)
    commit_moves: str = "auto"  # the step's KV moves: EngineConfig.commit_moves (auto = one Triton launch on CUDA)
    draft_ahead: bool = True  # EngineConfig.draft_ahead: the next step's draft queued before the host read
    ahead_gpu_wait: bool = True  # EngineConfig.ahead_gpu_wait: co-located, the step's stream waits for the ahead draft
    doorbell: bool = True  # on a GPU: queue the verify step behind a doorbell (StreamClientConfig.doorbell)
    request_doorbell: bool = True  # co-located: ahead steps ring a counter the drafter waits on (StreamClientConfig)
    trees_in_place: str = "auto"  # co-located with the doorbell: StreamClientConfig.trees_in_place (auto, on, off)
    keepwarm_ms: float = 3.0  # gRPC stream: the KeepWarm period (StreamClientConfig.keepwarm_ms; 0: none)
    torch_trace: str | None = None  # DIR[:FIRST[:COUNT]]: steps profiled by torch.profiler (telemetry.torch_trace)
    # colocated / grpc: the drafter's checkpoint folder whose context projection (fc, hidden_norm) the engine applies
    # before sending context rows (6x fewer bytes per token at K2.6; drafter_service.context_projection); None: taps
    context_projection_dir: str | None = None

    def __post_init__(self):
        if self.metrics_listen is not None:
            parse_hostport(self.metrics_listen)  # ValueError naming the expected form
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.mla_kernel not in mla_attention.IMPLS:
            raise ValueError(f"mla_kernel must be one of {mla_attention.IMPLS}, got {self.mla_kernel!r}")
        if (self.transport == "inprocess") != (self.drafter_dir is not None and self.drafter_address is None):
            raise ValueError("inprocess takes a drafter folder; colocated and grpc take a drafter address")
        if self.transport == "inprocess" and self.context_projection_dir is not None:
            raise ValueError("a context projection folder is for colocated and grpc: inprocess projects with its "
                             "own drafter")
        for f in ("max_sessions", "kv_pages", "page_size", "max_session_len", "draft_window", "draft_timeout_s",
                  "max_message_bytes"):
            if getattr(self, f) <= 0:
                raise ValueError(f"verifier server: {f} must be positive, got {getattr(self, f)}")
        if self.control_spin_ms < 0:
            raise ValueError(f"verifier server: control_spin_ms must be >= 0, got {self.control_spin_ms}")
        if not 0 <= self.keepwarm_ms <= 1000:
            raise ValueError(f"verifier server: keepwarm_ms must be in [0, 1000] (0: off), got {self.keepwarm_ms}")
        if self.grace_s < 0:
            raise ValueError(f"verifier server: grace period must be >= 0, got {self.grace_s}")
        if self.torch_trace is not None:
            parse_spec(self.torch_trace)  # ValueError naming the expected form


@dataclass
class Loaded:
    """What the servicer needs once loading is done."""

    scheduler: Scheduler
    engine: Engine
    model: str
    eos_ids: tuple[int, ...]
    block_size: int
    client: object | None  # DraftStreamClient for colocated / grpc
    mla_kernel: str  # what the target's attention runs: gluon, triton or reference


class VerifierService(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, cfg: VerifierServerConfig, metrics: Metrics | None = None):
        self.cfg = cfg
        self.metrics = metrics if metrics is not None else process_metrics()
        self.loaded: Loaded | None = None
        self.draining = False

    async def _ready(self, context, new_work: bool = True) -> Loaded:
        if self.loaded is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading; watch grpc.health.v1")
        if self.draining and new_work:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is shutting down; use another replica")
        return self.loaded

    async def Generate(self, request: verifier_pb2.GenerateRequest, context):
        """`_generate` with the request's metrics and the GenAI attributes of its server span."""
        m = self.metrics
        timer = m.token_timer()
        span = trace.get_current_span()  # the interceptor's SERVER span
        if span.is_recording():
            span.set_attributes({tracing.GEN_AI_OPERATION_NAME: "text_completion",
                                 tracing.GEN_AI_CONVERSATION_ID: request.session_id,
                                 tracing.GEN_AI_USAGE_INPUT_TOKENS: len(request.tokens),
                                 **({tracing.GEN_AI_REQUEST_MODEL: self.loaded.model} if self.loaded else {})})
        status, generated, finish = "unknown", 0, None
        try:
            async for msg in self._generate(request, context):
                if msg.stats.prefill_tokens:
                    m.prompt_tokens.inc(msg.stats.prefill_tokens)
                timer.tokens(len(msg.tokens))
                generated += len(msg.tokens)
                if msg.HasField("finish_reason"):
                    status = "ok"
                    finish = verifier_pb2.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
                yield msg
        except grpc.aio.AbortError:
            status = _status_name(context)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if status != "ok":
                remaining = context.time_remaining()
                status = "deadline_exceeded" if remaining is not None and remaining <= 0 else "cancelled"
            raise
        finally:
            m.record_request(status)
            if span.is_recording():
                tracing.set_usage(span, output_tokens=generated, finish_reason=finish)

    async def _generate(self, request: verifier_pb2.GenerateRequest, context):
        ld = await self._ready(context)
        sid = request.session_id
        if not SESSION_ID.match(sid):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"session_id {sid!r} must be 1..128 characters out of [A-Za-z0-9._:@/-]")
        if request.continue_session and request.persistent:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "persistent applies when opening a session; a continued session stays persistent")
        try:
            params = params_from_pb(request.params, ld.eos_ids)
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"params: {e}")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(ev) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(events.put_nowait, ev)

        tokens = list(request.tokens)
        span = trace.get_current_span()
        ctx = trace.set_span_in_context(span) if span.is_recording() else None  # spans only for traced turns
        if request.continue_session:
            turn = ld.scheduler.continue_turn(sid, tokens, params, sink, trace=ctx)
        else:
            turn = ld.scheduler.open(sid, tokens, params, request.persistent, sink, trace=ctx)
        ended = False
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, TurnError):
                    ended = True
                    await context.abort(grpc.StatusCode[ev.code], ev.message)
                yield event_to_pb(ev)
                if ev.finish_reason is not None:
                    ended = True
                    return
        finally:
            if not ended:  # cancelled by the client, its deadline, or the drain's grace period
                ld.scheduler.cancel(turn)

    async def Release(self, request: verifier_pb2.ReleaseRequest, context):
        ld = await self._ready(context, new_work=False)  # releasing is allowed while draining
        try:
            cancelled = await asyncio.wrap_future(ld.scheduler.release(request.session_id))
        except TurnError as e:
            await context.abort(grpc.StatusCode[e.code], e.message)
        return verifier_pb2.ReleaseResponse(cancelled_running_turn=cancelled)

    async def Info(self, request, context):
        ld = self.loaded
        cfg = self.cfg
        msg = verifier_pb2.VerifierInfo(max_budget=MAX_BUDGET, page_size=cfg.page_size, kv_pages_total=cfg.kv_pages,
                                        max_sessions=cfg.max_sessions, transport=cfg.transport,
                                        drafter_address=cfg.drafter_address or "")
        if ld is None:
            return msg
        snap, eng = ld.scheduler.snapshot, ld.engine
        msg.model, msg.vocab_size, msg.eos_token_ids[:] = ld.model, eng.target.cfg.vocab_size, list(ld.eos_ids)
        msg.block_size, msg.max_session_len = ld.block_size, eng.kv.max_session_len
        msg.kv_pages_free, msg.open_sessions, msg.running_sessions = (snap.kv_pages_free, snap.open_sessions,
                                                                      snap.running_sessions)
        msg.drafter_connected = ld.client.connected if ld.client is not None else eng.drafter is not None
        msg.device, msg.dtype = str(eng.device), str(eng.dtype).removeprefix("torch.")
        msg.mla_kernel = ld.mla_kernel
        return msg


def _status_name(context) -> str:
    """The status an aborted call ends with, as a `ddtree_requests` label."""
    code = context.code()
    if not isinstance(code, grpc.StatusCode):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    name = code.name.lower()
    return name if name in STATUSES else "unknown"


# --- loading -----------------------------------------------------------------------------------------
def _device_dtype(cfg: VerifierServerConfig) -> tuple[str, torch.dtype]:
    from verifier_service.local import DTYPES, default_device

    device = cfg.device or default_device()
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    return device, DTYPES[cfg.dtype] if cfg.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)


def _engine_config(cfg: VerifierServerConfig, device: str) -> EngineConfig:
    graphs = cfg.cuda_graphs if cfg.cuda_graphs is not None else device.startswith("cuda")  # LeaderEngine: off
    return EngineConfig(page_size=cfg.page_size, num_pages=cfg.kv_pages, max_sessions=cfg.max_sessions,
                        max_session_len=cfg.max_session_len, draft_window=cfg.draft_window, cuda_graphs=graphs,
                        tree_inputs=cfg.tree_inputs, tree_accept=cfg.tree_accept, commit_moves=cfg.commit_moves,
                        draft_ahead=cfg.draft_ahead, ahead_gpu_wait=cfg.ahead_gpu_wait)


def _configure_mla(cfg: VerifierServerConfig, tcfg, device: str, dtype: torch.dtype) -> str:
    """Fix the MLA tile kernel before any forward (every rank of a group the same: the replicated
    attention must agree bit for bit); ValueError at start for a kernel that cannot run here."""
    kernel = mla_attention.configure(cfg.mla_kernel, device, tcfg.num_attention_heads, tcfg.kv_lora_rank,
                                     tcfg.qk_rope_head_dim, dtype, cfg.page_size)
    log.info("MLA attention: %s kernel (--mla-kernel %s)", kernel, cfg.mla_kernel)
    return kernel


def build_engine(cfg: VerifierServerConfig, stop: threading.Event, metrics: Metrics | None = None,
                 on_group_failure=None) -> Loaded:
    """Load the target, wire the drafter through the configured transport, warm up; blocking.
    With `cfg.dist` (rank 0): join the group first, load rank 0's experts, lead the followers."""
    from drafter_service.context_projection import ContextProjection
    from verifier_service.batch_invariant import make_batch_invariant
    from verifier_service.checkpoint import load_target
    from verifier_service.config import KimiConfig
    from verifier_service.distributed import Leader, LeaderEngine, init_groups, load_rank_target
    from verifier_service.local import build_local_engine
    from verifier_service.transport import StreamClientConfig
    from verifier_service.transport_stream import DraftStreamClient

    device, dtype = _device_dtype(cfg)
    ecfg = _engine_config(cfg, device)
    tcfg = KimiConfig.from_file(cfg.target_dir)
    mla_kernel = _configure_mla(cfg, tcfg, device, dtype)
    leader = None
    if cfg.dist is not None:
        leader = Leader(init_groups(cfg.dist), on_failure=on_group_failure)
    client = None
    if cfg.transport == "inprocess":
        engine = build_local_engine(cfg.target_dir, cfg.drafter_dir, dtype, device, ecfg, leader=leader)
        block = engine.drafter.cfg.block_size
    else:
        projection = None
        if cfg.context_projection_dir is not None:
            projection = ContextProjection.load(cfg.context_projection_dir, dtype, device)
            log.info("context projection from %s (%s...): projected rows to the drafter", cfg.context_projection_dir,
                     projection.fingerprint[:16])
        client = DraftStreamClient(StreamClientConfig(
            cfg.drafter_address, colocated=cfg.transport == "colocated", region_device=device,
            draft_timeout_s=cfg.draft_timeout_s, max_message_bytes=cfg.max_message_bytes, window=cfg.draft_window,
            control_spin_s=cfg.control_spin_ms / 1e3, check_graphs=cfg.cuda_graphs is not False, doorbell=cfg.doorbell,
            request_doorbell=cfg.request_doorbell,
            trees_in_place=cfg.trees_in_place, keepwarm_ms=cfg.keepwarm_ms, client_id=f"verifier@{cfg.listen}",
            context_projection=projection.fingerprint if projection is not None else ""), metrics=metrics)
        client.start()  # connects in the background while the target loads
        try:
            if leader is None:
                target = load_target(cfg.target_dir, dtype, device, tcfg)
            else:
                target = load_rank_target(leader.groups, cfg.target_dir, dtype, device, tcfg)
            if device.startswith("cuda") and dtype != torch.float64:
                make_batch_invariant(target)  # as build_local_engine does: greedy DDTree == AR
            log.info("target loaded; waiting for the drafter at %s", cfg.drafter_address)
            model = client.wait_ready(stop)
            check_drafter_pair(model, tcfg)
        except BaseException:
            client.close()
            raise
        if leader is None:
            engine = Engine(target, client, model.target_layer_ids, ecfg, projection)
        else:
            engine = LeaderEngine(target, client, model.target_layer_ids, ecfg, leader, projection)
        block = model.block_size
    # warm-up: one drafted step through the transport, then give everything back
    engine.add([0, 1, 2], DecodeParams(max_new_tokens=2, budget=4, topk=2), sid=WARMUP_SID)
    engine.run_until_done()
    engine.release(WARMUP_SID)
    scheduler = Scheduler(engine, client.take_errors if client is not None else None,
                          TurnTelemetry(metrics, transport=cfg.transport),
                          step_trace=StepTrace.from_spec(cfg.torch_trace, "verifier"))
    scheduler.start()
    return Loaded(scheduler, engine, Path(cfg.target_dir).name, tcfg.eos_ids, block, client, mla_kernel)


async def serve(cfg: VerifierServerConfig) -> int:
    """The service (rank 0 of an expert-parallel group: the only rank that binds ports) until SIGTERM;
    returns 1 when the expert-parallel group broke."""
    if cfg.dist is not None and cfg.dist.rank != 0:
        raise ValueError(f"serve runs on rank 0; rank {cfg.dist.rank} runs `follow`")
    service = VerifierService(cfg)
    server = GrpcServer(cfg.listen, [SERVICE_NAME], cfg.max_message_bytes, cfg.grace_s,
                        interceptors=[TracingServerInterceptor()], metrics_listen=cfg.metrics_listen)
    verifier_pb2_grpc.add_VerifierServicer_to_server(service, server.server)
    await server.start()
    stop_loading = threading.Event()
    loop = asyncio.get_running_loop()
    group_failed = asyncio.Event()  # set from the engine thread when a rank of the group is lost

    def on_group_failure(_e) -> None:
        loop.call_soon_threadsafe(group_failed.set)

    loading = asyncio.ensure_future(asyncio.to_thread(build_engine, cfg, stop_loading, service.metrics,
                                                      on_group_failure))
    stop = asyncio.ensure_future(server.stop_requested.wait())
    await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        stop_loading.set()  # interrupts the wait for the drafter; weight loading itself runs to its end
        await server.drain()
        return 0
    if loading.exception() is not None:
        log.error("the verifier failed to start: %s", loading.exception())
        await server.drain()
        raise loading.exception()
    service.loaded = loading.result()
    await server.set_serving()
    log.info("verifier serving on %s (transport %s%s)", server.address, cfg.transport,
             f", rank 0 of {cfg.dist.world_size}" if cfg.dist else "")
    failed = asyncio.ensure_future(group_failed.wait())
    await asyncio.wait({stop, failed}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if failed.done():
        log.error("the expert-parallel group broke; stopping so that the launcher restarts every rank")
        code = 1
    failed.cancel()
    service.draining = True
    await server.drain()
    ld = service.loaded
    ld.scheduler.close()
    if ld.client is not None:
        ld.client.close()
    if cfg.dist is not None:
        ld.engine.close()  # STOP to the followers
        if not code:
            _leave_group()  # a broken group is left to process exit (destroying it could block on NCCL)
    return code


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def follow(cfg: VerifierServerConfig) -> int:
    """Ranks > 0: join the group, load this rank's experts, replay rank 0's forwards until it stops.
    Binds no port. SIGTERM/SIGINT are logged and otherwise ignored: rank 0 drains its streams (which need
    every rank) and then stops the followers. Returns 1 when rank 0 is lost."""
    import signal

    from verifier_service.batch_invariant import make_batch_invariant
    from verifier_service.config import KimiConfig
    from verifier_service.distributed import Follower, GroupError, init_groups, load_rank_target

    if cfg.dist is None or cfg.dist.rank == 0:
        raise ValueError("follow runs on ranks > 0 of an expert-parallel group")
    rank = cfg.dist.rank
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda n, _f: log.info("rank %d: %s; waiting for rank 0 to drain and stop the group",
                                                  rank, signal.Signals(n).name))
    device, dtype = _device_dtype(cfg)
    _configure_mla(cfg, KimiConfig.from_file(cfg.target_dir), device, dtype)
    groups = init_groups(cfg.dist)
    try:
        target = load_rank_target(groups, cfg.target_dir, dtype, device)
        if device.startswith("cuda") and dtype != torch.float64:
            make_batch_invariant(target)  # exactly what rank 0 runs: the replicated parts must agree bit for bit
        Follower(target, _engine_config(cfg, device), groups).run()
    except GroupError as e:
        log.error("%s", e)
        return 1  # a broken group is left to process exit (destroying it could block on NCCL)
    _leave_group()
    return 0
