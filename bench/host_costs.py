"""Host time of the pieces of a remote draft step, one by one in a hot loop on an idle GPU (median us).

    PYTHONPATH=. python bench/host_costs.py [--rows 1 32] [--nodes 17]      # needs a CUDA GPU; ~30 s

What it is for: telling which per-step host operations are expensive before changing them (a run on the
H200 host: `bench/results/host_costs_h200.log`). Inside a real step the same calls cost 2-5x more (a GPU
with queued work, cold caches; compare `bench/results/transport_host_timers*.log`), so only the ratios
between them carry over. Prints one line per operation; writes nothing else.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter_service.api import DraftRequest  # noqa: E402
from drafter_service.device_copy import int64_to_device  # noqa: E402
from kernels.graph_capture import GraphCapture  # noqa: E402
from kernels.tree_build import TreeBatch  # noqa: E402
from kernels.tree_check import check_packed, check_trees  # noqa: E402
from protos.codec import DTYPE_TO_PB, draft_request_to_pb, inline_trees, trees_from_pb, trees_to_pb  # noqa: E402
from protos.ddtree.v1 import drafter_pb2  # noqa: E402
from protos.doorbell import HostBell  # noqa: E402
from protos.shared_region import IpcEvent, RegionArena, SharedRegion  # noqa: E402
from verifier_service.tree_landing import TreeLandings  # noqa: E402


def timed(name: str, fn: Callable[[], object], n: int = 400) -> None:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"{name:50s} {statistics.median(ts) * 1e6:8.1f} us", flush=True)


def root_only_trees(R: int, M: int, dev: torch.device) -> TreeBatch:
    i32 = torch.int32
    f = [torch.full((R, M), -1, dtype=i32, device=dev) for _ in range(5)]
    logw = torch.full((R, M), float("-inf"), device=dev)
    f[0][:, 0], f[2][:, 0], logw[:, 0] = 5, 0, 0.0
    return TreeBatch(*f, logw, [1] * R)


def rows(R: int, M: int, dev: torch.device) -> None:
    print(f"--- R={R} M={M}")
    trees = root_only_trees(R, M, dev)
    packed = trees.pack().contiguous()
    counts = int64_to_device([[1] * R, [5] * R], dev)
    fields = [getattr(trees, f) for f in TreeBatch._FIELDS]
    timed("check_trees (six arrays: stack + launch)", lambda: check_trees(*fields, counts[0], counts[1], 1000, 16))
    timed("check_packed (one buffer: launch)", lambda: check_packed(packed, counts[0], counts[1], 1000, 16))
    graph, _ = GraphCapture(dev).capture(lambda: check_packed(packed, counts[0], counts[1], 1000, 16))
    timed("check_packed replayed from a CUDA graph", graph.replay)
    timed("int64_to_device [2, R]", lambda: int64_to_device([[1] * R, [5] * R], dev))
    timed("torch.empty (one small op)", lambda: torch.empty(R * (3 * M + 1), dtype=torch.int32, device=dev))
    region = SharedRegion.create(2, 1 << 20, dev)
    ids = [f"s{i}" for i in range(R)]
    graphed = TreeBatch.from_packed(packed, trees.n_nodes)
    timed("trees_to_pb into a region (six arrays)", lambda: trees_to_pb(trees, ids, 1, RegionArena(region)))
    timed("trees_to_pb into a region (packed)", lambda: trees_to_pb(graphed, ids, 1, RegionArena(region)))
    msg = trees_to_pb(graphed, ids, 1, RegionArena(region))
    timed("trees_from_pb from a region (copy)", lambda: trees_from_pb(msg, {2: region}))
    timed("trees_from_pb from a region (view)", lambda: trees_from_pb(msg, {2: region}, copy=False))
    wire = drafter_pb2.DraftStreamResponse(trees=msg).SerializeToString()
    timed("DraftStreamResponse parse", lambda: drafter_pb2.DraftStreamResponse.FromString(wire))
    # the gRPC answer's two ends: the drafter's bytes from its pinned host copy, the verifier's landing of them
    pinned = TreeBatch.from_packed(packed.cpu().pin_memory(), trees.n_nodes)
    timed("trees_to_pb as bytes (a pinned block), into the response",
          lambda: trees_to_pb(pinned, ids, 1, out=drafter_pb2.DraftStreamResponse().trees))
    answer = drafter_pb2.DraftStreamResponse.FromString(
        drafter_pb2.DraftStreamResponse(trees=trees_to_pb(pinned, ids, 1)).SerializeToString())
    timed("inline_trees (the bytes answer, numpy)", lambda: inline_trees(answer.trees))
    landings = TreeLandings(dev)
    bell = HostBell(dev)
    caps, roots = list(trees.n_nodes), [5] * R

    def land() -> None:  # the landing of one step: laid out and queued by the engine, delivered by the reader
        landing = landings.prepare(1, ids, roots, caps, bell, 1)
        landing.queue(torch.cuda.current_stream(dev))
        t0 = time.perf_counter()
        landing.deliver(answer.trees)
        delivered.append(time.perf_counter() - t0)

    delivered: list[float] = []
    timed("TreeLandings.prepare + Landing.queue + Landing.deliver", land, n=100)
    print(f"{'  of which Landing.deliver':50s} {statistics.median(delivered) * 1e6:8.1f} us", flush=True)
    feats = torch.randn(4, 768, device=dev, dtype=torch.bfloat16)
    req_region = SharedRegion.create(1, 1 << 22, dev)

    def per_session() -> bytes:  # one ctx_features tensor per session (drafters without step_features)
        arena = RegionArena(req_region)
        step = drafter_pb2.DraftStep(step_id=1)
        step.sessions.extend(draft_request_to_pb(DraftRequest(f"s{i}", 10, feats, 5, 14, 16, 8), where=w)
                             for i, w in enumerate(arena.place_many([feats] * R)))
        return drafter_pb2.DraftStreamRequest(step=step).SerializeToString()

    def step_rows() -> bytes:  # every session's rows as one tensor (DraftStep.ctx_features)
        arena = RegionArena(req_region)
        step = drafter_pb2.DraftStep(step_id=1)
        start = arena.place_rows([feats] * R)
        m = step.ctx_features
        m.dtype, m.region.region_id, m.region.offset = DTYPE_TO_PB[feats.dtype], 1, start
        m.shape.extend([4 * R, feats.shape[1]])
        step.sessions.extend(drafter_pb2.SessionDraftRequest(session_id=f"s{i}", ctx_start=10, root_token=5,
                                                             root_pos=14, budget=16, topk=8, ctx_rows=4)
                             for i in range(R))
        return drafter_pb2.DraftStreamRequest(step=step).SerializeToString()

    timed("request encode, a tensor per session", per_session)
    timed("request encode, one tensor per step", step_rows)
    region.close()
    req_region.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="trees (sessions) per step")
    p.add_argument("--nodes", type=int, default=17, help="nodes per tree (budget 16 + root)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("host_costs: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    for R in args.rows:
        rows(R, args.nodes, dev)
    event, plain = IpcEvent.create(dev), torch.cuda.Event()
    timed("IpcEvent.record (interprocess event)", event.record)
    timed("torch.cuda.Event.record (plain event)", plain.record)
    timed("event.query (completed)", event.event.query)
    timed("torch.cuda.synchronize (idle)", torch.cuda.synchronize)
    x = torch.zeros(8, device=dev)
    timed("a tiny torch op (add_)", lambda: x.add_(1))
    print(f"python {sys.version.split()[0]} torch {torch.__version__} {torch.cuda.get_device_name(dev)}")
    event.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
