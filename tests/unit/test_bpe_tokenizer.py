"""Byte-level BPE: training (training/tokenizer.py) and encoding (gateway/tokenizer.py).

Round trips are byte-exact on awkward text; the pre-split pattern covers every character; the
trainer is deterministic and actually merges; the Kimi layout (tiktoken.model + tokenizer_config.json
with `pat_str` and specials, mask token at vocab_size - 2) survives write/load; and where tiktoken is
installed, our encoder produces exactly tiktoken's ids for the same ranks and pattern.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.tokenizer import PAT_STR, Tokenizer, byte_tokenizer
from training.tokenizer import MASK_NAME, build, piece_counts, special_tokens, train_bpe

CORPUS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "for i in range(10):\n    print(i, i * 2)  # loop\n\tif i > 5:\n\t\tbreak\r\n",
    "import os\nimport sys\n\nPATH = os.path.join('a', 'b')\nvalue = 12345.678e-9\n",
] * 20
AWKWARD = ["", " ", "\n\n\n", "   \n\t\r\n  x", "naïve café — ünïcödé", "emoji 🤖🎉 mixed\u200bzero-width",
           "x=1;y=2\r\nz=3\r", "'s 're 'LL", "\x00\x01 control \x7f", "a" * 300, "日本語のテキスト", "def _f_1(__x__):"]
MODEL = Path(__file__).resolve().parents[2] / "models" / "kimi-mini" / "target"


@pytest.fixture(scope="module")
def small():
    return build(CORPUS, 256 + 64 + 40)


def test_pattern_covers_every_character():
    rx = re.compile(PAT_STR)
    for s in AWKWARD + CORPUS[:3]:
        assert "".join(rx.findall(s)) == s
    # indentation is its own piece; the last space of the run goes to the word
    assert rx.findall("\n    return x") == ["\n", "   ", " return", " x"]


def test_round_trip_is_byte_exact(small):
    for s in AWKWARD + CORPUS[:3]:
        ids = small.encode(s)
        assert small.decode(ids) == s
        assert all(0 <= i < small.vocab_size - 64 for i in ids)
    code = CORPUS[0]
    assert len(small.encode(code)) < 0.7 * len(code.encode())  # the merges are used


def test_trainer_is_deterministic_and_merges_frequent_pairs():
    a = train_bpe(piece_counts(CORPUS), 30, log_every=0)
    b = train_bpe(piece_counts(list(CORPUS)), 30, log_every=0)
    assert a == b and len(a) == 256 + 30
    assert len(set(a)) == len(a)  # one rank per byte string
    assert b"    " in a or b"   " in a  # indentation is frequent in code


def test_specials_layout_and_write_load(small, tmp_path):
    sp = special_tokens(4096)
    assert sp[4032] == "[BOS]" and sp[4033] == "[EOS]" and sp[4094] == MASK_NAME and len(sp) == 64
    small.write(tmp_path)
    back = Tokenizer.load(tmp_path)
    assert back.pattern == PAT_STR and back.ranks == small.ranks and back.specials == small.specials
    assert back.special_ids[MASK_NAME] == small.vocab_size - 2
    s = AWKWARD[4] + CORPUS[1]
    assert back.encode(s) == small.encode(s)


def test_byte_tokenizer_is_unchanged():
    t = byte_tokenizer(320, {256: "[BOS]"})
    assert t.pattern is None and t.encode("hé") == list("hé".encode())
    assert t.decode(t.encode("héllo\n")) == "héllo\n"


def test_matches_tiktoken(small):
    tiktoken = pytest.importorskip("tiktoken")
    enc = tiktoken.Encoding("t", pat_str=small.pattern, mergeable_ranks=small.ranks,
                            special_tokens={v: k for k, v in small.specials.items()})
    for s in AWKWARD[:8] + CORPUS[:3]:
        assert small.encode(s) == enc.encode_ordinary(s), repr(s)


@pytest.mark.skipif(not (MODEL / "tiktoken.model").exists(), reason="models/kimi-mini is not in this checkout")
def test_committed_tokenizer_on_held_out_code():
    import linecache  # held out of the tokenizer's training split (training/corpus.py)

    text = Path(linecache.__file__).read_text()
    tok = Tokenizer.load(MODEL)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 4096 and len(text.encode()) / len(ids) > 3.0  # about 3.5 bytes/token on code
