"""Build the embedded (in-process) engine: target + DFlash drafter in one process, one device (or rank 0 of an
expert-parallel group, `leader=`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from drafter_service.checkpoint import check_pair, load_drafter
from drafter_service.config import DFlashConfig
from drafter_service.context_projection import ContextProjection
from drafter_service.drafter import Drafter
from verifier_service.batch_invariant import make_batch_invariant
from verifier_service.checkpoint import load_target
from verifier_service.config import KimiConfig
from verifier_service.distributed import Leader, LeaderEngine, load_rank_target
from verifier_service.engine import Engine, EngineConfig

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float64": torch.float64, "fp64": torch.float64, "float16": torch.float16, "fp16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_block_size(drafter_cfg: DFlashConfig, block_size: int | None) -> None:
    if block_size is not None and block_size != drafter_cfg.block_size:
        raise ValueError(f"--block-size {block_size} does not match the drafter, which was trained with "
                         f"block_size {drafter_cfg.block_size}")


def build_local_engine(target_dir: str | Path, drafter_dir: str | Path | None, dtype: torch.dtype | None = None,
                       device: str | None = None, engine_cfg: EngineConfig | None = None,
                       block_size: int | None = None, batch_invariant: bool | str = True,
                       leader: Leader | None = None, cuda_graphs: bool | None = None) -> Engine:
    """Validate both configs (no weights touched), then load and wire the pair.

    leader: rank 0 of an expert-parallel group (`verifier_service.distributed`): load only rank 0's experts
    and return a `LeaderEngine`, which the other ranks' `Follower`s mirror.

    batch_invariant (CUDA only): True swaps the target's GEMMs and norms for batch-invariant kernels
    (`verifier_service.batch_invariant`, attention stays `kernels.mla_attention`, position aligned: greedy
    DDTree == AR bit for bit; also "kernel"); "aligned" also swaps in the cross-check attention of
    `verifier_service.aligned_attention` (cost O(tokens x context): small models, checks); False keeps cuBLAS.
    cuda_graphs: verify forwards through CUDA graphs (`verifier_service.cuda_graphs`), and the in-process
    drafter's steps too (`drafter_service.cuda_graphs`); None keeps engine_cfg.cuda_graphs, and where that is
    None too, turns them on for a CUDA device. (An expert-parallel leader turns its verify graphs off; its
    drafter, local to rank 0, keeps them.)"""
    if batch_invariant not in (True, False, "kernel", "aligned"):
        raise ValueError(f"batch_invariant must be True, False, 'kernel' or 'aligned', got {batch_invariant!r}")
    device = device or default_device()
    cfg = engine_cfg or EngineConfig()
    if cuda_graphs is not None:
        cfg = dataclasses.replace(cfg, cuda_graphs=cuda_graphs)
    if cfg.cuda_graphs is None:
        cfg = dataclasses.replace(cfg, cuda_graphs=str(device).startswith("cuda"))
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tcfg = KimiConfig.from_file(target_dir)
    drafter = None
    tap_layers: tuple[int, ...] = ()
    if drafter_dir is not None:
        dcfg = DFlashConfig.from_file(drafter_dir)
        check_block_size(dcfg, block_size)
        check_pair(dcfg, tcfg)
    if leader is None:
        target = load_target(target_dir, dtype, device, tcfg)
    else:
        target = load_rank_target(leader.groups, target_dir, dtype, device, tcfg)
    if batch_invariant and str(device).startswith("cuda") and dtype != torch.float64:
        make_batch_invariant(target, attention="aligned" if batch_invariant == "aligned" else "kernel")
    projection = None
    if drafter_dir is not None:
        dmodel = load_drafter(drafter_dir, tcfg, dtype, device)
        drafter = Drafter(dmodel, target.model.embed_tokens.weight, target.lm_head.weight,
                          max_sessions=cfg.max_sessions, window=cfg.draft_window, cuda_graphs=cfg.cuda_graphs)
        tap_layers = dmodel.cfg.target_layer_ids
        # the engine projects the taps (as a verifier holding the projection does for a drafter process): one
        # code path for the rows, so a split pair drafts what this one does
        projection = ContextProjection.from_model(dmodel)
    if leader is not None:
        return LeaderEngine(target, drafter, tap_layers, cfg, leader, projection)
    return Engine(target, drafter, tap_layers, cfg, projection)
