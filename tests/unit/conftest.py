"""Fixtures: a tiny random model pair written once per test session in the real checkpoint layouts."""

from __future__ import annotations

import pytest
import torch

from drafter_service.checkpoint import write_random_drafter
from gateway.tokenizer import byte_tokenizer
from verifier_service import presets
from verifier_service.random_checkpoint import write_random_target


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    tcfg = presets.target_config("tiny")
    write_random_target(out / "target", tcfg, seed=1, max_shard_bytes=200_000)
    write_random_drafter(out / "drafter", presets.drafter_config("tiny"), tcfg["text_config"]["hidden_size"], seed=1)
    byte_tokenizer(presets.TINY_VOCAB, presets.TINY_SPECIALS).write(out / "target")
    return out / "target", out / "drafter"


@pytest.fixture(scope="session")
def tiny_target64(tiny_dirs):
    from verifier_service.checkpoint import load_target

    return load_target(tiny_dirs[0], torch.float64, "cpu")


@pytest.fixture(scope="module")
def parts(tiny_dirs, tiny_target64):
    """(the tiny drafter in float64, the target's embed_tokens and lm_head weights): what a Drafter is built from."""
    from drafter_service.checkpoint import load_drafter

    model = load_drafter(tiny_dirs[1], tiny_target64.cfg, torch.float64)
    return model, tiny_target64.model.embed_tokens.weight, tiny_target64.lm_head.weight


@pytest.fixture
def served(parts):
    """(a DrafterService of the tiny drafter, its grpc.aio server on loopback in this process): stream_harness.py's
    pieces; a test module may override it with another drafter class (test_transports.py)."""
    from tests.unit.stream_harness import ServerThread, make_service

    service = make_service(parts)
    srv = ServerThread(service)
    yield service, srv
    srv.stop()
