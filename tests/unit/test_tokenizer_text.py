"""The gateway's tokenizer interface over both formats: Kimi's tiktoken.model + tokenizer_config.json and
Hugging Face tokenizer.json. Specials in text, exact token bytes (a character split across tokens),
EOS ids from the config files, streamed text that never breaks a character."""

from __future__ import annotations

import base64
import json

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway.text_tokenizer import chat_stop_ids, decode, load_text_tokenizer
from gateway.tokenizer import Tokenizer

TEXT = "héllo 日本語 🙂 naïve"


def kimi_bpe_folder(path, **conf):
    """A tiktoken vocabulary with merges that cut multi-byte characters: 'é' whole, '日' as 2 + 1 bytes."""
    ranks = {bytes([b]): b for b in range(256)}
    for extra in ("é".encode(), "日".encode()[:2], b"he", b"hel", b"hell", b"hello", " 日".encode()[:3]):
        ranks.setdefault(extra, len(ranks))
    specials = {300: "[BOS]", 301: "[EOS]", 302: "<|im_end|>", 303: "<|im_user|>", 304: "<|im_end|>x"}
    Tokenizer(ranks, specials).write(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update({"eos_token": "[EOS]", "chat_template": "{{ messages[0]['content'] }}", **conf})
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def hf_folder(path, **conf):
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = HF(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["hello world, héllo wörld! 日本語 is fun. " * 20], trainer=trainer)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", **conf}))
    return path


@pytest.fixture(params=["tiktoken", "huggingface"])
def tok(request, tmp_path):
    folder = kimi_bpe_folder(tmp_path) if request.param == "tiktoken" else hf_folder(tmp_path)
    t = load_text_tokenizer(folder)
    assert t.kind == request.param
    return t


def test_round_trip_and_specials_in_text(tok):
    ids = tok.encode(TEXT)
    assert decode(tok, ids) == TEXT
    im_end = tok.special_id("<|im_end|>")
    assert im_end is not None
    ids = tok.encode("hi<|im_end|>yo")
    assert im_end in ids and decode(tok, ids) == "hiyo"  # specials carry no text


def test_a_character_split_across_tokens_is_held_back(tok):
    ids = tok.encode(TEXT)
    pieces = [tok.token_bytes(i) for i in ids]
    assert any(_splits_a_character(p) for p in pieces), pieces  # the vocabulary does cut characters
    detok = IncrementalDetokenizer(tok.token_bytes)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == TEXT and not any("\ufffd" in d for d in deltas)


def _splits_a_character(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_eos_ids_from_config_files(tok, tmp_path):
    eos = tok.eos_token_ids()
    assert eos == (tok.special_id(tok.eos_token),)
    assert chat_stop_ids(tok) == (tok.special_id("<|im_end|>"),)


def test_generation_config_eos_and_jinja_file(tmp_path):
    folder = kimi_bpe_folder(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [302, 301]}))
    (folder / "chat_template.jinja").write_text("J")
    t = load_text_tokenizer(folder)
    assert t.eos_token_ids() == (301, 302) and t.chat_template == "J"
    sub = tmp_path / "hf"
    sub.mkdir()
    hf = load_text_tokenizer(hf_folder(sub, chat_template=[{"name": "default", "template": "D"}]))
    assert hf.chat_template == "D"


def test_special_longest_match_wins(tmp_path):
    t = load_text_tokenizer(kimi_bpe_folder(tmp_path))
    assert t.encode("<|im_end|>x") == [304] and t.encode("<|im_end|>y")[0] == 302


def test_sentencepiece_style_byte_fallback_table(tmp_path):
    """Metaspace / ByteFallback decoders: <0xNN> pieces are bytes, '▁' is a space."""
    spec = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "pre_tokenizer": None,
            "post_processor": None,
            "added_tokens": [{"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True}],
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                      "vocab": {"<unk>": 0, "<0xE6>": 1, "<0x97>": 2, "<0xA5>": 3, "▁a": 4, "a": 5, "▁": 6},
                      "merges": []}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    t = load_text_tokenizer(tmp_path)
    assert [t.token_bytes(i) for i in range(7)] == [b"", b"\xe6", b"\x97", b"\xa5", b" a", b"a", b" "]
    assert decode(t, [4, 6, 1, 2, 3]) == " a 日"


def test_missing_tokenizer_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_text_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer.json: not valid JSON"):
        load_text_tokenizer(tmp_path)


def test_tiny_preset_byte_vocabulary(tiny_dirs):
    t = load_text_tokenizer(tiny_dirs[0])
    assert t.encode("é") == list("é".encode()) and t.special_id("[EOS]") == 257
    assert t.token_bytes(257) == b"" and base64.b64encode(t.token_bytes(65)) == b"QQ=="
