"""The committed kimi-mini pair (models/kimi-mini): lossless and actually speculating, on CPU in fp32.

On a prompt cut from a held-out standard-library file (linecache.py is in the held-out split of
training/corpus.py, so neither model saw it), greedy DDTree must emit exactly the autoregressive
tokens, and the trained drafter must be accepted far beyond what a random drafter gets (about 1.0):
the floor is set well below what the committed pair measures here (see models/kimi-mini/README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

PAIR = Path(__file__).resolve().parents[2] / "models" / "kimi-mini"
PROMPT = '''"""Cache lines from Python source files.

This is intended to read lines from modules imported -- hence if a filename
is not found, it will look down the module search path for a file by
that name.
"""

import functools
import sys
import os
import tokenize

__all__ = ["getline", "clearcache", "checkcache", "lazycache"]


# The cache. Maps filenames to either a thunk which will provide source code,
# or a tuple (size, mtime, lines, fullname) once loaded.
cache = {}


def clearcache():
    """Clear the cache entirely."""
    cache.clear()


def getline(filename, lineno, module_globals=None):
'''
NEW_TOKENS = 48
ACCEPTANCE_FLOOR = 2.2  # the committed pair measures 2.76 here (fp32, CPU); a random drafter ~1.0

pytestmark = pytest.mark.skipif(not (PAIR / "drafter" / "config.json").exists(),
                                reason="models/kimi-mini is not in this checkout")


@pytest.fixture(scope="module")
def engine_and_prompt():
    from gateway.tokenizer import Tokenizer
    from verifier_service.engine import EngineConfig
    from verifier_service.local import build_local_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small model: one thread avoids OpenMP stalls on a shared machine
    try:
        tok = Tokenizer.load(PAIR / "target")
        ids = tok.encode(PROMPT)
        assert tok.decode(ids) == PROMPT
        engine = build_local_engine(PAIR / "target", PAIR / "drafter", torch.float32, "cpu",
                                    EngineConfig(num_pages=256, max_sessions=4, draft_window=1024))
        yield engine, ids
    finally:
        torch.set_num_threads(threads)


def test_pair_fits_the_size_cap():
    total = sum(p.stat().st_size for p in PAIR.rglob("*") if p.is_file())
    assert total <= 24 * 2**20, f"models/kimi-mini is {total / 2**20:.1f} MiB"


def test_greedy_ddtree_equals_ar_and_accepts_deep(engine_and_prompt):
    from verifier_service.session import DecodeParams

    engine, ids = engine_and_prompt
    torch.set_num_threads(1)
    ar = engine.generate([ids], DecodeParams(max_new_tokens=NEW_TOKENS, budget=0, ignore_eos=True))[0]
    dd = engine.generate([ids], DecodeParams(max_new_tokens=NEW_TOKENS, budget=16, topk=8, ignore_eos=True))[0]
    assert dd.output == ar.output
    mean = sum(dd.accepted_per_step) / len(dd.accepted_per_step)
    assert mean >= ACCEPTANCE_FLOOR, f"mean acceptance {mean:.2f} per step {dd.accepted_per_step}"
