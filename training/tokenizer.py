"""Train a byte-level BPE tokenizer and write it in Kimi's layout (tiktoken.model + tokenizer_config.json).

Algorithm (GPT-2 / tiktoken style): text is pre-split by a regular expression (`PAT_STR`, which
Python's `re` supports; recorded in tokenizer_config.json as `pat_str`), each piece is taken as UTF-8
bytes, and merges are learned over the distinct pieces weighted by frequency. Ranks 0..255 are the
single bytes; merge m gets rank 256 + m, so tiktoken's rank-ordered merging re-derives the pieces.
Ids from `vocab_size - 64` up are special tokens, laid out like Kimi's (`[BOS]`, `[EOS]`,
`<|im_end|>`, ..., reserved tokens) with the DFlash drafter's mask token at `vocab_size - 2`.

  python -m training.tokenizer --vocab-size 4096 --out models/kimi-mini/target
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time
from pathlib import Path

from gateway.tokenizer import PAT_STR, Tokenizer

NUM_SPECIALS = 64
SPECIAL_NAMES = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>", "<|start_header_id|>", "<|end_header_id|>", "[EOT]"]
MASK_NAME = "<|dflash_mask|>"


def special_tokens(vocab_size: int) -> dict[int, str]:
    """The last NUM_SPECIALS ids: named specials first, the drafter mask at vocab_size - 2, the rest reserved."""
    first = vocab_size - NUM_SPECIALS
    out = {first + i: f"<|reserved_token_{first + i}|>" for i in range(NUM_SPECIALS)}
    for i, name in enumerate(SPECIAL_NAMES):
        out[first + i] = name
    out[vocab_size - 2] = MASK_NAME
    return out


def piece_counts(texts, pattern: str = PAT_STR) -> collections.Counter:
    rx = re.compile(pattern)
    counts: collections.Counter = collections.Counter()
    for t in texts:
        counts.update(rx.findall(t))
    return counts


def train_bpe(counts: collections.Counter, num_merges: int, log_every: int = 500) -> list[bytes]:
    """Learn merges over weighted pieces -> the vocabulary as a list of byte strings, index = rank.

    Incremental pair counts: each merge touches only the distinct pieces that contain the pair.
    Ties are broken by the smallest (left id, right id), so the result is deterministic.
    """
    vocab = [bytes([b]) for b in range(256)]
    index = {v: i for i, v in enumerate(vocab)}
    words = [list(p.encode("utf-8")) for p in counts]
    freqs = list(counts.values())
    pair_count: collections.Counter = collections.Counter()
    where: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for wi, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += freqs[wi]
            where[(a, b)].add(wi)
    t0 = time.time()
    merges = 0
    while merges < num_merges and pair_count:
        best = max(pair_count.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))[0]
        if pair_count[best] < 2:
            break
        new_bytes = vocab[best[0]] + vocab[best[1]]
        new_id = index.get(new_bytes)
        if new_id is None:  # the same bytes can arise from two different pairs: keep one rank
            new_id = len(vocab)
            vocab.append(new_bytes)
            index[new_bytes] = new_id
            merges += 1
        for wi in sorted(where.pop(best, ())):
            w, f = words[wi], freqs[wi]
            for a, b in zip(w, w[1:]):
                pair_count[(a, b)] -= f
                if pair_count[(a, b)] <= 0:
                    del pair_count[(a, b)]
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            for a, b in zip(out, out[1:]):
                pair_count[(a, b)] += f
                where[(a, b)].add(wi)
        pair_count.pop(best, None)
        if log_every and merges % log_every == 0:
            print(f"merge {merges}/{num_merges}: {new_bytes!r} ({time.time() - t0:.0f}s)", flush=True)
    return vocab


def build(texts, vocab_size: int) -> Tokenizer:
    num_merges = vocab_size - NUM_SPECIALS - 256
    if num_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for 256 bytes + {NUM_SPECIALS} specials")
    vocab = train_bpe(piece_counts(texts), num_merges)
    ranks = {v: i for i, v in enumerate(vocab)}
    return Tokenizer(ranks, special_tokens(vocab_size), pattern=PAT_STR)


def main(argv: list[str] | None = None) -> int:
    from training.corpus import list_files, read_texts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--root", default=None, help="standard library folder (default: this interpreter's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    train, _ = list_files(args.root)
    t0 = time.time()
    tok = build(read_texts(train), args.vocab_size)
    tok.write(args.out)
    extra = json.loads((Path(args.out) / "tokenizer_config.json").read_text())
    print(json.dumps({"vocab_size": tok.vocab_size, "ranks": len(tok.ranks), "specials": len(tok.specials),
                      "train_files": len(train), "seconds": round(time.time() - t0, 1),
                      "pat_str": extra.get("pat_str")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
