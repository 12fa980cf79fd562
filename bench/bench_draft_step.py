"""Benchmark: one draft step of the DFlash drafter (`Drafter.draft`), eagerly and from CUDA graphs.

At kimi-mini sizes the draft step is launch bound: its cost is the host launching a few hundred small
kernels, not the GPU running them. This times `Drafter.draft` at C concurrent sessions in a steady state
(every session sends 3 new context rows per step, budget 16, top-k 8, contexts growing from 64 rows), as
the median over `--steps` steps of
  ms       the step with a device synchronisation after it (host launches + GPU work),
  host_ms  the time until `draft` returns (what the host spends; the GPU may still be working),
for `cuda_graphs` off (eager) and on (replays; the first steps capture, then are excluded by the warm-up).
Peers in the same run: the eager step is the graphs' peer; `launches` is the number of device ops the
step issues from the host, counted on the meta device (views, empties and metadata excluded; RMSNorm and
the block attention counted as their one CUDA kernel each): the eager step's, and with graphs what the host still issues
(feature and index uploads, two replays, the copy out of the trees).

  PYTHONPATH=. python bench/bench_draft_step.py [--pair models/kimi-mini] [--sessions 1 8 32]
      [--steps 30] [--out bench/results/draft_step.jsonl]
  PYTHONPATH=. python bench/bench_draft_step.py --launches-only     # CPU: the launch counts alone
  PYTHONPATH=. python bench/bench_draft_step.py --pair /tmp/k26 --profile 25   # + each C's top GPU kernels

`--rows projected` (the default) sends the context rows an engine holding the drafter's projection sends (every
engine but a verifier without `--context-projection`; `drafter_service.context_projection`); `--rows taps` sends the
taps, which the drafter projects itself (one `fc` GEMM more per step: the step before the projection moved).

`--profile N`: after each timed graph run, 10 more graph steps under torch.profiler, and the N kernels with the most
GPU time per step (with their share of the step's GPU time): where the step's time goes, beside the bytes floor of
`floor_ms` (the drafter's layer weights, `fc` too with taps, plus the lm_head, read once per step at `--copy-gbs`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without PYTHONPATH too

import drafter_service.model as drafter_model  # noqa: E402
import kernels.rmsnorm as rmsnorm  # noqa: E402
from drafter_service.api import DraftRequest  # noqa: E402
from drafter_service.config import DFlashConfig  # noqa: E402
from drafter_service.drafter import Drafter  # noqa: E402
from drafter_service.model import DFlashDrafter  # noqa: E402

NEW_ROWS, BUDGET, TOPK, PREFILL = 3, 16, 8, 64
NOT_LAUNCHES = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "alias", "_local_scalar_dense",
                "set_", "resize_", "is_pinned", "_pin_memory", "pin_memory", "new_empty", "new_empty_strided",
                "unbind", "_unsafe_view", "scalar_tensor"}


class Steps:
    """C sessions advancing NEW_ROWS committed rows per step; rows of width F (taps, or projected rows)."""

    def __init__(self, C: int, F: int, device, dtype, projected: bool):
        self.C, self.F, self.device, self.dtype, self.pos, self.projected = C, F, device, dtype, 0, projected

    def next(self, rows: int = NEW_ROWS) -> list[DraftRequest]:
        feats = torch.randn(rows, self.F, device=self.device, dtype=self.dtype)
        reqs = [DraftRequest(f"s{i}", self.pos, feats, 5, self.pos + rows, BUDGET, TOPK, "", self.projected)
                for i in range(self.C)]
        self.pos += rows
        return reqs


class LaunchCount(TorchDispatchMode):
    """Counts the device ops dispatched on meta tensors; `as_one_launch(fn)` wraps fn (a graph's body) so that
    a call counts as one launch (its replay) and its ops as `in_graph`."""

    def __init__(self):
        super().__init__()
        self.n, self.in_graph, self._inside = 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_flatten((args, kwargs, out))[0]
        if (not func.is_view and func.overloadpacket.__name__ not in NOT_LAUNCHES
                and any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in flat)):
            if self._inside:
                self.in_graph += 1
            else:
                self.n += 1
        return out

    def as_one_launch(self, fn):
        def replay(*a, **kw):
            self.n += 1
            self._inside = True
            try:
                return fn(*a, **kw)
            finally:
                self._inside = False
        return replay


def row_width(cfg: DFlashConfig, target_hidden: int, projected: bool) -> int:
    return cfg.hidden_size if projected else cfg.num_taps * target_hidden


def count_launches(cfg: DFlashConfig, target_hidden: int, C: int, projected: bool = True) -> dict:
    """Device ops issued per steady draft step (meta device: shapes only, no data): eager, and with graphs
    (the runner's padded path with each graph body counted as one replay; `in_graph`: the ops replayed)."""
    saved = rmsnorm.rms_norm, drafter_model.draft_attention
    # one kernel each on CUDA (the block attention reads the cache in place there)
    rmsnorm.rms_norm, drafter_model.draft_attention = (lambda x, w, eps: x * w), (lambda q, *args: q * 1)
    out = {}
    try:
        model = DFlashDrafter(cfg, target_hidden).to("meta").eval()
        head = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
        for graphs in (False, True):
            d = Drafter(model, head, head, max_sessions=max(C, 1), window=1024, cuda_graphs=graphs)
            steps = Steps(C, row_width(cfg, target_hidden, projected), "meta", torch.float32, projected)
            d.draft(steps.next(PREFILL))
            count = LaunchCount()
            if graphs:
                r = d.graphs
                r._draft_body, r._append_body = count.as_one_launch(r._draft_body), count.as_one_launch(r._append_body)
            with count:
                d.draft(steps.next())
            out["graphs" if graphs else "eager"] = count.n
            if graphs:
                out["in_graph"] = count.in_graph
    finally:
        rmsnorm.rms_norm, drafter_model.draft_attention = saved
    return out


def time_steps(d: Drafter, steps: Steps, n: int) -> tuple[float, float]:
    synced, host = [], []
    for _ in range(n):
        reqs = steps.next()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d.draft(reqs)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        synced.append((t2 - t0) * 1e3)
    return statistics.median(synced), statistics.median(host)


def floor_ms(model: torch.nn.Module, head: torch.Tensor, copy_gbs: float, projected: bool) -> float:
    """The step's bytes floor: every drafter weight the step reads (its layers and norms; `fc` and `hidden_norm`
    only with taps) and the lm_head, read once."""
    skip = {"fc.weight", "hidden_norm.weight"} if projected else set()
    nbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in skip)
    nbytes += head.numel() * head.element_size()
    return nbytes / (copy_gbs * 1e9) * 1e3


def print_profile(d: Drafter, steps: Steps, top: int, floor: float, n: int = 10) -> None:
    """n draft steps under torch.profiler -> the `top` kernels by GPU time per step (graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            d.draft(steps.next())
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.time_range.elapsed_us() / 1e3 / n  # us -> ms per step
            k[1] += 1
    total = sum(v[0] for v in kernels.values())
    print(f"    GPU time per step {total:.3f} ms (bytes floor {floor:.3f} ms, ratio {floor / max(total, 1e-9):.2f}); "
          f"top {top} kernels, ms per step, calls per step, share:")
    for name, (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {ms:8.4f}  {calls / n:5.1f}  {100 * ms / max(total, 1e-9):5.1f}%  {name[:110]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="models/kimi-mini")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--launches-only", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print each C's N costliest GPU kernels")
    ap.add_argument("--copy-gbs", type=float, default=4250.0, help="copy bandwidth for the bytes floor (H200: ~4250)")
    ap.add_argument("--rows", choices=("projected", "taps"), default="projected",
                    help="context rows the steps send: projected (an engine with the projection) or taps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    projected = args.rows == "projected"
    pair = Path(args.pair)
    cfg = DFlashConfig.from_file(pair / "drafter")
    from verifier_service.config import KimiConfig

    tcfg = KimiConfig.from_file(pair / "target")
    launches = {C: count_launches(cfg, tcfg.hidden_size, C, projected) for C in args.sessions}
    if args.launches_only:
        for C, n in launches.items():
            print(f"C={C:3d}  launches per draft step: eager {n['eager']}, with graphs {n['graphs']} "
                  f"(+ {n['in_graph']} kernels inside the two replayed graphs)")
        return 0

    from bench._common import env_info, write_jsonl
    from drafter_service.checkpoint import load_drafter
    from drafter_service.target_head import load_target_head

    _, embed, head = load_target_head(pair / "target", torch.bfloat16, "cuda", tcfg)
    model = load_drafter(pair / "drafter", tcfg, torch.bfloat16, "cuda")
    F = row_width(cfg, tcfg.hidden_size, projected)
    records = []
    print(f"{'C':>3} {'graphs':>6} {'ms':>8} {'host_ms':>8} {'launches':>8}")
    for C in args.sessions:
        for graphs in (False, True):
            d = Drafter(model, embed, head, max_sessions=max(args.sessions), window=1024, cuda_graphs=graphs)
            steps = Steps(C, F, "cuda", torch.bfloat16, projected)
            d.draft(steps.next(PREFILL))
            time_steps(d, steps, 5)  # warm-up: kernels compiled, graphs captured
            ms, host_ms = time_steps(d, steps, args.steps)
            stats = dict(d.graphs.stats) if d.graphs is not None else {}
            n = launches[C]["graphs" if graphs else "eager"]
            print(f"{C:3d} {str(graphs):>6} {ms:8.3f} {host_ms:8.3f} {n:8d}")
            if graphs and args.profile:
                print_profile(d, steps, args.profile, floor_ms(model, head, args.copy_gbs, projected))
            records.append({"name": "draft_step", "params": {"sessions": C, "cuda_graphs": graphs, "budget": BUDGET,
                                                             "topk": TOPK, "new_rows": NEW_ROWS, "pair": str(pair),
                                                             "rows": args.rows},
                            **env_info(), "metrics": {"ms": round(ms, 4), "host_ms": round(host_ms, 4),
                                                      "launches": n, "runner": stats}})
            del d
    if args.out:
        write_jsonl(args.out, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
