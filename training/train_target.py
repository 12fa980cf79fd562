"""Train the kimi-mini target (Kimi K2.6 architecture) on the tokenized corpus, quantize, export.

Next-token cross-entropy on random windows; AdamW, warmup then cosine decay over a *time* budget (the
run ends on time, so it fits a device lease whatever the throughput); bf16 autocast on CUDA. Router
balance is DeepSeek-V3's aux-loss-free bias update. The last `--qat-frac` of the budget fine-tunes with
the routed experts fake-quantized to INT4 g32 (straight-through), then the experts are quantized for
real and the pair is exported in the Kimi K2.6 layout. A checkpoint (model, optimizer, sampler, clock)
is written every `--ckpt-every` seconds; `--resume` continues from it, `--init-from` warm-starts from an
exported target folder.

  python -m training.train_target --data runs/data --ckpt runs/ckpt_target --export models/kimi-mini/target \
      --tokenizer runs/tok --time-budget 170
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from training.data import WindowSampler, heldout_windows
from training.export import dense_config, load_target_dense, write_target
from training.kimi_forward import causal_forward, update_router_bias
from training.mini_config import target_config
from verifier_service.config import KimiConfig
from verifier_service.model import KimiForCausalLM

TOY_OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
                 "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                 "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4}


@torch.no_grad()
def init_weights(model: KimiForCausalLM, seed: int) -> None:
    """N(0, 1/fan_in) weights; residual-output projections scaled by 1/sqrt(2 * layers); N(0, 1) embeddings."""
    g = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(2 * model.cfg.num_hidden_layers)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # RMSNorm weights
            continue
        fan_in = p.shape[-1]
        std = 1.0 if "embed_tokens" in name else fan_in**-0.5
        if name.endswith(("o_proj.weight", "down_proj.weight", "mlp.w2")):
            std *= depth_scale
        p.copy_(torch.randn(p.shape, generator=g) * std)


def build_model(config: dict, device) -> tuple[KimiForCausalLM, KimiConfig]:
    qcfg = KimiConfig.from_dict(config)
    model = KimiForCausalLM(dense_config(qcfg)).to(device)
    model.build_rope()
    return model, qcfg


def lm_loss(model, tokens: torch.Tensor, qat: bool):
    hidden, _, routes = causal_forward(model, tokens[:, :-1], qat=qat)
    logits = model.lm_head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)), routes


@torch.no_grad()
def heldout_nll(model, windows: torch.Tensor, batch: int, device, qat: bool) -> float:
    """Mean next-token NLL (nats) over the held-out windows."""
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = lm_loss(model, w, qat)
        total += float(loss) * w[:, 1:].numel()
        n += w[:, 1:].numel()
    return total / n


def lr_at(progress: float, step: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def save_ckpt(path: Path, model, opt, sampler, step: int, elapsed: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "last.pt.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sampler": sampler.state(), "step": step,
                "elapsed": elapsed}, tmp)
    tmp.rename(path / "last.pt")


def load_ckpt(path: Path, model, opt, sampler, device) -> tuple[int, float]:
    """Resume from path/last.pt when it exists -> (step, elapsed seconds); (0, 0.0) otherwise."""
    if not (path / "last.pt").exists():
        return 0, 0.0
    st = torch.load(path / "last.pt", map_location=device, weights_only=False)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    sampler.load_state(st["sampler"])
    print(json.dumps({"resumed": str(path), "step": st["step"], "elapsed": round(st["elapsed"], 1)}), flush=True)
    return st["step"], st["elapsed"]


def train(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = target_config()
    if args.toy:
        config["text_config"].update(TOY_OVERRIDES)
    model, qcfg = build_model(config, device)
    init_weights(model, args.seed)
    if args.init_from:
        model.load_state_dict(load_target_dense(args.init_from, torch.float32, device).state_dict())
    data = Path(args.data)
    sampler = WindowSampler(np.load(data / "train.npy"), args.seq, seed=args.seed)
    held = heldout_windows(np.load(data / "heldout.npy"), args.seq, args.eval_windows)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed_tokens" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    ckpt = Path(args.ckpt)
    step, elapsed = load_ckpt(ckpt, model, opt, sampler, device) if args.resume else (0, 0.0)
    log = open(args.log, "a") if args.log else None
    t_start, last_ckpt, last_eval, tokens_seen = time.time() - elapsed, time.time(), time.time(), 0
    t_log = time.time()
    while True:
        elapsed = time.time() - t_start
        progress = max(elapsed / args.time_budget, step / args.max_steps if args.max_steps else 0.0)
        if progress >= 1.0:
            break
        qat = progress >= 1.0 - args.qat_frac
        lr = lr_at(progress, step, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sampler.batch(args.batch, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, routes = lm_loss(model, batch, qat)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_router_bias(model, routes, args.bias_rate)
        step += 1
        tokens_seen += batch[:, 1:].numel()
        if step % args.log_every == 0 or step == 1:
            load = torch.stack([torch.bincount(r.reshape(-1), minlength=qcfg.n_routed_experts)
                                for r in routes.values()])
            rec = {"step": step, "progress": round(progress, 4), "loss": round(float(loss.detach()), 4), "lr": lr,
                   "gnorm": round(float(gnorm), 3), "qat": qat, "tok_per_s": round(tokens_seen / (time.time() - t_log)),
                   "elapsed": round(elapsed, 1), "max_load_ratio": round(float((load.max(1).values /
                                                                                  load.float().mean(1)).max()), 2)}
            tokens_seen, t_log = 0, time.time()
            print(json.dumps(rec), flush=True)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
        if time.time() - last_eval > args.eval_every:  # a small held-out probe, for the overfitting curve
            rec = {"step": step, "elapsed": round(time.time() - t_start, 1),
                   "heldout_nll_probe": round(heldout_nll(model, held[:16], args.batch, device, qat), 4)}
            print(json.dumps(rec), flush=True)
            if log:
                log.write(json.dumps(rec) + "\n")
            last_eval = time.time()
        if time.time() - last_ckpt > args.ckpt_every:
            save_ckpt(ckpt, model, opt, sampler, step, time.time() - t_start)
            last_ckpt = time.time()
    save_ckpt(ckpt, model, opt, sampler, step, time.time() - t_start)
    model.eval()
    result = {"steps": step, "train_seconds": round(time.time() - t_start, 1), "tokens_trained": step * args.batch *
              args.seq, "heldout_tokens": int(held[:, 1:].numel()),
              "heldout_nll_dense": heldout_nll(model, held, args.batch, device, qat=False),
              "heldout_nll_fakequant": heldout_nll(model, held, args.batch, device, qat=True)}
    if args.export:
        write_target(model, args.export, config)
        if args.tokenizer:
            for f in ("tiktoken.model", "tokenizer_config.json"):
                shutil.copy(Path(args.tokenizer) / f, Path(args.export) / f)
        exported = load_target_dense(args.export, torch.float32, device)
        result["heldout_nll_exported"] = heldout_nll(exported, held, args.batch, device, qat=False)
        result["heldout_ppl_exported"] = math.exp(result["heldout_nll_exported"])
    print(json.dumps({"final": result}), flush=True)
    if log:
        log.write(json.dumps({"final": result}) + "\n")
        log.close()
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt", required=True, help="checkpoint folder (last.pt)")
    ap.add_argument("--export", default=None, help="write the quantized target here (Kimi K2.6 layout)")
    ap.add_argument("--tokenizer", default=None, help="folder whose tokenizer files are copied into --export")
    ap.add_argument("--init-from", default=None, help="warm start from an exported target folder")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--time-budget", type=float, default=170.0, help="seconds of training (incl. QAT)")
    ap.add_argument("--max-steps", type=int, default=0, help="also stop after this many steps (0 = time only)")
    ap.add_argument("--qat-frac", type=float, default=0.1)
    ap.add_argument("--ckpt-every", type=float, default=60.0)
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--eval-every", type=float, default=30.0, help="seconds between held-out probes")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--log", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--toy", action="store_true", help="toy sizes (CPU smoke tests)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
