"""Tokenizers behind one interface. Today: Kimi's tiktoken-format `tiktoken.model` + tokenizer_config.json.

`tiktoken.model` lines are `base64(token bytes) rank`; special tokens come from tokenizer_config.json
`added_tokens_decoder` (id -> {content, special}). When every rank is a single byte (the byte-level
vocabulary `ddtree init-random` writes) encoding is exact byte lookup. A BPE vocabulary is encoded like
tiktoken: the text is pre-split by a regular expression (tokenizer_config.json `pat_str`, default
`PAT_STR`; Kimi folders, whose tokenizer_config.json carries no pattern, get Kimi's own `KIMI_PAT_STR`;
patterns with Unicode properties or class intersections are compiled with the `regex` module), then
within each piece the adjacent pair whose
concatenation has the lowest rank is merged until none is in the vocabulary. Pieces are cached.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import regex

# cl100k-style pre-split in Python `re` syntax: contractions, identifiers (letters, digits after the
# first, underscores; one leading non-word char such as a space or '.'), 1-3 digit numbers, punctuation
# runs with trailing newlines, newlines with the spaces before them, then other whitespace runs
# (a run before a word leaves its last space to the word, so indentation is its own piece).
PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?[^\W\d]\w*|\d{1,3}| ?[^\s\w]+[\r\n]*|\s*[\r\n]|"""
           r"""\s+(?!\S)|\s+""")
# Kimi K2.x pre-split (the format's pattern, from its tokenization_kimi.py): Han runs, cased letter runs
# that exclude Han (class intersections), 1-3 digit numbers, punctuation, newlines, whitespace.
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
_CACHE_MAX = 1 << 16  # cached pieces


def compile_split(pattern: str):
    """Python `re` for plain patterns; the `regex` module (V1: set intersection) for \\p{..} or `&&`."""
    if "\\p{" in pattern or "&&" in pattern:
        return regex.compile(pattern, regex.V1)
    return re.compile(pattern)


class Tokenizer:
    def __init__(self, ranks: dict[bytes, int], specials: dict[int, str], pattern: str | None = None):
        self.ranks = ranks
        self.specials = specials
        self.decoder = {v: k for k, v in ranks.items()}
        self.special_ids = {v: k for k, v in specials.items()}
        self.byte_level = len(ranks) == 256 and all(len(k) == 1 for k in ranks)
        self.pattern = pattern if pattern is not None else (None if self.byte_level else PAT_STR)
        self._split = compile_split(self.pattern) if self.pattern else None
        self._byte_ids = [ranks.get(bytes([b]), -1) for b in range(256)]  # used when byte_level
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return max([*self.decoder, *self.specials]) + 1

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / "tiktoken.model"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no tokenizer (tiktoken.model) in the model folder")
        ranks = {}
        for line in path.read_text().splitlines():
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
        specials = {}
        pattern = None
        cfg = folder / "tokenizer_config.json"
        if cfg.exists():
            conf = json.loads(cfg.read_text())
            for k, v in conf.get("added_tokens_decoder", {}).items():
                specials[int(k)] = v["content"]
            pattern = conf.get("pat_str")
            if pattern is None and (len(ranks) > 100_000 or (folder / "tokenization_kimi.py").exists()):
                pattern = KIMI_PAT_STR  # a Kimi tiktoken folder: the pattern lives in its Python code
        return cls(ranks, specials, pattern)

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return [self._byte_ids[b] for b in text.encode("utf-8")]
        out: list[int] = []
        cache = self._cache
        for piece in self._split.findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._merge(piece.encode("utf-8"))
                if len(cache) < _CACHE_MAX:
                    cache[piece] = ids
            out.extend(ids)
        return out

    def _merge(self, data: bytes) -> list[int]:
        """tiktoken's byte-pair merge of one piece: repeatedly join the lowest-ranked adjacent pair."""
        rank = self.ranks.get(data)
        if rank is not None:
            return [rank]
        parts = [data[i : i + 1] for i in range(len(data))]
        ranks = self.ranks
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        return [ranks[p] for p in parts]

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.decoder.get(i, b"") for i in ids if i not in self.specials)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def write(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(self.ranks.items(),
                                                                                      key=lambda x: x[1])]
        (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
        cfg = {"tokenizer_class": "TikTokenTokenizer",
               "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in self.specials.items()},
               "bos_token": self.specials.get(min(self.specials), None) if self.specials else None}
        if self.pattern is not None:
            cfg["pat_str"] = self.pattern
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def byte_tokenizer(vocab_size: int, named_specials: dict[int, str]) -> Tokenizer:
    """The 256 bytes as ranks 0..255; every id from 256 to vocab_size-1 is a special token."""
    specials = {i: named_specials.get(i, f"<|reserved_token_{i}|>") for i in range(256, vocab_size)}
    return Tokenizer({bytes([b]): b for b in range(256)}, specials)
