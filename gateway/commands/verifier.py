"""`ddtree verifier serve`: the target model and its scheduler as a gRPC service (ddtree.v1.Verifier).

Under torchrun (WORLD_SIZE > 1 in the environment, with RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) every
rank runs this same command: the routed experts are split across the ranks (DESIGN 7); rank 0 serves
gRPC and metrics on the given addresses, ranks > 0 bind nothing and replay rank 0's forwards. On CUDA each
rank uses cuda:LOCAL_RANK and NCCL; on CPU, gloo.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

from gateway.commands.server_flags import add_server_flags, message_bytes, run_server


def add_parser(sub) -> None:
    from kernels.mla_attention import IMPLS
    from verifier_service.transport import IN_PLACE_MODES, TRANSPORTS

    p = sub.add_parser("verifier", help="the verifier service")
    verbs = p.add_subparsers(dest="verb", required=True)
    s = verbs.add_parser("serve", help="serve the target (sessions, streaming, continuous batching) over gRPC")
    s.add_argument("--target", required=True, help="target checkpoint folder")
    s.add_argument("--drafter-address", default=None, help="HOST:PORT (or unix:PATH) of `ddtree drafter serve`")
    s.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="how trees and context travel: inprocess (needs --drafter), colocated (shared memory / "
                        "CUDA IPC; default when the drafter address is on this host) or grpc (bytes)")
    s.add_argument("--drafter", default=None, help="drafter checkpoint folder, for --transport inprocess")
    s.add_argument("--context-projection", default=None, metavar="DIR",
                   help="grpc: the drafter's checkpoint folder; the verifier loads its context projection (fc, "
                        "hidden_norm: 0.6 GB at Kimi K2.6) and sends each committed token's projected row instead of "
                        "its taps (6x fewer bytes on the wire). A drafter whose weights differ is refused at start. "
                        "Colocated takes it too but gains nothing (its rows cross no wire; measured ~0.1 ms a step "
                        "slower at one session: the drafter then waits for the verifier's projection)")
    add_server_flags(s)
    s.add_argument("--max-sessions", type=int, default=64, help="sessions holding KV at once")
    s.add_argument("--kv-pages", type=int, default=2048, help="KV cache pages")
    s.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    s.add_argument("--max-session-len", type=int, default=8192, help="cache rows per session")
    s.add_argument("--draft-window", type=int, default=2048, help="drafter context rows kept per session")
    s.add_argument("--draft-timeout-s", type=float, default=5.0,
                   help="a draft step slower than this falls back to autoregressive and reconnects")
    s.add_argument("--dist-timeout-s", type=float, default=300.0,
                   help="under torchrun: a collective, or rank 0's silence, longer than this fails the group")
    s.add_argument("--no-cuda-graphs", action="store_true",
                   help="run verify forwards and the checks of co-located trees eagerly, and with --transport "
                        "inprocess draft steps too (default on CUDA: replayed from CUDA graphs)")
    s.add_argument("--no-doorbell", action="store_true",
                   help="co-located on a GPU: poll the drafter's CUDA IPC event on the host before each verify "
                        "step instead of queueing the step behind the drafter's doorbell on the GPU; gRPC on a "
                        "GPU: wait for the trees on the host before queueing the step instead of queueing it "
                        "behind a host doorbell that their arrival rings (default: the doorbells, where the GPU "
                        "passes their self-tests)")
    s.add_argument("--no-request-doorbell", action="store_true",
                   help="co-located on a GPU with the doorbell: the drafter polls our CUDA IPC event on its host "
                        "before it launches a draft queued ahead, instead of queueing that draft at once behind a "
                        "GPU wait on a counter of ours that our stream writes after the step's writes (default: the "
                        "request doorbell; 0.5 ms a step faster at C = 1 on an H100 at K2.6 shapes)")
    s.add_argument("--trees-in-place", choices=IN_PLACE_MODES, default="auto",
                   help="co-located with the doorbell: on = the drafter writes each step's trees where the verifier "
                        "laid them out, and the verify step is queued behind the doorbell as soon as the request is "
                        "sent; off = queued once the drafter's answer is read; auto (default) = in place while the "
                        "drafter's ring keeps arriving before its answer (a drafter whose GPU step is shorter than "
                        "the answer's way back), answered otherwise")
    s.add_argument("--keepwarm-ms", type=float, default=3.0,
                   help="gRPC transport: send the drafter a KeepWarm message shortly before each expected request "
                        "and answer, not sooner than this many ms into a silence and again every this many ms while "
                        "one overruns, so that both processes' gRPC threads are warm for it (a message after ~5 ms "
                        "of silence takes ~0.4 ms longer on loopback); 0: off")
    s.add_argument("--tree-inputs", choices=("auto", "torch"), default="auto",
                   help="the verify forward's tree inputs (token ids, positions, ancestor bits): auto (default) = one "
                        "Triton launch on CUDA (kernels.tree_inputs), the torch code elsewhere; torch = ~40 torch "
                        "launches a step (the same values)")
    s.add_argument("--tree-accept", choices=("auto", "torch"), default="auto",
                   help="the verify step's acceptance (the longest path the target agrees with): auto (default) = one "
                        "Triton launch on CUDA (kernels.tree_accept), the torch code elsewhere; torch = ~40 torch "
                        "launches a step (the same results)")
    s.add_argument("--commit-moves", choices=("auto", "torch"), default="auto",
                   help="the accepted paths' KV moves as physical slots: auto (default) = one Triton launch on CUDA "
                        "(kernels.kv_compact.commit_moves), the torch code elsewhere; torch = ~25 torch launches a "
                        "step (the same slots)")
    s.add_argument("--draft-ahead", choices=("on", "off"), default="on",
                   help="on (default): queue each next step's draft right after the step's acceptance, from its "
                        "values on the GPU, before the host reads the step (an in-process drafter, or a co-located one "
                        "over CUDA IPC or shared memory; over gRPC, or at mixed budgets, the next step's usual "
                        "requests go right after the host read instead): the drafter's work starts without the host "
                        "round trip (1-12%% a step on an H100 at K2.6 shapes; a small host-bound pair such as "
                        "kimi-mini loses: measure off there); the same output; a session joining the batch costs one "
                        "wasted draft. off: every step asks the drafter after the host read")
    s.add_argument("--ahead-gpu-wait", choices=("on", "off"), default="on",
                   help="with --draft-ahead on and a co-located drafter on the GPU: on (default) = each step's stream "
                        "waits on the GPU for the draft queued ahead before the step's first GPU work, so none of it "
                        "takes a time slice from the drafter's context mid-draft (~3%% a step on an H100 at K2.6 "
                        "shapes); off = the step's preparation is queued as soon as the host reaches it")
    s.add_argument("--mla-kernel", choices=IMPLS, default="auto",
                   help="MLA attention tile kernel: gluon_seesaw (sm_90 with Kimi head shapes, two warpgroups "
                        "on pairs of tiles; refused at start elsewhere), gluon (the same shapes, one warpgroup), "
                        "gluon_ws (the same, warp-specialized; experimental, slower so far), triton (any GPU), auto "
                        "(gluon_seesaw where it runs, else triton; the default). They give different bits: every "
                        "rank and every restart of a deployment should use the same")
    s.set_defaults(func=run)


def dist_from_env(env, device: str | None, timeout_s: float):
    """(DistConfig or None, device) from torchrun's environment; WORLD_SIZE unset or 1 = one process."""
    from verifier_service.distributed import DistConfig
    from verifier_service.local import default_device

    world = int(env.get("WORLD_SIZE") or 1)
    if world <= 1:
        return None, device
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ValueError(f"WORLD_SIZE={world} but {', '.join(missing)} unset: start the ranks with torchrun")
    rank, local = int(env["RANK"]), int(env["LOCAL_RANK"])
    device = device or default_device()
    backend = "gloo"
    if device.startswith("cuda"):
        if device != "cuda":
            raise ValueError(f"--device {device}: under torchrun pass --device cuda (rank r uses cuda:LOCAL_RANK)")
        device, backend = f"cuda:{local}", "nccl"
    return DistConfig(rank, world, local, backend, "env://", timeout_s), device


def run(args) -> int:
    from verifier_service.server import VerifierServerConfig, follow, serve
    from verifier_service.transport import resolve_transport

    transport = resolve_transport(args.transport, args.drafter_address, args.drafter)
    dist, device = dist_from_env(os.environ, args.device, args.dist_timeout_s)
    cfg = VerifierServerConfig(
        listen=args.listen, target_dir=args.target, transport=transport, drafter_address=args.drafter_address,
        drafter_dir=args.drafter, device=device, dtype=args.dtype, max_sessions=args.max_sessions,
        kv_pages=args.kv_pages, page_size=args.page_size, max_session_len=args.max_session_len,
        draft_window=args.draft_window, draft_timeout_s=args.draft_timeout_s, control_spin_ms=args.control_spin_ms,
        torch_trace=args.torch_trace,
        max_message_bytes=message_bytes(args), grace_s=args.grace_s, metrics_listen=args.metrics_listen, dist=dist,
        cuda_graphs=False if args.no_cuda_graphs else None, mla_kernel=args.mla_kernel, doorbell=not args.no_doorbell,
        request_doorbell=not args.no_request_doorbell,
        trees_in_place=args.trees_in_place, context_projection_dir=args.context_projection,
        keepwarm_ms=args.keepwarm_ms, tree_inputs=args.tree_inputs, tree_accept=args.tree_accept,
        commit_moves=args.commit_moves, draft_ahead=args.draft_ahead == "on",
        ahead_gpu_wait=args.ahead_gpu_wait == "on")
    if dist is None:
        return run_server(serve, cfg, args.log_level, "ddtree-verifier", args.gil_switch_us)
    try:
        if dist.rank > 0:  # binds no port: rank 0 serves for the group
            from gateway.commands.gil_switch import set_gil_switch
            from protos.serving import setup_logging

            set_gil_switch(args.gil_switch_us)
            setup_logging(args.log_level)
            code = follow(cfg)
        else:
            code = run_server(serve, cfg, args.log_level, "ddtree-verifier", args.gil_switch_us)
    except (ValueError, FileNotFoundError) as e:
        print(f"ddtree verifier: error: {e}", file=sys.stderr)
        code = 2
    except Exception:  # noqa: BLE001 - printed, then the rank exits like any other
        traceback.print_exc()
        code = 1
    exit_rank(code)


def exit_rank(code: int) -> NoReturn:
    """End a torch.distributed rank without interpreter finalization. Gloo's worker threads can destroy the
    last collective's tensors while the interpreter shuts down, which aborts the process (SIGABRT) after a
    clean run, and tearing down a broken NCCL group can block: flush what we own, then leave."""
    import logging

    from opentelemetry import trace

    shutdown = getattr(trace.get_tracer_provider(), "shutdown", None)
    if shutdown is not None:
        shutdown()  # export the spans still batched (atexit handlers do not run after os._exit)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
