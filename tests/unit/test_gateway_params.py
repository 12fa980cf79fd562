"""Generation parameters (gateway.params): every range check names its field, defaults fill what is unset,
a sampled request always leaves with a seed, max_tokens is sized against the room left."""

from __future__ import annotations

import math

import pytest

from gateway.errors import GatewayError
from gateway.params import Defaults, GenerationParams, Limits, fit_max_tokens, resolve

LIMITS = Limits(vocab_size=320, max_budget=64, max_session_len=512, eos_token_ids=(257,))
DEFAULTS = Defaults(max_tokens=100, draft_budget=16, draft_topk=8)


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 513}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": 1e-6}, "temperature"),
    ({"temperature": True}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": 321}, "top_k"), ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"), ({"stop_token_ids": (320,)}, "stop_token_ids"),
    ({"stop_token_ids": tuple(range(65))}, "stop_token_ids"), ({"stop": ("",)}, "stop"),
    ({"stop": ("x" * 257,)}, "stop"), ({"stop": ("a",) * 17}, "stop"), ({"draft_budget": 65}, "draft_budget"),
    ({"draft_budget": -1}, "draft_budget"), ({"draft_topk": 0}, "draft_topk"),
])
def test_out_of_range_is_invalid_argument_naming_the_field(kw, field):
    with pytest.raises(GatewayError) as e:
        resolve(GenerationParams(**kw), LIMITS, DEFAULTS)
    assert (e.value.code, e.value.param) == ("INVALID_ARGUMENT", field)
    assert e.value.message.startswith(f"{field}: ")


def test_defaults_and_greedy():
    p = resolve(GenerationParams(), LIMITS, DEFAULTS)
    assert p.sampling.greedy and p.sampling.seed is None and (p.draft_budget, p.draft_topk) == (16, 8)
    assert p.max_tokens is None and p.stop == () and not p.ignore_eos
    zero = resolve(GenerationParams(temperature=0.0, top_k=0, draft_budget=0), LIMITS, DEFAULTS)
    assert zero.sampling.greedy and zero.draft_budget == 0  # 0 is a value, not "unset"


def test_sampling_gets_a_seed_that_is_reported():
    a = resolve(GenerationParams(temperature=0.7), LIMITS, DEFAULTS)
    b = resolve(GenerationParams(temperature=0.7), LIMITS, DEFAULTS)
    assert a.sampling.seed is not None and a.sampling.seed != b.sampling.seed
    assert resolve(GenerationParams(temperature=0.7, seed=0), LIMITS, DEFAULTS).sampling.seed == 0
    p = resolve(GenerationParams(stop_token_ids=(5, 5, 6)), LIMITS, DEFAULTS)
    assert p.stop_token_ids == (5, 6)


def test_max_tokens_fit_the_room_left():
    p = resolve(GenerationParams(), LIMITS, DEFAULTS)
    assert fit_max_tokens(p, 10, LIMITS, DEFAULTS) == 100  # the default
    assert fit_max_tokens(p, 450, LIMITS, DEFAULTS) == 512 - 450 - 17  # capped by the room left
    asked = resolve(GenerationParams(max_tokens=60), LIMITS, DEFAULTS)
    assert fit_max_tokens(asked, 435, LIMITS, DEFAULTS) == 60
    with pytest.raises(GatewayError, match="max_tokens: 60 do not fit"):
        fit_max_tokens(asked, 436, LIMITS, DEFAULTS)
    with pytest.raises(GatewayError, match="max_tokens: no room left"):
        fit_max_tokens(p, 500, LIMITS, DEFAULTS)


def test_server_defaults_are_validated():
    with pytest.raises(ValueError, match="max_tokens"):
        Defaults(max_tokens=0)
    with pytest.raises(ValueError, match="draft_budget"):
        Defaults(draft_budget=-1)
