"""Train the DFlash drafter against the frozen, exported kimi-mini target; export in the DFlash layout.

Per step: random windows of S tokens; the frozen target (the exported checkpoint, experts dequantized
by the reference rule) gives its taps after `target_layer_ids` and its next-token distributions; K
random blocks per window run through `training.dflash_forward.drafter_blocks` (the serving block
objective: context = taps at positions < start, block = [token at start, MASK x (B-1)]). Slot i is
trained towards the target's distribution of the token at start+i (teacher-forced on the data), mixing
soft cross-entropy with hard cross-entropy on the target's argmax (what greedy verification accepts);
depth i is weighted by exp(-(i-1)/gamma). Metrics: per-depth top-1 agreement with the target and the
implied chain acceptance 1 + sum_k prod_{i<=k} match_i. Checkpoint/resume as in train_target.

  python -m training.train_drafter --target models/kimi-mini/target --data runs/data --ckpt runs/ckpt_drafter \
      --export models/kimi-mini/drafter --time-budget 110
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from drafter_service.checkpoint import check_pair, load_drafter
from drafter_service.config import DFlashConfig
from drafter_service.model import DFlashDrafter
from training.data import WindowSampler, heldout_windows
from training.dflash_forward import drafter_blocks, sample_starts
from training.export import load_target_dense, write_drafter
from training.kimi_forward import causal_forward
from training.mini_config import drafter_config
from training.train_target import load_ckpt, lr_at, save_ckpt


def drafter_cfg_for(target, block: int, toy: bool) -> dict:
    d = drafter_config(block)
    tc = target.cfg
    d["hidden_size"] = tc.hidden_size
    d["num_target_layers"] = tc.num_hidden_layers
    if toy:
        d.update({"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128})
        d["dflash_config"]["target_layer_ids"] = list(range(min(3, tc.num_hidden_layers)))
    return d


def block_loss(dr, target, tokens, starts, soft_weight: float, gamma: float):
    """-> (loss, per-depth top-1 agreement [B-1], chain acceptance) for blocks at `starts`."""
    with torch.no_grad():
        hidden, taps, _ = causal_forward(target, tokens, dr.cfg.target_layer_ids)
        t_logits = target.lm_head(hidden).float()  # [N, S, V]: row p predicts token p+1
    B = dr.cfg.block_size
    out = drafter_blocks(dr, target.model.embed_tokens.weight, taps, tokens, starts)  # [N, K, B, D]
    logits = target.lm_head(out[:, :, 1:]).float()  # [N, K, B-1, V]: slot i predicts token start+i
    idx = starts[..., None] + torch.arange(B - 1, device=tokens.device)  # teacher rows start+i-1
    teacher = t_logits[torch.arange(tokens.shape[0], device=tokens.device)[:, None, None], idx]
    logq = torch.log_softmax(logits, -1)
    soft = -(torch.softmax(teacher, -1) * logq).sum(-1)
    top = teacher.argmax(-1)
    hard = -logq.gather(-1, top[..., None])[..., 0]
    w = torch.exp(-torch.arange(B - 1, device=tokens.device, dtype=torch.float32) / gamma)
    loss = (((soft_weight * soft + (1 - soft_weight) * hard) * w).sum(-1) / w.sum()).mean()
    match = (logits.argmax(-1) == top).float()
    chain = 1 + match.cumprod(-1).sum(-1).mean()
    return loss, match.mean((0, 1)), chain


@torch.no_grad()
def heldout_metrics(dr, target, windows, batch, blocks, device, seed=123) -> dict:
    gen = torch.Generator().manual_seed(seed)
    accs, chains, n = 0, 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch, :-1].to(device)
        starts = sample_starts(w.shape[0], blocks, w.shape[1], dr.cfg.block_size, gen, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, acc, chain = block_loss(dr, target, w, starts, 1.0, 1.0)
        accs = accs + acc * w.shape[0]
        chains += float(chain) * w.shape[0]
        n += w.shape[0]
    return {"heldout_top1_by_depth": [round(float(a), 4) for a in accs / n], "heldout_chain_acceptance":
            round(chains / n, 4)}


def train(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    target = load_target_dense(args.target, torch.float32, device)
    for p in target.parameters():
        p.requires_grad_(False)
    config = drafter_cfg_for(target, args.block_size, args.toy)
    if args.taps:
        config["dflash_config"]["target_layer_ids"] = [int(x) for x in args.taps.split(",")]
    dcfg = DFlashConfig.from_dict(config)
    check_pair(dcfg, target.cfg)
    dr = DFlashDrafter(dcfg, target.cfg.hidden_size).to(device)
    if args.init:
        init = load_drafter(args.init, target.cfg, torch.float32, device)
        if init.cfg != dcfg:
            raise SystemExit(f"--init {args.init}: its config differs from the one this run trains")
        dr.load_state_dict(init.state_dict())
    data = Path(args.data)
    sampler = WindowSampler(np.load(data / "train.npy"), args.seq, seed=args.seed + 1)
    held = heldout_windows(np.load(data / "heldout.npy"), args.seq, args.eval_windows)
    opt = torch.optim.AdamW(dr.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.wd,
                            fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed + 2)
    ckpt = Path(args.ckpt)
    step, elapsed = load_ckpt(ckpt, dr, opt, sampler, device) if args.resume else (0, 0.0)
    log = open(args.log, "a") if args.log else None
    t_start, last_ckpt = time.time() - elapsed, time.time()
    while True:
        elapsed = time.time() - t_start
        progress = max(elapsed / args.time_budget, step / args.max_steps if args.max_steps else 0.0)
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        tokens = sampler.batch(args.batch, device)[:, :-1]
        starts = sample_starts(tokens.shape[0], args.blocks, tokens.shape[1], dcfg.block_size, gen, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, acc, chain = block_loss(dr, target, tokens, starts, args.soft_weight, args.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(dr.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            rec = {"step": step, "progress": round(progress, 4), "loss": round(float(loss.detach()), 4), "lr": lr,
                   "gnorm": round(float(gnorm), 3), "top1_by_depth": [round(float(a), 3) for a in acc],
                   "chain_acceptance": round(float(chain), 3), "elapsed": round(elapsed, 1)}
            print(json.dumps(rec), flush=True)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
        if time.time() - last_ckpt > args.ckpt_every:
            save_ckpt(ckpt, dr, opt, sampler, step, time.time() - t_start)
            last_ckpt = time.time()
    save_ckpt(ckpt, dr, opt, sampler, step, time.time() - t_start)
    dr.eval()
    result = {"steps": step, "train_seconds": round(time.time() - t_start, 1),
              **heldout_metrics(dr, target, held, args.batch, args.blocks, device)}
    if args.export:
        write_drafter(dr, args.export, config)
    print(json.dumps({"final": result}), flush=True)
    if log:
        log.write(json.dumps({"final": result}) + "\n")
        log.close()
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="exported target folder (Kimi K2.6 layout)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--export", default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--init", default=None, help="start from an exported drafter folder (DFlash layout)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--taps", default=None, help="comma-separated target_layer_ids (default: the mini config's)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=48, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--soft-weight", type=float, default=0.5)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--time-budget", type=float, default=110.0)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--ckpt-every", type=float, default=60.0)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--log", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--toy", action="store_true")
    return ap.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
