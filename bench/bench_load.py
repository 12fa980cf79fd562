"""Load throughput of a real-shape Kimi K2.6 checkpoint from local disk to the GPU, beside the disk's own speed.

    python bench/bench_load.py --layers 2 --dir /path/on/local/disk --commit $(git rev-parse HEAD)

Steps (each timed; a phase is skipped, and says so, once `--budget-s` is spent):
1. sanity: a tiny checkpoint loaded on the GPU (bf16 and fp32, i.e. direct and converting copies)
   must equal the same checkpoint loaded on the CPU;
2. write `kimi-k2.6` truncated to `--layers` layers (layer 0 is dense; 2 layers = one MoE layer of
   384 INT4 experts, ~15 GB with embeddings and lm_head) with `write_random_target` (fast mode);
3. cold runs (page cache dropped before each, via /proc/sys/vm/drop_caches or, failing that,
   posix_fadvise DONTNEED per file; the method is recorded): plain `readinto` of every shard
   (1 thread and `--workers` threads: the floor), `load_target(..., device="cuda")`, and the peer:
   the safetensors library's `safe_open(..., device="cuda").get_tensor` for the same tensors;
4. warm runs (files in page cache): the same three, showing the host->GPU pipeline's own ceiling;
5. a correctness check of the cold-loaded model against the files (every non-expert tensor, three
   experts per MoE layer).
Each measurement is one JSON line in `--results` (name, params, gpu, commit, ms, floor_ms, ratio =
floor_ms / ms, peers), and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verifier_service import presets  # noqa: E402
from verifier_service.checkpoint import load_target, plan_target  # noqa: E402
from verifier_service.config import KimiConfig  # noqa: E402
from verifier_service.random_checkpoint import write_random_target  # noqa: E402
from verifier_service.safetensors_io import ShardedReader  # noqa: E402


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


DROPPED_BY: list[str] = []  # how the page cache was dropped, per call


def drop_cache(files: list[Path]) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        DROPPED_BY.append("drop_caches")
        return "drop_caches"
    except OSError:
        pass
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    DROPPED_BY.append("fadvise")
    return "fadvise"


CHUNK = 16 << 20
BUFS: list[bytearray] = []  # allocated once, outside the timed region


def raw_read(files: list[Path], threads: int, chunk: int = CHUNK) -> int:
    """Plain reads of every byte of the files (no mmap, no torch); returns bytes read."""
    jobs = [(p, off) for p in files for off in range(0, p.stat().st_size, chunk)]
    while len(BUFS) < threads:
        BUFS.append(bytearray(chunk))

    def work(part: list[tuple[Path, int]], buf: bytearray) -> int:
        total = 0
        fds: dict[Path, int] = {}
        try:
            for p, off in part:
                fd = fds.get(p) or fds.setdefault(p, os.open(p, os.O_RDONLY))
                total += os.preadv(fd, [buf], off)
        finally:
            for fd in fds.values():
                os.close(fd)
        return total

    if threads == 1:
        return work(jobs, BUFS[0])
    with ThreadPoolExecutor(threads) as ex:  # interleaved ranges: every thread reads sequentially-ish
        return sum(ex.map(work, [jobs[i::threads] for i in range(threads)], BUFS[:threads]))


def safetensors_peer(folder: Path, names: list[str], weight_map: dict[str, str], device: str) -> int:
    from safetensors import safe_open

    total = 0
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(weight_map[n], []).append(n)
    for fname, ns in by_file.items():
        with safe_open(folder / fname, "pt", device=device) as f:
            for n in ns:
                t = f.get_tensor(n)
                total += t.numel() * t.element_size()
                del t
    return total


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t0) * 1e3


def fs_type(path: Path) -> str:
    """Filesystem of the longest mount point containing path (tmpfs would make 'disk' reads memory reads)."""
    path = os.path.abspath(path)
    best = ("", "?")
    for ln in open("/proc/mounts"):
        mnt, kind = ln.split()[1], ln.split()[2]
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
            best = (mnt, kind)
    return f"{best[1]} on {best[0]}"


def sanity(tmp: Path) -> int:
    """The GPU path (pinned staging, direct and converting copies) equals the CPU path, tensor for tensor."""
    write_random_target(tmp, presets.target_config("tiny"), seed=5, max_shard_bytes=100_000)
    n = 0
    for dtype in (torch.bfloat16, torch.float32):
        ref = load_target(tmp, dtype, "cpu").state_dict()
        got = load_target(tmp, dtype, "cuda").state_dict()
        for k, v in ref.items():
            if not torch.equal(got[k].cpu(), v):
                raise AssertionError(f"GPU load differs from CPU load at {k} ({dtype})")
            n += 1
    return n


def verify(model, folder: Path) -> int:
    """Loaded GPU tensors equal the file bytes: all non-expert tensors, experts 0, E/2, E-1 of every layer."""
    cfg = model.cfg
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    n = 0
    with ShardedReader(folder) as r:
        for t, _ in plan_target(cfg, r, check_values=False).items:
            if t.expert is not None and t.expert not in (0, E // 2, E - 1):
                continue
            dst = state[t.dst]
            if t.expert is not None:
                dst = dst[t.expert, t.rows[0] : t.rows[1]]
            if not torch.equal(dst.cpu(), r.view(t.name).to(dst.dtype)):
                raise AssertionError(f"{t.name} differs after loading")
            n += 1
    assert inter > 0
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="kimi-k2.6", choices=presets.PRESETS)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu runs the whole flow as a dry run (no GPU numbers)")
    ap.add_argument("--dir", default=".bench_load_ckpt", help="checkpoint folder on the local disk")
    ap.add_argument("--results", default="bench/results/load.jsonl")
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=150.0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    left = lambda: args.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    folder = Path(args.dir)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "none (cpu dry run)"
    env = {"gpu": gpu, "torch": torch.__version__, "python": platform.python_version(), "commit": args.commit}
    rows: list[dict] = []

    def emit(name, ms, floor_ms, peers, params):
        row = {"name": name, "params": params, **env, "ms": round(ms, 1),
               "floor_ms": None if floor_ms is None else round(floor_ms, 1),
               "ratio": None if floor_ms is None else round(floor_ms / ms, 3), "peers": peers}
        rows.append(row)
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    if args.device.startswith("cuda"):
        n_sane = sanity(folder.parent / (folder.name + "_tiny"))
        print(f"sanity: {n_sane} tensors equal between GPU and CPU loads", flush=True)
    else:  # warm up torch's one-time meta-device imports outside the timed region
        tiny = folder.parent / (folder.name + "_tiny")
        write_random_target(tiny, presets.target_config("tiny"), seed=5)
        load_target(tiny, torch.float32, "cpu")

    cfg_dict = presets.target_config(args.preset, layers=args.layers)
    t0 = time.perf_counter()
    write_random_target(folder, cfg_dict, seed=0, max_shard_bytes=4 << 30, fast_int4=True)
    write_s = time.perf_counter() - t0
    files = shards(folder)
    nbytes = sum(p.stat().st_size for p in files)
    fs = fs_type(folder)
    cfg = KimiConfig.from_dict(cfg_dict)
    wmap = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with ShardedReader(folder) as r:
        names = [t.name for t, _ in plan_target(cfg, r, check_values=False).items]
    base = {"preset": args.preset, "layers": args.layers, "file_bytes": nbytes, "shards": len(files),
            "tensors_loaded": len(names), "workers": args.workers, "dtype": "bfloat16", "fs": fs,
            "write_s": round(write_s, 1), "write_gb_s": round(nbytes / write_s / 1e9, 2)}
    print(json.dumps(base), flush=True)

    BUFS.extend(bytearray(CHUNK) for _ in range(args.workers))
    can_drop = args.device.startswith("cuda")  # never drop a shared dev box's page cache in a dry run
    est = [write_s]  # seconds one pass over the files may take (write time, then the slowest pass seen)

    def maybe(fn, cold: bool):
        """Run one timed pass if the budget covers it (after dropping the page cache for cold passes)."""
        if left() < 1.5 * max(est) + 5:
            return None, None
        if cold:
            drop_cache(files)
        out, ms = timed(fn)
        est.append(ms / 1e3)
        return out, ms

    for mode in ("cold", "warm") if can_drop else ("warm",):
        cold = mode == "cold"
        model, ms = maybe(lambda: load_target(folder, torch.bfloat16, args.device, workers=args.workers), cold)
        if model is None:
            print(f"budget spent: {mode} runs skipped", flush=True)
            break
        rep = model.load_report
        checked = verify(model, folder) if cold else None
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raw1 = maybe(lambda: raw_read(files, 1), cold)[1]
        rawn = maybe(lambda: raw_read(files, args.workers), cold)[1]
        floor = min((x for x in (raw1, rawn) if x is not None), default=None)
        peers = {"raw_read_1thread_ms": raw1 and round(raw1, 1),
                 f"raw_read_{args.workers}threads_ms": rawn and round(rawn, 1)}
        moved, peer_ms = maybe(lambda: safetensors_peer(folder, names, wmap, args.device), cold)
        if peer_ms is not None:
            peers |= {"safetensors_safe_open_ms": round(peer_ms, 1),
                      "safetensors_gb_s": round(moved / peer_ms / 1e6, 2)}
        params = base | {"cache": DROPPED_BY[-1] if cold and DROPPED_BY else "warm",
                         "loaded_bytes": rep.bytes, "gb_s": round(rep.bytes / ms / 1e6, 2),
                         "disk_floor_gb_s": floor and round(nbytes / floor / 1e6, 2), "verified_tensors": checked}
        emit(f"load_target_{mode}", ms, floor, peers, params)

    print(f"\n{'run':<20}{'GB':>8}{'load ms':>10}{'GB/s':>8}{'disk floor ms':>15}{'ratio':>7}{'safetensors ms':>16}")
    for r in rows:
        p = r["params"]
        nan = float("nan")
        floor, ratio = (nan if r[k] is None else r[k] for k in ("floor_ms", "ratio"))
        print(f"{r['name']:<20}{p['loaded_bytes'] / 1e9:>8.2f}{r['ms']:>10.0f}{p['gb_s']:>8.2f}"
              f"{floor:>15.0f}{ratio:>7.2f}{r['peers'].get('safetensors_safe_open_ms') or nan:>16.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
