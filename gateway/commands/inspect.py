"""`ddtree inspect DIR`: what a model folder holds and what serving it costs, from config.json alone.

Prints the parsed config, parameter counts (total and activated per token), bytes by category, KV
bytes per token and the GPU memory each rank needs for `--ep-size N` (`verifier_service.model_size`).
When weights are present it also validates them against the config from the safetensors headers
(names, shapes, dtypes, quantized modules) without reading tensor data. A DFlash drafter folder is
recognised and summarised too. `--json` prints one JSON object.
"""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="show a model folder's config, parameter counts and memory needs")
    p.add_argument("folder")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel GPUs to size each rank for")
    p.add_argument("--kv-tokens", type=int, default=0, help="KV-cache tokens per rank to include in the total")
    p.add_argument("--no-check", action="store_true", help="skip validating the weight files against the config")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _has_weights(folder: Path) -> bool:
    return (folder / "model.safetensors.index.json").exists() or (folder / "model.safetensors").exists()


def inspect_target(folder: Path, ep_size: int, kv_tokens: int, check: bool) -> dict:
    from verifier_service.checkpoint import check_target_files
    from verifier_service.config import KimiConfig
    from verifier_service.model_size import config_summary, size_report

    cfg = KimiConfig.from_file(folder)
    if ep_size < 1 or kv_tokens < 0:
        raise ValueError(f"--ep-size must be >= 1 and --kv-tokens >= 0, got {ep_size} and {kv_tokens}")
    out = {"kind": "target", "folder": str(folder), "config": config_summary(cfg),
           **size_report(cfg, ep_size, kv_tokens)}
    files: dict = {"weights": _has_weights(folder)}
    if files["weights"] and check:
        plan = check_target_files(folder, cfg)
        files |= {"checked": True, "tensors": len(plan.items), "bytes": plan.nbytes}
    out["files"] = files
    return out


def inspect_drafter(folder: Path) -> dict:
    import torch

    from drafter_service.config import DFlashConfig
    from drafter_service.model import DFlashDrafter

    cfg = DFlashConfig.from_file(folder)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    params = sum(p.numel() for p in model.parameters())
    return {"kind": "drafter", "folder": str(folder), "config": {
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
        "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers},
        "total_params": params, "active_params": params, "bytes": {"bf16": 2 * params, "total": 2 * params},
        "files": {"weights": _has_weights(folder)}}


def _gb(n: int) -> str:
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:,.2f}{unit}"
    return str(n)


def _print(r: dict) -> None:
    c = r["config"]
    print(f"{r['folder']}: {r['kind']}")
    for k, v in c.items():
        print(f"  {k}: {v}")
    print(f"parameters: {_count(r['total_params'])} total, {_count(r['active_params'])} activated per token")
    print("bytes:")
    for k, v in r["bytes"].items():
        print(f"  {k:<14} {_gb(v)}")
    if r["kind"] == "target":
        print(f"KV cache: {r['kv_bytes_per_token']:,} bytes per token")
        pr = r["per_rank"]
        print(f"per GPU with ep_size {pr['ep_size']}: {pr['experts_per_rank']} experts/layer, weights "
              f"{_gb(pr['weight_bytes'])} + KV {_gb(pr['kv_bytes'])} ({pr['kv_tokens']} tokens) = "
              f"{_gb(pr['total_bytes'])}")
    f = r["files"]
    if not f["weights"]:
        print("weights: none (config only)")
    elif f.get("checked"):
        print(f"weights: ok ({f['tensors']} tensors, {_gb(f['bytes'])} checked against config.json)")


def run(args) -> int:
    folder = Path(args.folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path}: no config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    if "dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or []):
        report = inspect_drafter(folder)
    else:
        report = inspect_target(folder, args.ep_size, args.kv_tokens, not args.no_check)
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
    return 0
