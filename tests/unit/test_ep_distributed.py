"""Expert-parallel verifier on CPU with gloo (DESIGN 7): real process groups of 2 and 3 ranks.

One spawn per world size runs `tests/ep_smoke.check_rank` on every rank (the same body as the GPU smoke
run under torchrun): the tiny target with only that rank's experts (8 experts: 4/4 over 2 ranks, 3/3/2
over 3), rank 0 driving a `LeaderEngine` through prefills and DDTree verify steps of several sessions
(oracle drafter, budgets > 0, one autoregressive session in the same batches) while ranks > 0 replay
them as `Follower`s. Checked:
  (a) every forward's logits and taps equal, bit for bit, those of the single-process model (all
      experts, same weights) driven through the same steps by a plain `Engine` in the same process;
  (b) greedy DDTree through the distributed engine equals single-process autoregressive decoding;
  (c) STOP ends every follower after exactly the operations rank 0 sent, and every rank's KV pool ends
      bitwise equal to rank 0's;
plus the failure paths (a rank dies, rank 0 goes silent: nobody hangs) and the CLI's torchrun environment.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp


def _groups(rank: int, world: int, rdzv: str, timeout_s: float = 60.0):
    from verifier_service.distributed import DistConfig, init_groups

    torch.set_num_threads(1)  # same GEMM blocking in every process (and for the reference on rank 0)
    return init_groups(DistConfig(rank, world, init_method=f"file://{rdzv}", timeout_s=timeout_s,
                                  startup_timeout_s=120.0))


def _exit_rank() -> None:
    """A passed rank leaves without interpreter finalization: gloo's worker threads can otherwise destroy
    the last collective's tensors while the interpreter shuts down and abort (the CLI does the same)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_main(rank: int, world: int, rdzv: str, target_dir: str) -> None:
    import torch.distributed as dist

    from tests.ep_smoke import check_rank
    from verifier_service.expert_parallel import expert_range

    groups = _groups(rank, world, rdzv)
    out = check_rank(groups, target_dir)
    assert out["experts_per_rank"] == [len(expert_range(8, r, world)) for r in range(world)]
    dist.destroy_process_group()
    _exit_rank()


def _spawn(fn, world: int, *args) -> float:
    t0 = time.monotonic()
    mp.spawn(fn, args=(world, *args), nprocs=world, join=True)
    return time.monotonic() - t0


@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_engine_is_bitwise_single_process(tiny_dirs, tmp_path, world):
    _spawn(_rank_main, world, str(tmp_path / "rdzv"), str(tiny_dirs[0]))


def _failures(rank: int, world: int, rdzv: str, target_dir: str, timeout_s: float) -> None:
    """Rank 2 dies right after the startup handshake; rank 0 then goes silent (no pings: it looks hung) for
    longer than the timeout, and finally tries a forward. Rank 1 must give up on rank 0 within its timeout;
    rank 0's forward must fail with GroupError (not hang) and report the failure once."""
    from verifier_service.distributed import Follower, GroupError, Leader, LeaderEngine, load_rank_target
    from verifier_service.engine import EngineConfig
    from verifier_service.session import DecodeParams

    groups = _groups(rank, world, rdzv, timeout_s)
    ecfg = EngineConfig(page_size=8, num_pages=8, max_sessions=2, max_session_len=64)
    target = load_rank_target(groups, target_dir, torch.float32, "cpu")
    if rank == 0:
        failures: list[GroupError] = []
        leader = Leader(groups, on_failure=failures.append)
        engine = LeaderEngine(target, None, (), ecfg, leader)
        leader._closing.set()  # the pinger stops: rank 0 looks hung from the followers' side
        time.sleep(timeout_s + 1.5)
        t0 = time.monotonic()
        with pytest.raises(GroupError, match="group failed"):
            engine.add([1, 2, 3], DecodeParams(max_new_tokens=2, budget=0))
        assert time.monotonic() - t0 < timeout_s + 3
        assert len(failures) == 1 and leader.failed is failures[0]
        with pytest.raises(GroupError):  # stays failed: nothing more is sent
            leader.compact(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        _exit_rank()
    follower = Follower(target, ecfg, groups)
    if rank == 2:
        follower.start()  # HELLO and the startup handshake
        _exit_rank()  # then dies without a word
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="no word from rank 0"):
        follower.run()
    assert time.monotonic() - t0 < timeout_s + 3
    _exit_rank()


def test_a_lost_rank_fails_the_group_within_the_timeout(tiny_dirs, tmp_path):
    _spawn(_failures, 3, str(tmp_path / "rdzv"), str(tiny_dirs[0]), 1.5)


def test_cli_reads_torchrun_environment():
    from gateway.commands.verifier import dist_from_env

    assert dist_from_env({}, None, 60.0) == (None, None)  # one process: as before
    assert dist_from_env({"WORLD_SIZE": "1"}, "cpu", 60.0) == (None, "cpu")
    env = {"WORLD_SIZE": "8", "RANK": "11", "LOCAL_RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match="rank 11 of 8"):
        dist_from_env(env, "cpu", 60.0)
    env["RANK"] = "3"
    cfg, dev = dist_from_env(env, "cuda", 60.0)
    assert (cfg.rank, cfg.world_size, cfg.local_rank, cfg.backend, cfg.timeout_s, dev) == (3, 8, 3, "nccl", 60.0,
                                                                                          "cuda:3")
    assert dist_from_env(env, "cpu", 60.0)[0].backend == "gloo"
    with pytest.raises(ValueError, match="--device cuda"):
        dist_from_env(env, "cuda:0", 60.0)  # every rank would take GPU 0
    with pytest.raises(ValueError, match="RANK.*torchrun"):
        dist_from_env({"WORLD_SIZE": "2"}, "cpu", 60.0)
