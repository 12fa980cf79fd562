"""Shared benchmark plumbing: ceilings measured in the same run, timing, and the JSONL record.

Every figure is paired with a floor from two ceilings measured here, on this GPU, in this run:
  copy_bw   device-to-device copy of 2 GiB (bytes read + bytes written) / time
  mm_rate   8192^3 bf16 matmul on random data, 2*M*N*K / time
Timing: `triton.testing.do_bench` (CUDA events, median), optionally around a CUDA-graph replay so
that host launch overhead is not what is measured (the record says which).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import sys

import torch
import triton
import triton.testing


def commit() -> str:
    """The commit the benchmark runs: $DDTREE_COMMIT when set (a copied working tree, e.g. on a lent GPU box,
    may carry a stale .git), else git HEAD (+dirty when kernels/ or bench/ have uncommitted changes)."""
    if os.environ.get("DDTREE_COMMIT"):
        return os.environ["DDTREE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "kernels", "bench"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "uncommitted"
    except Exception:  # noqa: BLE001 - no git on the box
        return "uncommitted"


def env_info() -> dict:
    return dict(gpu=torch.cuda.get_device_name(), commit=commit(), torch=torch.__version__,
                triton=triton.__version__, python=sys.version.split()[0])


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time of `fn` replayed from a CUDA graph (fn is called twice first to compile).

    Falls back to eager timing (and says so on stdout) if the capture fails."""
    try:
        return _graph_ms(fn, warmup_ms, rep_ms)
    except Exception as exc:  # noqa: BLE001
        print(f"CUDA graph capture failed ({exc!r:.120}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return bench_ms(fn, warmup_ms, rep_ms)


def _graph_ms(fn, warmup_ms: int, rep_ms: int) -> float:
    fn()
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return bench_ms(g.replay, warmup_ms, rep_ms)


def graph_launch_ms() -> float:
    """What this harness adds to any launch: a CUDA graph of one tiny kernel, replayed and timed like the cases."""
    tiny = torch.zeros(1, device="cuda")
    return graph_ms(functools.partial(tiny.add_, 1))


def measure_ceilings() -> dict:
    n = 1 << 30  # 1 Gi bf16 = 2 GiB per buffer
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = bench_ms(functools.partial(dst.copy_, src), 10, 200)
    copy_bw = 2 * src.numel() * src.element_size() / (t * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = bench_ms(functools.partial(torch.matmul, a, b), 50, 300)
    mm = 2 * 8192**3 / (t * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return dict(copy_bw_GBps=copy_bw / 1e9, mm_tflops=mm / 1e12)


def write_jsonl(path: str, records: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def kernel_split_us(fn, reps: int = 50) -> dict[str, float]:
    """Mean device time (us) of each kernel `fn` launches, by name (first 40 characters), over `reps` replays of it
    from a CUDA graph under torch.profiler (fn is called once first to compile)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name[:40]] += ev.device_time / reps
    return dict(times)
