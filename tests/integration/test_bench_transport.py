"""bench/bench_transport.py runs end to end on the CPU (a real `ddtree drafter serve` process on loopback, the
tiny pair): one record per engine and concurrency, every remote engine emitting the in-process engine's tokens, the
pair's layer count and the served malloc settings recorded; `--transports` picks the remote engines and refuses
unknown ones."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from bench import host_timeline
from telemetry.host_timeline import MARKS

REPO = Path(__file__).resolve().parents[2]


def run_bench(pair_dir: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, str(REPO / "bench" / "bench_transport.py"), "--pair", str(pair_dir),
                           "--device", "cpu", "--steps", "3", "--warmup", "1", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_bench_transport_records_each_engine_with_identical_outputs(pair, tmp_path):
    target, _ = pair
    out = tmp_path / "transport.jsonl"
    proc = run_bench(target.parent, out, "--concurrency", "1", "3", "--transports", "grpc", "colocated")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    cfg = json.loads((target / "config.json").read_text())
    target_layers = cfg.get("text_config", cfg)["num_hidden_layers"]
    assert sorted((r["params"]["transport"], r["params"]["concurrency"]) for r in recs) == [
        ("colocated", 1), ("colocated", 3), ("grpc", 1), ("grpc", 3), ("inprocess", 1), ("inprocess", 3)]
    for r in recs:
        assert r["outputs_identical"] and r["steps_identical"] and "problems" not in r, r
        assert r["ms"] > 0 and r["params"]["steps"] == 3
        assert (r["ratio"] == 1.0) == (r["params"]["transport"] == "inprocess")
        assert r["params"]["target_layers"] == target_layers
        # the verifier side runs with the served processes' malloc settings (where the C library takes them)
        assert r["malloc_tuned"] == (platform.libc_ver()[0] == "glibc"), r["malloc_tuned"]
    grpc = next(r for r in recs if r["params"]["transport"] == "grpc")
    assert {"round_trip", "drafter", "transport"} <= set(grpc["metrics"]["breakdown_ms"]) and not grpc["regions"]
    colocated = next(r for r in recs if r["params"]["transport"] == "colocated")
    assert colocated["regions"] and set(colocated["regions"].values()) == {"cpu"}  # /dev/shm regions


def test_bench_transport_steps_variants_of_the_engines_in_the_same_rounds(pair, tmp_path):
    """--variant FIELD=VALUE[@ENGINES]: a copy of the engines named (its own drafter state and stream), named
    ENGINE+FIELD=VALUE, in the same rounds, its tokens checked against in-process like the others' and its ratio
    against the base in-process engine; rows=projected makes a co-located copy send projected rows."""
    target, _ = pair
    out = tmp_path / "transport.jsonl"
    proc = run_bench(target.parent, out, "--concurrency", "1", "--transports", "colocated", "--variant",
                     "tree_inputs=torch", "--variant", "local_draft=lazy@inprocess", "--variant",
                     "rows=projected@colocated")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = {r["params"]["transport"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == ["colocated", "colocated+rows=projected", "colocated+tree_inputs=torch", "inprocess",
                            "inprocess+local_draft=lazy", "inprocess+tree_inputs=torch"]
    got = {t: (r["params"]["tree_inputs"], r["params"]["local_draft"], r["params"]["projected_rows"],
               r["params"]["variant"]) for t, r in recs.items()}
    assert got == {"inprocess": ("auto", "eager", True, None),
                   "inprocess+tree_inputs=torch": ("torch", "eager", True, "tree_inputs=torch"),
                   "inprocess+local_draft=lazy": ("auto", "lazy", True, "local_draft=lazy"),
                   "colocated": ("auto", "eager", False, None),  # co-located engines send taps (--rows auto)
                   "colocated+tree_inputs=torch": ("torch", "eager", False, "tree_inputs=torch"),
                   "colocated+rows=projected": ("auto", "eager", True, "rows=projected")}, got
    for r in recs.values():
        assert r["outputs_identical"] and r["steps_identical"] and "problems" not in r, r
    assert recs["inprocess"]["ratio"] == 1.0 and recs["colocated+rows=projected"]["regions"]


@pytest.mark.parametrize("spec,why", [("tree_inputs", "not FIELD=VALUE"), ("speed=11", "not an EngineConfig field"),
                                      ("local_draft=soon", "local_draft must be"), ("rows=both", "rows must be")])
def test_bench_transport_refuses_a_bad_variant(pair, tmp_path, spec, why):
    target, _ = pair
    proc = run_bench(target.parent, tmp_path / "t.jsonl", "--variant", spec)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "t.jsonl").exists()


def test_bench_transport_refuses_an_unknown_transport(pair, tmp_path):
    target, _ = pair
    proc = run_bench(target.parent, tmp_path / "t.jsonl", "--transports", "colocated", "carrier-pigeon")
    assert proc.returncode == 2 and "carrier-pigeon" in proc.stderr and "not among" in proc.stderr
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize("transport,marks", [
    ("grpc", [m for m in MARKS if m not in ("answer_decoded", "answer_landed")]),  # no GPU: the engine takes the trees
    ("colocated", ["step_sent", "step_in", "draft_begin", "draft_rows", "draft_queued", "trees_encoded", "answer_ready",
                   "answer_sent", "answer_taken"]),  # over the control socket
])
def test_host_timeline_lines_up_both_processes_marks(pair, tmp_path, transport, marks):
    """DDTREE_HOST_TIMELINE reaches the drafter process too: every step has the marks of both processes, in the
    order they happen (bench/host_timeline.py drops a step that misses one), and each hand-off took some time."""
    target, _ = pair
    timeline = tmp_path / "timeline.log"
    # the marks of a step asked after the host read (a step drafted ahead has no request of its own to build)
    proc = run_bench(target.parent, tmp_path / "t.jsonl", "--concurrency", "1", "--transports", transport,
                     "--draft-ahead", "off", env={"DDTREE_HOST_TIMELINE": str(timeline)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    pids = {line.split()[0] for line in timeline.read_text().splitlines()}
    assert len(pids) == 2, pids  # the bench's process and the drafter's
    out = host_timeline.hand_offs(host_timeline.steps_of(timeline.read_text().splitlines()))
    assert out["marks"] == marks, out["marks"]
    assert out["steps"] >= 3 + 1  # the timed steps and the warm-up, every one with all its marks
    assert all(med >= 0 for _, _, med, _, _ in out["segments"]) and out["added_us"] > 0, out
    assert 0 < out["cpu"][("draft_begin", "draft_rows")] and "verify_queued" in out["side"], out  # one thread's CPU
    lead = out["lead"]  # the engine's marks before the next step_sent, in the order they happen
    assert lead["step_begin"][0] >= lead["draft_asked"][0] >= lead["rows_ready"][0] >= lead["step_built"][0] >= 0


def test_bench_transport_steps_engines_that_draft_ahead(pair, tmp_path):
    """The engines draft ahead by default; --variant draft_ahead=false: in-process and co-located copies that ask after
    their host read step in the same rounds (blocks of two steps: --block-steps), with the in-process engine's tokens
    and accepted lengths, block for block; only the co-located engine drafting ahead sends its steps ahead."""
    target, _ = pair
    out = tmp_path / "transport.jsonl"
    proc = run_bench(target.parent, out, "--concurrency", "1", "2", "--transports", "colocated", "--variant",
                     "draft_ahead=false", "--block-steps", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    names = sorted({r["params"]["transport"] for r in recs})
    assert names == ["colocated", "colocated+draft_ahead=false", "inprocess", "inprocess+draft_ahead=false"]
    for r in recs:
        assert r["outputs_identical"] and r["steps_identical"] and "problems" not in r, r
        assert r["params"]["block_steps"] == 2
    for r in recs:
        remote_ahead = r["params"]["transport"] == "colocated"
        assert r["params"]["draft_ahead"] == ("=false" not in r["params"]["transport"]), r["params"]
        assert (r["ahead_steps"] > 0) == remote_ahead, r


def test_the_drafters_trace_window_covers_the_same_rounds():
    """`--torch-trace DIR:FIRST:COUNT` counts rounds in the verifier (a tick per engine and round); the drafter counts
    the steps it is sent, so its window is scaled by the steps a round sends it (remote engines x block steps)."""
    from bench.transport_lineup import drafter_trace_spec
    from telemetry.torch_trace import DEFAULT_COUNT, DEFAULT_FIRST

    assert drafter_trace_spec("/tmp/traces:12:6", 6) == "/tmp/traces:72:36"
    assert drafter_trace_spec("/tmp/traces:3:2", 1) == "/tmp/traces:3:2"
    assert drafter_trace_spec("/tmp/traces", 4) == f"/tmp/traces:{DEFAULT_FIRST * 4}:{DEFAULT_COUNT * 4}"
    with pytest.raises(ValueError, match="DIR"):
        drafter_trace_spec("/tmp/traces:x", 2)


def test_bench_transport_traces_the_same_rounds_in_both_processes(pair, tmp_path):
    """End to end with blocks of steps: the verifier's trace window (rounds 2-3 of 1 + 4) and the drafter's (the
    steps those rounds send it) overlap in time; before the drafter's window was scaled, it traced other rounds."""
    target, _ = pair
    traces = tmp_path / "traces"
    proc = run_bench(target.parent, tmp_path / "t.jsonl", "--concurrency", "1", "--transports", "colocated",
                     "--block-steps", "3", "--steps", "4", "--torch-trace", f"{traces}:2:2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    def marks(role):
        (path,) = [p for p in traces.glob(f"{role}-*.json") if not p.name.endswith(".meta.json")]
        d = json.loads(path.read_text())
        ts = [e["ts"] for e in d["traceEvents"] if str(e.get("name", "")).startswith(f"ddtree:{role} step")]
        base = d.get("baseTimeNanoseconds", 0) / 1e3
        return min(ts) + base, max(ts) + base, len(ts)

    v0, v1, nv = marks("verifier")
    d0, d1, nd = marks("drafter")
    assert nv == 4 and nd == 6, (nv, nd)  # 2 rounds x 2 engines; 2 rounds x 3 steps of the one remote engine
    assert d0 < v1 and v0 < d1, (v0, v1, d0, d1)  # the windows overlap

