"""bench/bench_transport.py reads the drafter process's graph-run counts from a real metrics endpoint."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry

from bench.transport_lineup import graph_runs
from telemetry.metrics import Metrics, start_metrics_server


def test_graph_runs_scrapes_the_drafter_metrics_endpoint():
    m = Metrics(CollectorRegistry())
    stats = collections.Counter(replays=41, captures=2, context_replays=7)
    m.watch_draft_graphs(lambda: stats)
    server = start_metrics_server("127.0.0.1", 0, m.registry)
    try:
        addr = f"127.0.0.1:{server.port}"
        assert graph_runs(addr) == {"replays": 41, "captures": 2, "context_replays": 7}
        stats["eager"] += 3
        assert graph_runs(addr)["eager"] == 3
    finally:
        server.close()
    assert graph_runs(None) == {}
