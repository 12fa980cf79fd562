"""The gateway's tokenizer interface and its loader: one API over Kimi's tiktoken folders and Hugging Face
`tokenizer.json` folders.

A `TextTokenizer` turns text into token ids (special-token strings such as "<|im_end|>" become their
ids, as Hugging Face tokenizers do with added tokens), gives the exact bytes of every token (so that
incremental detokenization can hold back a character split across tokens, `gateway.detokenizer`),
names its special and end-of-sequence tokens, and carries the folder's Jinja chat template source.

- `TiktokenTextTokenizer`: `tiktoken.model` + `tokenizer_config.json` (+ `chat_template.jinja`), the
  Kimi K2 / K2.5 / K2.6 format, on top of `gateway.tokenizer.Tokenizer`.
- `HFTextTokenizer` (`gateway.hf_tokenizer`): `tokenizer.json` through the `tokenizers` package.

`load_text_tokenizer(folder)` picks by the files present (tiktoken.model first). End-of-sequence ids
come from `tokenizer_config.json` `eos_token` and `generation_config.json` `eos_token_id`; chat
requests also stop at the end-of-message marker the template uses (`CHAT_END_MARKERS`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

from gateway.tokenizer import Tokenizer
from gateway.tokenizer_files import TokenizerFiles, find_tokenizer_files

# end-of-message markers of common chat templates: a chat turn stops at the first one in the vocabulary
CHAT_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end_of_turn|>", "<end_of_turn>", "<|end|>")


class TextTokenizer(Protocol):
    kind: str  # "tiktoken" | "huggingface"
    vocab_size: int
    chat_template: str | None  # Jinja source, None when the folder has none
    bos_token: str | None
    eos_token: str | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids. `add_special_tokens`: what
        transformers' `tokenizer(text)` adds around a text (a BOS for some Hugging Face tokenizers)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for in generated text (b"" for special tokens and unknown ids)."""
        ...

    def special_id(self, content: str) -> int | None:
        """Id of the special token spelled `content`, or None."""
        ...

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids named by the folder's config files."""
        ...


def decode(tok: TextTokenizer, ids: list[int]) -> str:
    """Whole-sequence decode (special tokens skipped, invalid UTF-8 as U+FFFD)."""
    return b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


def chat_stop_ids(tok: TextTokenizer) -> tuple[int, ...]:
    """End-of-message marker ids present in the vocabulary (see CHAT_END_MARKERS)."""
    return tuple(i for i in (tok.special_id(m) for m in CHAT_END_MARKERS) if i is not None)


def generation_config_eos(folder: Path) -> tuple[int, ...]:
    """`eos_token_id` of generation_config.json (an int or a list), when the file exists."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        v = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object ({e})") from None
    vals = v if isinstance(v, list) else [v]
    return tuple(int(x) for x in vals if isinstance(x, int) and not isinstance(x, bool))


class TiktokenTextTokenizer:
    """Kimi's format: ranks from tiktoken.model, specials and chat template from tokenizer_config.json."""

    kind = "tiktoken"

    def __init__(self, files: TokenizerFiles, base: Tokenizer | None = None):
        self.files = files
        self.base = base if base is not None else Tokenizer.load(files.folder)
        self.vocab_size = self.base.vocab_size
        self.chat_template = files.chat_template
        self.bos_token, self.eos_token = files.bos_token, files.eos_token
        self._by_content = {c: i for i, c in self.base.specials.items()}
        # longest first, so that a special token that is a prefix of another never wins
        names = sorted(self._by_content, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None
        self._eos = tuple(dict.fromkeys(
            [*(i for i in [self.special_id(self.eos_token)] if i is not None), *generation_config_eos(files.folder)]))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens` adds nothing: Kimi's tokenizer puts no BOS in front of a text (its chat
        template writes every marker itself)."""
        out: list[int] = []
        if self._special_re is None:
            return out + self.base.encode(text)
        at = 0
        for m in self._special_re.finditer(text):
            if m.start() > at:
                out += self.base.encode(text[at : m.start()])
            out.append(self._by_content[m.group(0)])
            at = m.end()
        if at < len(text):
            out += self.base.encode(text[at:])
        return out

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self.base.specials:
            return b""
        return self.base.decoder.get(token_id, b"")

    def special_id(self, content: str | None) -> int | None:
        return self._by_content.get(content) if content is not None else None

    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos


def load_text_tokenizer(folder: str | Path) -> TextTokenizer:
    """The tokenizer of a model folder: tiktoken.model (Kimi) or tokenizer.json (Hugging Face)."""
    folder = Path(folder)
    if (folder / "tiktoken.model").is_file():
        return TiktokenTextTokenizer(find_tokenizer_files(folder))
    if (folder / "tokenizer.json").is_file():
        from gateway.hf_tokenizer import HFTextTokenizer

        return HFTextTokenizer.load(folder)
    raise FileNotFoundError(f"{folder}: no tokenizer (expected tiktoken.model with tokenizer_config.json, "
                            "or a Hugging Face tokenizer.json)")
