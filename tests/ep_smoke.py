"""Expert-parallel exactness, one process per rank: the body of tests/unit/test_ep_distributed.py (gloo, CPU)
and the GPU smoke run (NCCL), e.g. on two GPUs:

    PYTHONPATH=. torchrun --nproc-per-node 2 -m tests.ep_smoke --target models/kimi-mini/target --device cuda

Every rank loads only its routed experts; rank 0 also loads the whole model. Rank 0 drives a plain
`Engine` on the whole model and a `LeaderEngine` (which the other ranks replay as `Follower`s) through
the same prefills and DDTree verify steps (an oracle drafter proposing the AR continuation with
corruption, budgets > 0, one autoregressive session in the same batches), and checks:
  (a) every forward's logits and taps are bitwise those of the whole model;
  (b) greedy DDTree through the expert-parallel engine equals single-process autoregressive decoding;
  (c) after STOP, every follower replayed exactly the operations rank 0 sent and holds rank 0's KV bits;
the experts partition across the ranks. On CUDA both models get the batch-invariant kernels (as the
server does). Prints one JSON line on rank 0 and exits 0 when everything holds.
"""

from __future__ import annotations

import argparse
import json

import torch

PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [42, 7]]
BUDGETS = [8, 16, 0]  # the last session decodes autoregressively inside the same steps
NEW = 14
TAPS = (1, 3)
INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits (-0.0 != +0.0; NaN payloads compared)."""
    return t.contiguous().view(INTS[t.element_size()])


def _recording(engine, log: list) -> None:
    """Record (logits, taps) of every forward the engine runs."""
    run = engine.forward

    def forward(fb):
        hidden, taps = run(fb)
        log.append((engine.target.logits(hidden), taps.clone()))
        return hidden, taps

    engine.forward = forward


def _drive(engine, ar_out):
    from tests.helpers import OracleDrafter
    from verifier_service.session import DecodeParams

    ref = {f"r{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar_out))}
    engine.drafter = OracleDrafter(ref, engine.target.cfg.vocab_size, 8, p_wrong=0.3, max_rank=3, seed=11)
    sessions = [engine.add(p, DecodeParams(max_new_tokens=NEW, budget=b, topk=3, ignore_eos=True), sid=f"r{i}")
                for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))]
    engine.run_until_done()
    return sessions


def _serving_kernels(model, device: str, dtype: torch.dtype):
    from verifier_service.batch_invariant import make_batch_invariant

    if device.startswith("cuda") and dtype != torch.float64:
        make_batch_invariant(model)  # what build_local_engine and the server do on CUDA
    return model


def _lead(groups, target, target_dir: str, dtype: torch.dtype, device: str, ecfg) -> tuple[int, torch.Tensor, dict]:
    """Rank 0: (a) and (b) against the whole model; returns (operations sent, KV pool, summary)."""
    from verifier_service.checkpoint import load_target
    from verifier_service.distributed import Leader, LeaderEngine
    from verifier_service.engine import Engine
    from verifier_service.session import DecodeParams

    world = groups.cfg.world_size
    full = _serving_kernels(load_target(target_dir, dtype, device), device, dtype)
    ar = Engine(full, None, TAPS, ecfg).generate(PROMPTS, DecodeParams(NEW, budget=0, ignore_eos=True))
    ar_out = [s.output for s in ar]
    single, ep = Engine(full, None, TAPS, ecfg), LeaderEngine(target, None, TAPS, ecfg, Leader(groups))
    want, got, moves = [], [], []
    _recording(single, want)
    _recording(ep, got)
    compact = ep.compact
    ep.compact = lambda src, dst: (moves.append(src.numel()), compact(src, dst))
    s_single, s_ep = _drive(single, ar_out), _drive(ep, ar_out)
    assert len(got) == len(want) > len(PROMPTS)
    for i, ((lw, tw), (lg, tg)) in enumerate(zip(want, got)):
        assert torch.equal(bits(lg), bits(lw)), f"world {world}: forward {i}: logits differ from one process"
        assert torch.equal(bits(tg), bits(tw)), f"world {world}: forward {i}: taps differ from one process"
    for i, (a, b, ref) in enumerate(zip(s_single, s_ep, ar_out)):
        assert b.output == a.output == ref, f"world {world}: session {i} diverged from autoregressive"
    steps = [a for s in s_ep[:2] for a in s.accepted_per_step]
    assert max(steps) >= 4, f"trees were never accepted deep: {steps}"
    ep.close()
    return len(got) + len(moves), ep.kv.kv, {"forwards": len(got), "moves": len(moves), "max_accepted": max(steps)}


def check_rank(groups, target_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:
    """This rank's part of the check (every rank calls it); raises AssertionError on a mismatch."""
    import torch.distributed as dist

    from verifier_service.distributed import Follower, load_rank_target
    from verifier_service.engine import EngineConfig

    world, rank = groups.cfg.world_size, groups.cfg.rank
    ecfg = EngineConfig(page_size=8, num_pages=64, max_sessions=4, max_session_len=256)
    target = _serving_kernels(load_rank_target(groups, target_dir, dtype, device), device, dtype)
    summary: dict = {}
    if rank == 0:
        ops, kv, summary = _lead(groups, target, target_dir, dtype, device, ecfg)
    else:
        follower = Follower(target, ecfg, groups)
        ops, kv = follower.run(), follower.kv
    counts = [torch.zeros(2, dtype=torch.int64, device=kv.device) for _ in range(world)]
    mine = torch.tensor([ops, len(target.model.layers[1].mlp.expert_ids)], device=kv.device)
    dist.all_gather(counts, mine, group=groups.data)
    counts = [c.tolist() for c in counts]
    assert [c[0] for c in counts] == [ops] * world, f"operations replayed per rank: {counts}"
    assert sum(c[1] for c in counts) == target.cfg.n_routed_experts, counts
    pools = [torch.empty_like(kv) for _ in range(world)]
    dist.all_gather(pools, kv, group=groups.data)
    for r, p in enumerate(pools[1:], 1):
        assert torch.equal(bits(p), bits(pools[0])), f"world {world}: rank {r}'s KV pool differs from rank 0's"
    return {**summary, "world": world, "operations": ops, "experts_per_rank": [c[1] for c in counts]}


def main() -> None:
    import os

    from gateway.commands.verifier import dist_from_env, exit_rank
    from verifier_service.distributed import init_groups
    from verifier_service.local import DTYPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="models/kimi-mini/target")
    p.add_argument("--device", default="cuda", help="cuda (rank r on cuda:LOCAL_RANK, NCCL) or cpu (gloo)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    args = p.parse_args()
    cfg, device = dist_from_env(os.environ, args.device, 300.0)
    if cfg is None:
        raise SystemExit("run under torchrun with --nproc-per-node >= 2")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    torch.set_num_threads(1)  # CPU: the same GEMM blocking in every process
    groups = init_groups(cfg)
    out = check_rank(groups, args.target, dtype, device)
    if cfg.rank == 0:
        print(json.dumps({"event": "ep_smoke_ok", "device": device, "dtype": str(dtype), **out}), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    exit_rank(0)


if __name__ == "__main__":
    main()
