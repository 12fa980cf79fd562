"""Test harness for the verifier <-> drafter stream: a grpc.aio drafter service on loopback in this process, the
stream client against it, and engine-like requests (used by test_transports.py, test_transports_gpu.py,
test_keepwarm.py, test_service_telemetry.py; the `parts` fixture lives in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import threading
import time

import grpc
import torch

from drafter_service.api import DraftRequest
from drafter_service.drafter import Drafter
from drafter_service.server import DrafterService
from kernels.tree_build import TreeBatch
from protos.ddtree.v1 import drafter_pb2_grpc
from verifier_service.transport import StreamClientConfig
from verifier_service.transport_stream import DraftStreamClient


class ServerThread:
    """A grpc.aio drafter server on its own event-loop thread."""

    def __init__(self, service: DrafterService, port: int = 0):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(service, port), self.loop).result(10)

    async def _start(self, service, port):
        self.server = grpc.aio.server()
        drafter_pb2_grpc.add_DrafterServicer_to_server(service, self.server)
        bound = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return bound

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)



class SlowOrBadDrafter(Drafter):
    delay = 0.0
    corrupt = "bad"

    def draft(self, requests):
        time.sleep(self.delay)
        trees = super().draft(requests)
        for j, r in enumerate(requests):
            if self.corrupt in r.session_id:
                trees.tokens[j, 1] = 10**6  # outside the vocabulary
        return trees


def make_service(parts, cls=Drafter):
    model, embed, head = parts
    service = DrafterService(max_sessions=8, window=64)
    service.attach(cls(model, embed, head, max_sessions=8, window=64), "tiny", embed.shape[1])
    return service



def client_for(port, colocated, **kw) -> DraftStreamClient:
    c = DraftStreamClient(StreamClientConfig(f"127.0.0.1:{port}", colocated=colocated, retry_max_s=0.2, **kw))
    c.start()
    c.wait_ready(timeout=20)
    return c


def as_older_drafter(service, monkeypatch, **announced) -> None:
    """Make `service` answer Info and `open` like a drafter without the features given False in `announced`."""
    info = service.info

    def older_info():
        i = info()
        for k, v in announced.items():
            setattr(i, k, v)
        return i

    monkeypatch.setattr(service, "info", older_info)


def feats(n, seed, F=128):
    return torch.randn(n, F, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def steps(sids=("a", "b")):
    """Engine-like requests over three steps: prompts, then 2 and 1 committed tokens."""
    out, pos = [], {s: 3 + 2 * i for i, s in enumerate(sids)}
    start = dict.fromkeys(sids, 0)
    for k, n_new in enumerate((None, 2, 1)):
        reqs = []
        for i, s in enumerate(sids):
            n = pos[s] if n_new is None else n_new
            reqs.append(DraftRequest(s, start[s], feats(n, seed=10 * k + i), 17 + i + k, start[s] + n, 16, 4))
            start[s] += n
        out.append(reqs)
    return out


def assert_same_trees(a: TreeBatch, b: TreeBatch, rows=None):
    rows = rows if rows is not None else range(len(a.n_nodes))
    for r in rows:
        assert a.n_nodes[r] == b.n_nodes[r]
        for f in TreeBatch._FIELDS:
            assert torch.equal(a.select(r)[f].cpu(), b.select(r)[f].cpu()), f


def root_only(tb: TreeBatch, r: int, root: int) -> bool:
    """Row r can only take an autoregressive step: its root, and any other node carries token -1 (a
    tree refused by the device checks), which no posterior token matches."""
    n = tb.n_nodes[r]
    return int(tb.tokens[r, 0]) == root and all(t == -1 for t in tb.tokens[r, 1:n].tolist())



def cuda_parts(parts, cls=Drafter):
    model, embed, head = copy.deepcopy(parts[0]).to("cuda"), parts[1].to("cuda"), parts[2].to("cuda")
    service = DrafterService(max_sessions=8, window=64)
    service.attach(cls(model, embed, head, max_sessions=8, window=64), "tiny", embed.shape[1])
    return service, Drafter(model, embed, head, max_sessions=8, window=64)


@contextlib.contextmanager
def one_process_landing(service):
    """A landing step and a drafter in one process (these tests; in service they are two processes): the landing's
    wait holds the stream it is queued on, so the client runs on a stream of its own, not the drafter's default
    one; and the drafter's graphs are captured first, as a served drafter does at start, since a capture in one
    thread fails on the other thread's allocations meanwhile."""
    service.drafter.warmup(16, 4)
    with torch.cuda.stream(torch.cuda.Stream()):
        yield


def cuda_steps():
    return [[dataclasses.replace(r, ctx_features=r.ctx_features.cuda()) for r in reqs] for reqs in steps()]

