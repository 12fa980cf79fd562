"""GPU time of a verify step's acceptance: the torch code (`accept_greedy`, ~40 launches) against the one-launch
kernel (`accept_tree`), at the engine's shapes, by CUDA events over back-to-back calls (median of 5 rounds of 200).

    PYTHONPATH=. python bench/accept_cost.py [--sessions 1 32] [--budget 16 64]      # needs a CUDA GPU

Prints one line per shape; writes nothing. What a step saves is the difference (every engine alike); the results
are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.tree_accept import accept_greedy, accept_tree  # noqa: E402
from kernels.tree_build import build_tree  # noqa: E402


def per_call_us(fn, n: int = 200, rounds: int = 5) -> float:
    for _ in range(20):
        fn()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 32])
    p.add_argument("--budget", type=int, nargs="+", default=[16, 64])
    p.add_argument("--depth", type=int, default=15)
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}  torch {torch.__version__}")
    for S in args.sessions:
        for budget in args.budget:
            g = torch.Generator().manual_seed(S * 100 + budget)
            trees = build_tree(torch.log_softmax(3 * torch.randn(S, args.depth, 1000, generator=g), -1),
                               torch.randint(0, 1000, (S,), generator=g), [budget] * S, [8] * S)
            tok, parent = trees.tokens.long().to(dev), trees.parent.long().to(dev)
            n = torch.tensor(trees.n_nodes, device=dev)
            post = torch.randint(0, 1000, tok.shape, generator=g).to(dev)
            step = (tok, parent, n, post, args.depth)
            want, got = accept_greedy(*step), accept_tree(*step)
            same = all(torch.equal(getattr(want, f), getattr(got, f)) for f in ("accept_len", "path", "bonus", "last"))
            t_torch = per_call_us(lambda step=step: accept_greedy(*step))
            t_kernel = per_call_us(lambda step=step: accept_tree(*step))
            print(f"S={S:3d} nodes={tok.shape[1]:3d}  torch {t_torch:7.1f} us  kernel {t_kernel:7.1f} us  "
                  f"same={same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
