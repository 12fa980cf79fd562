"""telemetry.torch_trace (a torch.profiler window over steps) and bench/trace_steps.py (lining traces up by step)."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
import torch

from bench import trace_steps
from telemetry.torch_trace import DEFAULT_COUNT, DEFAULT_FIRST, StepTrace, parse_spec


@pytest.mark.parametrize("spec,want", [
    ("/tmp/t", (Path("/tmp/t"), DEFAULT_FIRST, DEFAULT_COUNT)),
    ("out:3", (Path("out"), 3, DEFAULT_COUNT)),
    ("out:0:2", (Path("out"), 0, 2)),
])
def test_parse_spec(spec, want):
    assert parse_spec(spec) == want


@pytest.mark.parametrize("spec", ["", ":3", "out:x", "out:1:0", "out:1:2:3", "out:-1"])
def test_parse_spec_refuses(spec):
    with pytest.raises(ValueError, match="DIR\\[:FIRST\\[:COUNT\\]\\]"):
        parse_spec(spec)


def _markers(path: Path) -> list[str]:
    return [e["name"] for e in json.loads(path.read_text())["traceEvents"]
            if e.get("ph") == "X" and e.get("name", "").startswith("ddtree:")]


def test_window_covers_exactly_its_steps(tmp_path):
    tr = StepTrace(tmp_path, "drafter", first=2, count=3)
    x = torch.randn(8, 8)
    for _ in range(9):
        tr.tick("e1")
        x = x @ x.T / 8
    assert tr.path == tmp_path / f"drafter-{os.getpid()}.json"
    assert _markers(tr.path) == [f"ddtree:drafter step {n} e1" for n in (2, 3, 4)]
    meta = json.loads(tr.path.with_suffix(".meta.json").read_text())
    assert (meta["role"], meta["first"], meta["count"]) == ("drafter", 2, 3)
    tr.close()  # closed already: nothing more
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_close_inside_the_window_writes_what_ran(tmp_path):
    tr = StepTrace(tmp_path, "verifier", first=0, count=100)
    tr.tick()
    tr.tick()
    assert tr.path is None
    tr.close()
    assert _markers(tr.path) == ["ddtree:verifier step 0", "ddtree:verifier step 1"]


def test_no_trace_before_the_window(tmp_path):
    tr = StepTrace(tmp_path / "never", "verifier", first=5, count=1)
    for _ in range(5):
        tr.tick()
    tr.close()
    assert tr.path is None and not (tmp_path / "never").exists()
    assert StepTrace.from_spec(None, "verifier") is None


def _trace(path: Path, base_ns: int, events: list[tuple]) -> None:
    """A Chrome trace like Kineto's: (cat, name, ts_us, dur_us) events, `ts` relative to baseTimeNanoseconds."""
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": [
        {"ph": "X", "cat": c, "name": n, "ts": ts, "dur": d, "pid": 1, "tid": 1} for c, n, ts, d in events]}))


def test_trace_steps_lines_two_processes_up_by_step(tmp_path):
    # the drafter's clock base is 1 ms later: its events at ts 0 are at 1000 us on the verifier's scale
    _trace(tmp_path / "verifier-11.json", 0, [
        ("user_annotation", "ddtree:verifier step 5 grpc", 100.0, 1.0),
        ("user_annotation", "ddtree:verifier step 6 inprocess", 5000.0, 1.0),
        ("kernel", "verify_a", 200.0, 100.0), ("kernel", "verify_b", 310.0, 50.0),  # one run (10 us gap)
        ("kernel", "verify_c", 900.0, 10.0),  # a new run (540 us later)
        ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 950.0, 5.0),
        ("cuda_runtime", "cudaStreamSynchronize", 960.0, 400.0),
        ("cuda_runtime", "cudaStreamSynchronize", 1400.0, 10.0),
        ("user_annotation", "ddtree:verifier step 7 grpc", 10000.0, 1.0),
    ])
    _trace(tmp_path / "drafter-22.json", 1_000_000, [
        ("user_annotation", "ddtree:drafter step 3", 0.0, 1.0), ("kernel", "draft", 100.0, 300.0),
    ])
    (tmp_path / "drafter-22.meta.json").write_text("{}")  # sidecars are not traces
    role, events, _ = trace_steps.load(tmp_path / "drafter-22.json")
    assert role == "drafter" and events[1].t0 == pytest.approx(1100.0)
    events = trace_steps.load(tmp_path / "verifier-11.json")[1] + events
    marks = trace_steps.step_marks(events, "verifier", "grpc")
    assert marks == [100.0, 10000.0]
    out = io.StringIO()
    trace_steps.report(events, marks, gap_us=20.0, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 0: 9.900 ms to the next marker"
    body = [re.sub(r"\s+", " ", line.strip()) for line in lines[1:lines.index("step 1: 0.001 ms to the next marker")]]
    assert body == [
        "+0.100 ms verifier GPU 0.160 ms 2 kernel(s): verify_a .. verify_b",
        "+0.800 ms verifier GPU 0.010 ms 1 kernel(s): verify_c",
        "+0.850 ms verifier GPU 0.005 ms gpu_memcpy Memcpy HtoD (Pinned -> Device)",
        "+0.860 ms verifier host 0.400 ms cudaStreamSynchronize",  # the 10 us one is below the threshold
        "+0.900 ms drafter mark ddtree:drafter step 3",
        "+1.000 ms drafter GPU 0.300 ms 1 kernel(s): draft",
        "+4.900 ms verifier mark ddtree:verifier step 6 inprocess",
    ]


def test_trace_steps_cli(tmp_path, capsys):
    _trace(tmp_path / "verifier-1.json", 0, [("user_annotation", "ddtree:verifier step 0", 0.0, 1.0),
                                             ("kernel", "k", 10.0, 5.0)])
    merged = tmp_path / "merged.json"
    assert trace_steps.main([str(tmp_path), "--merged", str(merged)]) == 0
    assert "steps of the verifier: 1" in capsys.readouterr().out
    assert {e["pid"] for e in json.loads(merged.read_text())["traceEvents"]} == {"verifier 1"}
    with pytest.raises(SystemExit):
        trace_steps.main([str(tmp_path / "empty")])


# --- the services ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("component", ["verifier", "drafter"])
def test_torch_trace_flag_reaches_the_server_config(component, monkeypatch):
    import importlib

    from gateway.cli import build_parser

    cmd = importlib.import_module(f"gateway.commands.{component}")
    seen = []
    monkeypatch.setattr(cmd, "run_server", lambda serve, cfg, *a: seen.append(cfg) or 0)
    base = [component, "serve", "--listen", "127.0.0.1:0", "--target", "t"]
    base += ["--drafter-address", "127.0.0.1:1"] if component == "verifier" else ["--drafter", "d"]
    for extra, want in (([], None), (["--torch-trace", "/tmp/tr:5:2"], "/tmp/tr:5:2")):
        args = build_parser().parse_args([*base, *extra])
        assert args.func(args) == 0 and seen.pop().torch_trace == want


def test_bad_torch_trace_is_refused():
    from drafter_service.server import DrafterServerConfig
    from verifier_service.server import VerifierServerConfig

    with pytest.raises(ValueError, match="DIR"):
        VerifierServerConfig("127.0.0.1:0", "t", "grpc", drafter_address="127.0.0.1:1", torch_trace="out:x")
    with pytest.raises(ValueError, match="DIR"):
        DrafterServerConfig("127.0.0.1:0", "t", "d", torch_trace="out:1:0")


def test_drafter_stream_steps_are_traced(parts, tmp_path):
    """Steps over a real gRPC Draft stream tick the service's window: its trace holds the drafter's step markers."""
    from drafter_service.drafter import Drafter
    from drafter_service.server import DrafterService
    from tests.unit.stream_harness import ServerThread, client_for, steps

    model, embed, head = parts
    service = DrafterService(max_sessions=4, window=64, step_trace=StepTrace(tmp_path, "drafter", first=0, count=2))
    service.attach(Drafter(model, embed, head, max_sessions=4, window=64), "tiny", embed.shape[1])
    srv = ServerThread(service)
    client = client_for(srv.port, colocated=False)
    try:
        for reqs in steps(("a", "b")):
            client.draft(reqs)
    finally:
        client.close()
        srv.stop()
    tr = service.step_trace
    assert tr.steps == 3 and tr.foreign_ticks == 0  # every byte step ran on the server's event loop
    assert _markers(tr.path) == ["ddtree:drafter step 0", "ddtree:drafter step 1"]  # written at the third tick


def test_ticks_and_close_from_other_threads_are_ignored(tmp_path, caplog):
    import threading

    tr = StepTrace(tmp_path, "drafter", first=0, count=5)
    tr.tick()  # this thread owns it now
    other = threading.Thread(target=lambda: (tr.tick(), tr.close()))
    other.start()
    other.join()
    assert tr.steps == 1 and tr.foreign_ticks == 1 and tr.path is None
    assert "not written" in caplog.text
    tr.close()  # the owner can
    assert _markers(tr.path) == ["ddtree:drafter step 0"]


def test_scheduler_steps_are_traced_and_closed_on_its_thread(tiny_target64, tmp_path):
    from tests.helpers import OracleDrafter
    from tests.unit.test_scheduler import Collector, ar, settled
    from verifier_service.engine import Engine, EngineConfig
    from verifier_service.scheduler import Scheduler
    from verifier_service.session import DecodeParams

    prompt = [5, 17, 99, 3]
    ref = ar(tiny_target64, [prompt], 12)[0]
    oracle = OracleDrafter({"s": prompt + ref}, tiny_target64.cfg.vocab_size, 8, seed=1)
    eng = Engine(tiny_target64, oracle, (), EngineConfig(page_size=8, num_pages=64, max_sessions=2))
    s = Scheduler(eng, step_trace=StepTrace(tmp_path, "verifier", first=1, count=50))  # still open at close
    s.start()
    try:
        sink = Collector()
        s.open("s", prompt, DecodeParams(max_new_tokens=12, budget=8, topk=4), False, sink)
        tokens = sink.finish()[0]
        assert settled(s, 64)
    finally:
        s.close()
    assert tokens == ref  # tracing does not change a token
    tr = s.step_trace
    assert tr.steps >= 2 and tr.foreign_ticks == 0
    assert _markers(tr.path) == [f"ddtree:verifier step {n}" for n in range(1, tr.steps)]
