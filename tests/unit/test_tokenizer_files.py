"""Tokenizer files of a Kimi folder: tiktoken.model + tokenizer_config.json (special tokens, chat template)."""

from __future__ import annotations

import json

import pytest

from gateway.tokenizer_files import find_tokenizer_files

TEMPLATE = "{%- for message in messages -%}<|im_{{ message.role }}|>{{ message.content }}<|im_end|>{%- endfor -%}"


def kimi_folder(tmp_path, **conf):
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")
    base = {"added_tokens_decoder": {"163584": {"content": "[BOS]", "special": True},
                                     "163585": {"content": "[EOS]", "special": True},
                                     "163586": {"content": "<|im_end|>", "special": True}},
            "bos_token": "[BOS]", "eos_token": {"content": "[EOS]", "lstrip": False}, "pad_token": "[PAD]",
            "tokenizer_class": "TikTokenTokenizer", "chat_template": TEMPLATE}
    base.update(conf)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(base))
    return tmp_path


def test_finds_files_specials_and_template(tmp_path):
    f = find_tokenizer_files(kimi_folder(tmp_path))
    assert f.tiktoken_model == tmp_path / "tiktoken.model" and f.tokenizer_config == tmp_path / "tokenizer_config.json"
    assert f.special_tokens[163586] == "<|im_end|>"
    assert (f.bos_token, f.eos_token) == ("[BOS]", "[EOS]")
    assert f.token_id(f.eos_token) == 163585 and f.token_id("[PAD]") is None
    assert f.chat_template == TEMPLATE and f.chat_template_path == tmp_path / "tokenizer_config.json"


def test_jinja_file_wins_and_named_templates(tmp_path):
    kimi_folder(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert find_tokenizer_files(tmp_path).chat_template == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    f = find_tokenizer_files(tmp_path)
    assert f.chat_template == "J" and f.chat_template_path == tmp_path / "chat_template.jinja"


def test_errors_name_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tiktoken.model: no tiktoken.model .*found \['tokenizer.json'\]"):
        find_tokenizer_files(tmp_path)
    kimi_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        find_tokenizer_files(tmp_path)
    kimi_folder(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}])
    with pytest.raises(ValueError, match="no entry named 'default'"):
        find_tokenizer_files(tmp_path)


def test_init_random_tiny_folder_has_tokenizer(tiny_dirs):
    f = find_tokenizer_files(tiny_dirs[0])
    assert f.tiktoken_model.exists() and f.special_tokens[257] == "[EOS]"
