"""bench/grpc_echo.py runs end to end (a real grpc.aio server on loopback, the three client shapes)."""

from __future__ import annotations

import json

from bench import grpc_echo


def test_grpc_echo_bench_records_every_client(tmp_path):
    out = tmp_path / "echo.jsonl"
    recs = grpc_echo.main(["--sizes", "100", "70000", "--n", "20", "--out", str(out)])
    assert {(r["params"]["client"], r["params"]["bytes"]) for r in recs} == {
        (c, b) for c in grpc_echo.CLIENTS for b in (100, 70000)}
    assert all(0 < r["ms"] <= r["p90_ms"] for r in recs)
    assert [json.loads(line) for line in out.read_text().splitlines()] == recs
