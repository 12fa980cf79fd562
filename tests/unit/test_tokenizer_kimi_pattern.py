"""Kimi's tiktoken folders carry no pre-split pattern in tokenizer_config.json; we use Kimi's (Han-aware,
class intersections) through the `regex` module."""

from __future__ import annotations

import base64
import json

from gateway.tokenizer import KIMI_PAT_STR, Tokenizer, compile_split


def test_kimi_split_han_and_cased_runs():
    pieces = compile_split(KIMI_PAT_STR).findall("Hello世界 it's 123456 ÉCOLE éte\n\n  x")
    assert pieces == ["Hello", "世界", " it's", " ", "123", "456", " ÉCOLE", " éte", "\n\n", " ", " x"]


def test_kimi_folder_gets_kimi_pattern(tmp_path):
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n"
                                                     for b in range(256)))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {}}))
    (tmp_path / "tokenization_kimi.py").write_text("# marker: the Kimi remote-code tokenizer\n")
    tok = Tokenizer.load(tmp_path)
    assert tok.pattern == KIMI_PAT_STR
    text = "混合 text, 数字 42!"
    assert tok.decode(tok.encode(text)) == text
