"""Integration fixtures: the tiny model pair on disk and its in-process autoregressive reference.

Servers run in float64 like the exactness unit tests, so the split services must match the
in-process engine token for token.
"""

from __future__ import annotations

import pytest
import torch

from drafter_service.checkpoint import write_random_drafter
from gateway.tokenizer import byte_tokenizer
from verifier_service import presets
from verifier_service.random_checkpoint import write_random_target


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-pair")
    tcfg = presets.target_config("tiny")
    write_random_target(out / "target", tcfg, seed=1, max_shard_bytes=200_000)
    write_random_drafter(out / "drafter", presets.drafter_config("tiny"), tcfg["text_config"]["hidden_size"], seed=1)
    byte_tokenizer(presets.TINY_VOCAB, presets.TINY_SPECIALS).write(out / "target")
    return out / "target", out / "drafter"


class Reference:
    """Greedy AR outputs of the in-process engine (fp64), cached per (prompt, max_new)."""

    def __init__(self, target_dir):
        from verifier_service.checkpoint import load_target

        self.target = load_target(target_dir, torch.float64, "cpu")
        self.cache: dict[tuple, list[int]] = {}

    def __call__(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        from verifier_service.engine import Engine, EngineConfig
        from verifier_service.session import DecodeParams

        todo = [p for p in prompts if (tuple(p), new) not in self.cache]
        if todo:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the servers under test share the 2 cores; spinning threads thrash
            try:
                eng = Engine(self.target, None, (), EngineConfig(page_size=16, num_pages=1024,
                                                                 max_sessions=len(todo)))
                params = DecodeParams(max_new_tokens=new, budget=0, ignore_eos=True)
                for p, s in zip(todo, eng.generate(todo, params)):
                    self.cache[(tuple(p), new)] = s.output
            finally:
                torch.set_num_threads(threads)
        return [self.cache[(tuple(p), new)] for p in prompts]


@pytest.fixture(scope="session")
def reference(pair):
    return Reference(pair[0])
