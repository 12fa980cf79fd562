"""Token streams for training and evaluation, and the random-window batch sampler.

`build` encodes the corpus (training.corpus) with the trained tokenizer once, on the CPU: every file
becomes its tokens followed by [EOS], files are concatenated in sorted order, and the two streams are
saved as uint16 `.npy` (train.npy, heldout.npy) with a meta.json. Training samples random windows
of seq+1 tokens from the train stream with a seeded generator; evaluation walks held-out windows in
order, so its numbers are deterministic.

  python -m training.data --tokenizer models/kimi-mini/target --out runs/data
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from gateway.tokenizer import Tokenizer


def encode_files(tok: Tokenizer, texts: list[str], eos: int) -> np.ndarray:
    out: list[int] = []
    for t in texts:
        out.extend(tok.encode(t))
        out.append(eos)
    if max(out) >= 1 << 16:
        raise ValueError("vocabulary does not fit uint16")
    return np.asarray(out, dtype=np.uint16)


def build(tokenizer_dir: str | Path, out: str | Path, root: str | None = None) -> dict:
    from training.corpus import describe, list_files, read_texts

    tok = Tokenizer.load(tokenizer_dir)
    eos = tok.special_ids["[EOS]"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held = list_files(root)
    t0 = time.time()
    meta = describe(root)
    for name, files in (("train", train), ("heldout", held)):
        texts = read_texts(files)
        arr = encode_files(tok, texts, eos)
        np.save(out / f"{name}.npy", arr)
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        meta[f"{name}_tokens"] = int(arr.size)
        meta[f"{name}_bytes_per_token"] = round(nbytes / max(1, arr.size - len(texts)), 3)
    meta["eos"] = eos
    meta["seconds"] = round(time.time() - t0, 1)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


class WindowSampler:
    """Random [B, seq+1] windows of a token stream (inputs = [:, :-1], labels = [:, 1:])."""

    def __init__(self, tokens: np.ndarray, seq: int, seed: int = 0):
        if tokens.size <= seq + 1:
            raise ValueError(f"stream of {tokens.size} tokens is shorter than a window of {seq + 1}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq = seq
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch: int, device) -> torch.Tensor:
        starts = torch.randint(0, self.tokens.numel() - self.seq - 1, (batch,), generator=self.gen)
        idx = starts[:, None] + torch.arange(self.seq + 1)[None, :]
        return self.tokens[idx].to(device, non_blocking=True)

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def load_state(self, st: torch.Tensor) -> None:
        self.gen.set_state(st)


def heldout_windows(tokens: np.ndarray, seq: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping [N, seq+1] windows in order (the evaluation set)."""
    t = torch.from_numpy(tokens.astype(np.int64))
    n = (t.numel() - 1) // seq
    if max_windows is not None:
        n = min(n, max_windows)
    return torch.stack([t[i * seq : i * seq + seq + 1] for i in range(n)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="folder with tiktoken.model + tokenizer_config.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", default=None)
    args = ap.parse_args(argv)
    print(json.dumps(build(args.tokenizer, args.out, args.root)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
