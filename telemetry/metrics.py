"""Prometheus metrics of one DDTree process (gateway, verifier or drafter), all named `ddtree_*`.

Every service holds one `Metrics` (from `process_metrics()`, or a fresh one per test) and records
into the families it owns; families a service never touches simply export no samples (labelled
ones) or stay at zero. Exposition: `start_metrics_server(host, port)` serves a registry on its own
port (`--metrics-listen`), and `render_metrics(accept)` returns the body and content type for an
HTTP framework's `/metrics` route (the gateway's HTTP port).

Definitions (DESIGN 3.2, 6):
- acceptance length: tokens committed by one session in one verify step = accepted draft nodes
  + the bonus token, so it is >= 1 and autoregressive steps observe exactly 1;
- per-depth acceptance: `ddtree_draft_depth_total{depth=d}` counts trees that had a node at depth
  d and `ddtree_accepted_depth_total{depth=d}` the steps whose accepted path reached depth d; their
  ratio is the acceptance rate at depth d;
- inter-token latency: a streamed chunk of n tokens that arrives dt after the previous one is n
  observations of dt/n, so the mean is 1 / (tokens per second) of the stream, as clients feel it;
- drafter graph paths: `ddtree_draft_graph_runs_total{kind=k}` counts the drafter's draft groups and context
  appends by how they ran (`DraftGraphRunner.stats`: replays / captures / eager / padded_eager, context_* for
  appends), read at scrape time: on a GPU, steps that run eagerly instead of replaying show here.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import choose_encoder, start_http_server

# final statuses of a request: "ok" plus the gRPC status code names (bounded label cardinality)
STATUSES = frozenset({
    "ok", "cancelled", "unknown", "invalid_argument", "deadline_exceeded", "not_found", "already_exists",
    "permission_denied", "resource_exhausted", "failed_precondition", "aborted", "out_of_range",
    "unimplemented", "internal", "unavailable", "data_loss", "unauthenticated",
})
FALLBACK_REASONS = frozenset({"unavailable", "timeout", "stream_broken", "invalid_tree", "not_ready"})

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
ACCEPT_BUCKETS = tuple(float(i) for i in range(1, 17))  # one bucket per committed-token count 1..16
TREE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 256.0)


class Metrics:
    """The `ddtree_*` metric families, registered on one `CollectorRegistry`."""

    def __init__(self, registry: CollectorRegistry | None = None, max_depth: int = 64):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.max_depth = max_depth  # depth labels beyond this are clamped (bounded cardinality)
        r = self.registry
        # --- requests (gateway; the verifier counts its sessions with the same family) ---------------
        self.requests = Counter("ddtree_requests", "Finished requests by final status", ["status"], registry=r)
        self.ttft = Histogram("ddtree_time_to_first_token_seconds", "Request arrival to first streamed token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("ddtree_inter_token_latency_seconds",
                             "Time between streamed tokens (a chunk of n tokens counts n times dt/n)",
                             buckets=ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("ddtree_generated_tokens", "Generated (streamed) tokens", registry=r)
        self.queue_depth = Gauge("ddtree_queue_depth", "Requests admitted but waiting for a verifier slot",
                                 registry=r)
        # --- verifier step loop ----------------------------------------------------------------------
        self.running_sessions = Gauge("ddtree_running_sessions", "Sessions in the verifier's running batch",
                                      registry=r)
        self.kv_usage = Gauge("ddtree_kv_cache_usage_ratio", "Fraction of target KV pages in use (0..1)",
                              registry=r)
        self.step_seconds = Histogram("ddtree_verify_step_seconds", "Wall time of one verify step (whole batch)",
                                      buckets=STEP_BUCKETS, registry=r)
        self.acceptance_length = Histogram("ddtree_acceptance_length",
                                           "Tokens committed per session per step (accepted drafts + bonus)",
                                           buckets=ACCEPT_BUCKETS, registry=r)
        self.tree_size = Histogram("ddtree_tree_size_nodes", "Nodes of a verified tree, root included",
                                   buckets=TREE_BUCKETS, registry=r)
        self.draft_depth = Counter("ddtree_draft_depth", "Verified trees that had a node at this depth",
                                   ["depth"], registry=r)
        self.accepted_depth = Counter("ddtree_accepted_depth", "Verify steps whose accepted path reached this depth",
                                      ["depth"], registry=r)
        self.drafter_fallbacks = Counter("ddtree_drafter_fallbacks",
                                         "Session-steps decoded autoregressively because the drafter failed",
                                         ["reason"], registry=r)
        self.draft_transport_seconds = Histogram(
            "ddtree_draft_transport_seconds",
            "Remote draft step: round trip minus the drafter's own compute (wire, hand-offs, encoding)",
            buckets=STEP_BUCKETS, registry=r)
        # --- drafter ---------------------------------------------------------------------------------
        self.draft_seconds = Histogram("ddtree_draft_seconds", "Wall time of one draft call (all sessions)",
                                       buckets=STEP_BUCKETS, registry=r)
        self.draft_requests = Counter("ddtree_draft_requests",
                                      "Per-session draft requests answered, by status (ok = a tree came back)",
                                      ["status"], registry=r)
        self.draft_sessions = Gauge("ddtree_draft_sessions", "Sessions holding a drafter context cache (all streams)",
                                    registry=r)
        self._graph_runs = _GraphRunsCollector(dict)  # its source set by the drafter (`watch_draft_graphs`)
        r.register(self._graph_runs)
        self._depth_children: dict[tuple[Counter, int], Counter] = {}  # (family, depth) -> child, for the step loop

    # --- recording helpers (validate labels: a bad label is a programming error, not data) ----------
    def record_request(self, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown request status {status!r}; expected one of {sorted(STATUSES)}")
        self.requests.labels(status=status).inc()

    def record_fallback(self, reason: str, sessions: int = 1) -> None:
        if reason not in FALLBACK_REASONS:
            raise ValueError(f"unknown fallback reason {reason!r}; expected one of {sorted(FALLBACK_REASONS)}")
        self.drafter_fallbacks.labels(reason=reason).inc(sessions)

    def record_step(self, tree_size: int, tree_depth: int, accepted_depth: int) -> None:
        """One session's share of a verify step.

        tree_size: nodes verified including the root (1 for autoregressive); tree_depth: deepest
        node's depth (0 for autoregressive); accepted_depth: draft nodes on the accepted path.
        """
        self.record_steps(((tree_size, tree_depth, accepted_depth),))

    def record_steps(self, steps: Iterable[tuple[int, int, int]]) -> None:
        """Every session's share of one verify step: (tree_size, tree_depth, accepted_depth) each, as in
        `record_step`. The per-depth counters move once per depth for the whole step (by the number of
        sessions that reached it), so the step loop's cost is two observations per session."""
        reach = [0] * (self.max_depth + 2)  # reach[d]: trees whose deepest node is at depth d (clamped)
        acc = [0] * (self.max_depth + 2)
        for tree_size, tree_depth, accepted_depth in steps:
            if tree_size < 1 or not 0 <= accepted_depth <= tree_depth < tree_size:
                raise ValueError(f"inconsistent step: tree_size={tree_size} tree_depth={tree_depth} "
                                 f"accepted_depth={accepted_depth}")
            self.tree_size.observe(tree_size)
            self.acceptance_length.observe(accepted_depth + 1)
            reach[min(tree_depth, self.max_depth)] += 1
            acc[min(accepted_depth, self.max_depth)] += 1
        for family, counts in ((self.draft_depth, reach), (self.accepted_depth, acc)):
            n = 0
            for d in range(self.max_depth, 0, -1):  # sessions at depth >= d
                n += counts[d]
                if n:
                    self._depth_child(family, d).inc(n)

    def _depth_child(self, family: Counter, depth: int) -> Counter:
        child = self._depth_children.get((family, depth))
        if child is None:
            child = self._depth_children[(family, depth)] = family.labels(depth=str(depth))
        return child

    def watch_draft_graphs(self, stats: Callable[[], Mapping[str, int]]) -> None:
        """Export `stats()` (kind -> runs so far) as `ddtree_draft_graph_runs_total`, read at each scrape."""
        self._graph_runs.read = stats

    def set_kv_usage(self, used_pages: int, total_pages: int) -> None:
        self.kv_usage.set(used_pages / total_pages if total_pages > 0 else 0.0)

    def token_timer(self, start: float | None = None) -> TokenTimer:
        return TokenTimer(self, time.perf_counter() if start is None else start)


class _GraphRunsCollector:
    """`ddtree_draft_graph_runs_total{kind}` from a mapping read at scrape time (no per-step work)."""

    def __init__(self, read: Callable[[], Mapping[str, int]]):
        self.read = read

    def describe(self):
        return [CounterMetricFamily("ddtree_draft_graph_runs", "Drafter draft groups and context appends by how "
                                    "they ran (replays, captures, eager, padded_eager; context_*: appends)",
                                    labels=["kind"])]

    def collect(self):
        fam = self.describe()[0]
        for kind, n in sorted(dict(self.read()).items()):  # one copy: the model thread may add a kind meanwhile
            fam.add_metric([kind], float(n))
        yield fam


@dataclass
class TokenTimer:
    """Per-request TTFT / inter-token latency bookkeeping; call `tokens(n)` as each chunk streams."""

    metrics: Metrics
    start: float  # time.perf_counter() at request arrival
    last: float | None = None

    def tokens(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.perf_counter() if now is None else now
        m = self.metrics
        if self.last is None:
            m.ttft.observe(now - self.start)
        else:
            observe_many(m.itl, (now - self.last) / n, n)
        self.last = now
        m.generated_tokens.inc(n)


def observe_many(hist: Histogram, value: float, n: int) -> None:
    """n observations of one value (a streamed chunk's tokens): one bucket increment of n instead of n
    `observe` calls, which would be per-token work. Falls back to `observe` if prometheus_client's
    Histogram internals differ from the ones relied on (sorted `_upper_bounds` ending in +Inf, `_buckets`,
    `_sum`, as in 0.20-0.26)."""
    try:
        bounds, buckets, total = hist._upper_bounds, hist._buckets, hist._sum
    except AttributeError:
        for _ in range(n):
            hist.observe(value)
        return
    total.inc(value * n)
    buckets[bisect.bisect_left(bounds, value)].inc(n)  # first bound >= value, as observe() picks


@functools.cache
def process_metrics() -> Metrics:
    """The process-wide `Metrics`: its own registry (not prometheus_client's global one) plus the
    standard process / platform / GC collectors."""
    from prometheus_client.gc_collector import GCCollector
    from prometheus_client.platform_collector import PlatformCollector
    from prometheus_client.process_collector import ProcessCollector

    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return Metrics(registry)


# --- exposition --------------------------------------------------------------------------------------
def parse_hostport(s: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); the flag syntax every `--*-listen` uses."""
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {s!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class MetricsServer:
    """A running exposition server (background thread); `port` is the bound port (useful with 0)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry):
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host, self.port = host, self._httpd.server_address[1]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(host: str, port: int, registry: CollectorRegistry | None = None) -> MetricsServer:
    """Serve `registry` (default: the process registry) at http://host:port/ (any path) in a thread."""
    return MetricsServer(host, port, registry if registry is not None else process_metrics().registry)


def render_metrics(accept: str | None = None, registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """(body, content_type) for a `/metrics` route; `accept` is the request's Accept header (negotiates
    OpenMetrics vs the Prometheus text format)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry if registry is not None else process_metrics().registry), content_type
