"""Hugging Face `tokenizer.json` folders behind the gateway's `TextTokenizer` interface.

Encoding is the `tokenizers` package's (added tokens in the text are matched as such). For streaming,
the gateway needs each token's exact bytes, which `tokenizers` only exposes as decoded strings; the
table is rebuilt from the vocabulary and the decoder named in tokenizer.json:
- `ByteLevel` (GPT-2 style byte-level BPE): every character of a token maps back to one byte through
  GPT-2's bytes<->unicode table, so a character split across tokens is split in bytes, as generated;
- otherwise (sentencepiece style): `<0xNN>` tokens are that byte when the decoder has `ByteFallback`,
  and "▁" is a space when it has `Metaspace` or a `Replace` of "▁". (The leading-space `Strip` of such
  decoders is not applied: streamed text keeps the space a word-initial token carries.)
Special added tokens have no bytes (skipped in text, as `skip_special_tokens=True`).
`tokenizer_config.json` (when present) gives the chat template, bos/eos tokens; `chat_template.jinja`
wins over it, as in transformers.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

from gateway.text_tokenizer import generation_config_eos

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's unicode -> byte table (the inverse of `bytes_to_unicode`)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_types(spec: dict | None) -> set[str]:
    if not spec:
        return set()
    if spec.get("type") == "Sequence":
        return set().union(*(_decoder_types(d) for d in spec.get("decoders", [])))
    if spec.get("type") == "Replace" and (spec.get("pattern") or {}).get("String") == "▁":
        return {"Replace▁"}
    return {spec.get("type", "")}


def _content(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


class HFTextTokenizer:
    kind = "huggingface"

    def __init__(self, tk, spec: dict, config: dict, chat_template: str | None, folder: Path | None = None):
        self.tk = tk  # tokenizers.Tokenizer
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.bos_token, self.eos_token = _content(config.get("bos_token")), _content(config.get("eos_token"))
        added = spec.get("added_tokens") or []
        self._special = {a["content"]: a["id"] for a in added if a.get("special")}
        self._added_plain = {a["id"]: a["content"].encode() for a in added if not a.get("special")}
        self._bytes = self._table(tk.get_vocab(with_added_tokens=False), _decoder_types(spec.get("decoder")))
        for i in self._special.values():  # a special token may also sit in the model's vocabulary
            self._bytes.pop(i, None)
        eos = [self._special.get(self.eos_token)] if self.eos_token else []
        self._eos = tuple(dict.fromkeys([*(i for i in eos if i is not None),
                                         *(generation_config_eos(folder) if folder else ())]))

    @classmethod
    def load(cls, folder: str | Path) -> HFTextTokenizer:
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            spec = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        tk = Tokenizer.from_str(json.dumps(spec))
        config: dict = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # [{name, template}]: the default one
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        return cls(tk, spec, config, template, folder)

    @staticmethod
    def _table(vocab: dict[str, int], decoders: set[str]) -> dict[int, bytes]:
        table: dict[int, bytes] = {}
        if "ByteLevel" in decoders:
            bd = byte_decoder()
            for piece, i in vocab.items():
                try:
                    table[i] = bytes(bd[c] for c in piece)
                except KeyError:  # a piece outside the byte alphabet: take its characters as they are
                    table[i] = piece.encode()
            return table
        space = bool({"Metaspace", "Replace▁"} & decoders)
        fallback = "ByteFallback" in decoders
        for piece, i in vocab.items():
            m = _BYTE_TOKEN.match(piece) if fallback else None
            if m:
                table[i] = bytes([int(m.group(1), 16)])
            else:
                table[i] = (piece.replace("▁", " ") if space else piece).encode()
        return table

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def token_bytes(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is not None:
            return b
        return self._added_plain.get(token_id, b"")

    def special_id(self, content: str | None) -> int | None:
        return self._special.get(content) if content is not None else None

    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos
