"""Tokenizers behind one interface. Today: Kimi's tiktoken-format `tiktoken.model` + tokenizer_config.json.

`tiktoken.model` lines are `base64(token bytes) rank`; special tokens come from tokenizer_config.json
`added_tokens_decoder` (id -> {content, special}). When every rank is a single byte (the byte-level
vocabulary `ddtree init-random` writes) encoding is exact byte lookup; merges for real BPE ranks are
applied greedily by rank (the tiktoken algorithm).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path


class Tokenizer:
    def __init__(self, ranks: dict[bytes, int], specials: dict[int, str]):
        self.ranks = ranks
        self.specials = specials
        self.decoder = {v: k for k, v in ranks.items()}
        self.special_ids = {v: k for k, v in specials.items()}

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
        cfg = folder / "tokenizer_config.json"
        if cfg.exists():
            for k, v in json.loads(cfg.read_text()).get("added_tokens_decoder", {}).items():
                specials[int(k)] = v["content"]
        return cls(ranks, specials)

    def encode(self, text: str) -> list[int]:
        return self._merge([self.ranks[bytes([b])] for b in text.encode("utf-8")])

    def _merge(self, ids: list[int]) -> list[int]:
        if all(len(self.decoder[i]) == 1 for i in ids) and len(self.ranks) == 256:
            return ids
        parts = [self.decoder[i] for i in ids]
        while len(parts) > 1:
            best = min(((self.ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)
                        if parts[i] + parts[i + 1] in self.ranks), default=None)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return [self.ranks[p] for p in parts]

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
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def byte_tokenizer(vocab_size: int, named_specials: dict[int, str]) -> Tokenizer:
    """The 256 bytes as ranks 0..255; every id from 256 to vocab_size-1 is a special token."""
    specials = {i: named_specials.get(i, f"<|reserved_token_{i}|>") for i in range(256, vocab_size)}
    return Tokenizer({bytes([b]): b for b in range(256)}, specials)
