"""Prometheus metrics: recording arithmetic, label validation, and scraping the real HTTP endpoint."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from telemetry.metrics import Metrics, parse_hostport, process_metrics, render_metrics, start_metrics_server

REQUIRED_FAMILIES = {  # DESIGN 6 / issue 8: what operators must be able to graph
    "ddtree_requests": "counter", "ddtree_time_to_first_token_seconds": "histogram",
    "ddtree_inter_token_latency_seconds": "histogram", "ddtree_generated_tokens": "counter",
    "ddtree_acceptance_length": "histogram", "ddtree_accepted_depth": "counter", "ddtree_draft_depth": "counter",
    "ddtree_tree_size_nodes": "histogram", "ddtree_kv_cache_usage_ratio": "gauge", "ddtree_queue_depth": "gauge",
    "ddtree_drafter_fallbacks": "counter",
}


@pytest.fixture
def m():
    return Metrics(CollectorRegistry())


def val(m: Metrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_record_step_counts_depths_and_acceptance(m):
    # a 9-node tree 4 deep whose accepted path is 2 drafts long commits 3 tokens
    m.record_step(tree_size=9, tree_depth=4, accepted_depth=2)
    # an autoregressive step: a lone root commits exactly one token and drafts nothing
    m.record_step(tree_size=1, tree_depth=0, accepted_depth=0)
    assert val(m, "ddtree_acceptance_length_count") == 2
    assert val(m, "ddtree_acceptance_length_sum") == 3 + 1
    assert val(m, "ddtree_acceptance_length_bucket", le="1.0") == 1
    assert val(m, "ddtree_acceptance_length_bucket", le="2.0") == 1
    assert val(m, "ddtree_acceptance_length_bucket", le="3.0") == 2
    assert val(m, "ddtree_tree_size_nodes_sum") == 10
    assert [val(m, "ddtree_draft_depth_total", depth=str(d)) for d in range(1, 6)] == [1, 1, 1, 1, None]
    assert [val(m, "ddtree_accepted_depth_total", depth=str(d)) for d in range(1, 4)] == [1, 1, None]


@pytest.mark.parametrize("size,depth,acc", [(0, 0, 0), (4, 4, 1), (5, 2, 3), (3, 2, -1)])
def test_record_step_rejects_inconsistent_steps(m, size, depth, acc):
    with pytest.raises(ValueError, match="inconsistent step"):
        m.record_step(tree_size=size, tree_depth=depth, accepted_depth=acc)


def test_depth_labels_are_clamped():
    m = Metrics(CollectorRegistry(), max_depth=3)
    m.record_step(tree_size=20, tree_depth=10, accepted_depth=10)
    assert val(m, "ddtree_accepted_depth_total", depth="3") == 1
    assert val(m, "ddtree_accepted_depth_total", depth="4") is None


def test_request_status_and_fallback_labels_are_validated(m):
    m.record_request("ok")
    m.record_request("resource_exhausted")
    m.record_fallback("timeout", sessions=3)
    assert val(m, "ddtree_requests_total", status="ok") == 1
    assert val(m, "ddtree_requests_total", status="resource_exhausted") == 1
    assert val(m, "ddtree_drafter_fallbacks_total", reason="timeout") == 3
    with pytest.raises(ValueError, match="unknown request status"):
        m.record_request("OK")
    with pytest.raises(ValueError, match="unknown fallback reason"):
        m.record_fallback("because")


def test_token_timer_ttft_and_inter_token_latency(m):
    t = m.token_timer(start=10.0)
    t.tokens(1, now=10.5)  # first token after 0.5 s
    t.tokens(4, now=10.9)  # a 4-token chunk 0.4 s later: 4 x 0.1 s
    t.tokens(0, now=11.0)  # empty chunk: nothing
    t.tokens(1, now=11.1)
    assert val(m, "ddtree_time_to_first_token_seconds_count") == 1
    assert val(m, "ddtree_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert val(m, "ddtree_inter_token_latency_seconds_count") == 5
    assert val(m, "ddtree_inter_token_latency_seconds_sum") == pytest.approx(0.4 + 0.2)
    assert val(m, "ddtree_generated_tokens_total") == 6


def test_kv_usage_ratio(m):
    m.set_kv_usage(used_pages=512, total_pages=2048)
    assert val(m, "ddtree_kv_cache_usage_ratio") == 0.25
    m.set_kv_usage(used_pages=0, total_pages=0)
    assert val(m, "ddtree_kv_cache_usage_ratio") == 0.0


def test_scrape_http_endpoint_exposes_every_family(m):
    m.record_request("ok")
    m.record_step(tree_size=5, tree_depth=3, accepted_depth=3)
    m.record_fallback("unavailable")
    m.queue_depth.set(7)
    srv = start_metrics_server("127.0.0.1", 0, m.registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            body = r.read().decode()
    finally:
        srv.close()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for name, typ in REQUIRED_FAMILIES.items():
        assert name in families, f"{name} missing from the scrape"
        assert families[name].type == typ, (name, families[name].type)
    assert all(n.startswith("ddtree_") for n in families), sorted(families)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("ddtree_queue_depth", ())] == 7
    assert samples[("ddtree_accepted_depth_total", (("depth", "3"),))] == 1
    assert samples[("ddtree_acceptance_length_bucket", (("le", "4.0"),))] == 1
    assert samples[("ddtree_acceptance_length_bucket", (("le", "3.0"),))] == 0


def test_render_metrics_negotiates_openmetrics(m):
    m.record_request("cancelled")
    body, ctype = render_metrics("application/openmetrics-text; version=1.0.0", m.registry)
    assert ctype.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    assert b'ddtree_requests_total{status="cancelled"} 1.0' in body
    body, ctype = render_metrics(None, m.registry)
    assert ctype.startswith("text/plain") and b"# EOF" not in body


def test_process_metrics_is_one_registry_with_process_collectors():
    a, b = process_metrics(), process_metrics()
    assert a is b
    names = {f.name for f in a.registry.collect()}
    assert "ddtree_requests" in names and "python_info" in names
    # not prometheus_client's global REGISTRY: two services in one test process stay separate
    from prometheus_client import REGISTRY
    assert a.registry is not REGISTRY


@pytest.mark.parametrize("s,expect", [("0.0.0.0:9400", ("0.0.0.0", 9400)), ("[::]:50051", ("::", 50051)),
                                      ("localhost:0", ("localhost", 0))])
def test_parse_hostport(s, expect):
    assert parse_hostport(s) == expect


@pytest.mark.parametrize("s", ["9400", ":9400", "host:", "host:http", "host:70000"])
def test_parse_hostport_rejects(s):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_hostport(s)
