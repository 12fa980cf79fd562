"""Find a Kimi model folder's tokenizer files and the pieces of tokenizer_config.json the gateway needs.

Kimi K2 / K2.5 / K2.6 ship `tiktoken.model` (lines `base64(token bytes) rank`) and
`tokenizer_config.json` (`added_tokens_decoder` id -> {content, special}, `bos_token`, `eos_token`,
`pad_token`, and the Jinja `chat_template`). Newer folders may keep the template in
`chat_template.jinja` instead; that file wins when both exist (as in Hugging Face transformers).
A `chat_template` given as a list of {name, template} picks the one named "default".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

TIKTOKEN = "tiktoken.model"
CONFIG = "tokenizer_config.json"
TEMPLATE = "chat_template.jinja"


@dataclass(frozen=True)
class TokenizerFiles:
    folder: Path
    tiktoken_model: Path
    tokenizer_config: Path | None
    chat_template: str | None  # Jinja source
    chat_template_path: Path | None  # the file it came from
    special_tokens: dict[int, str] = field(default_factory=dict)  # id -> content
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    config: dict = field(default_factory=dict, repr=False)  # the whole tokenizer_config.json

    def token_id(self, content: str | None) -> int | None:
        if content is None:
            return None
        return next((i for i, c in self.special_tokens.items() if c == content), None)


def _content(v) -> str | None:
    """bos/eos entries are either a string or an AddedToken dict {"content": ...}."""
    if isinstance(v, dict):
        return v.get("content")
    return v


def find_tokenizer_files(folder: str | Path) -> TokenizerFiles:
    """Locate and parse the tokenizer files of a model folder; errors name the file."""
    folder = Path(folder)
    tk = folder / TIKTOKEN
    if not tk.is_file():
        present = sorted(p.name for p in folder.glob("*token*")) if folder.is_dir() else []
        raise FileNotFoundError(f"{tk}: no tiktoken.model in the model folder"
                                + (f" (found {present})" if present else ""))
    cfg_path = folder / CONFIG
    conf: dict = {}
    if cfg_path.is_file():
        try:
            conf = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
        if not isinstance(conf, dict):
            raise ValueError(f"{cfg_path}: expected a JSON object")
    specials: dict[int, str] = {}
    for k, v in (conf.get("added_tokens_decoder") or {}).items():
        try:
            specials[int(k)] = v["content"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{cfg_path}: bad added_tokens_decoder entry {k!r}: {v!r}") from None
    template, template_path = None, None
    if (folder / TEMPLATE).is_file():
        template, template_path = (folder / TEMPLATE).read_text(), folder / TEMPLATE
    elif conf.get("chat_template"):
        ct = conf["chat_template"]
        if isinstance(ct, list):
            named = {t.get("name"): t.get("template") for t in ct if isinstance(t, dict)}
            ct = named.get("default")
            if ct is None:
                raise ValueError(f"{cfg_path}: chat_template list has no entry named 'default' "
                                 f"(names: {sorted(n for n in named if n)})")
        template, template_path = ct, cfg_path
    return TokenizerFiles(folder=folder, tiktoken_model=tk, tokenizer_config=cfg_path if conf else None,
                          chat_template=template, chat_template_path=template_path, special_tokens=specials,
                          bos_token=_content(conf.get("bos_token")), eos_token=_content(conf.get("eos_token")),
                          pad_token=_content(conf.get("pad_token")), config=conf)
