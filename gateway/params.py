"""Generation parameters: what a request may ask for, their ranges, defaults and the seed.

`GenerationParams` is what the surfaces (gRPC, HTTP) parse into: None = unset. `resolve()` checks every
field against the served model (`Limits`) and fills the server's `Defaults`; an out-of-range value
raises INVALID_ARGUMENT naming the field (`gateway.errors.invalid`). Sampling ranges are the ones
`verifier_service.sampling_params.SamplingParams` enforces (pure Python, no torch), so the gateway
never forwards a request the verifier would refuse. A sampled request without a seed gets one drawn
here, so every output can be reproduced from the seed reported in its usage.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from gateway.errors import invalid
from verifier_service.sampling_params import MAX_SEED, MIN_TEMPERATURE, SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class Limits:
    """What the served model and its verifier accept."""

    vocab_size: int
    max_budget: int
    max_session_len: int
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Defaults:
    max_tokens: int = 256
    draft_budget: int = 16
    draft_topk: int = 8

    def __post_init__(self):
        for f in ("max_tokens", "draft_topk"):
            if getattr(self, f) < 1:
                raise ValueError(f"default {f} must be >= 1, got {getattr(self, f)}")
        if self.draft_budget < 0:
            raise ValueError(f"default draft_budget must be >= 0, got {self.draft_budget}")


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    draft_budget: int | None = None
    draft_topk: int | None = None


@dataclass(frozen=True)
class ResolvedParams:
    """Every field decided; `max_tokens` None = as many as fit (decided against the prompt)."""

    max_tokens: int | None
    sampling: SamplingParams  # seed set whenever temperature > 0
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    ignore_eos: bool
    draft_budget: int
    draft_topk: int

    @property
    def tree_nodes(self) -> int:
        """Upper bound of the cache rows one draft tree takes (budget nodes + root)."""
        return self.draft_budget + 1


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def resolve(p: GenerationParams, limits: Limits, defaults: Defaults) -> ResolvedParams:
    """Check every field (INVALID_ARGUMENT naming it) and fill the defaults."""
    if p.max_tokens is not None and (not _int(p.max_tokens) or not 1 <= p.max_tokens <= limits.max_session_len):
        raise invalid("max_tokens", f"must be an integer in [1, {limits.max_session_len}], got {p.max_tokens!r}")
    t = 0.0 if p.temperature is None else p.temperature
    if not _real(t) or not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
        raise invalid("temperature", f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t!r}")
    top_p = 1.0 if p.top_p is None else p.top_p
    if not _real(top_p) or not 0 < top_p <= 1:
        raise invalid("top_p", f"must be in (0, 1], got {top_p!r}")
    top_k = 0 if p.top_k is None else p.top_k
    if not _int(top_k) or not 0 <= top_k <= limits.vocab_size:
        raise invalid("top_k", f"must be an integer in [0, {limits.vocab_size}] (0 = off), got {top_k!r}")
    if p.seed is not None and (not _int(p.seed) or not 0 <= p.seed <= MAX_SEED):
        raise invalid("seed", f"must be an integer in [0, 2**63 - 1], got {p.seed!r}")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(p.stop_token_ids)}")
    bad = [i for i in p.stop_token_ids if not _int(i) or not 0 <= i < limits.vocab_size]
    if bad:
        raise invalid("stop_token_ids", f"{bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    for s in p.stop:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise invalid("stop", f"stop strings must be non-empty strings of at most {MAX_STOP_CHARS} characters, "
                                  f"got {s!r:.80}")
    budget = defaults.draft_budget if p.draft_budget is None else p.draft_budget
    if not _int(budget) or not 0 <= budget <= limits.max_budget:
        raise invalid("draft_budget", f"must be an integer in [0, {limits.max_budget}] (0 = autoregressive), "
                                      f"got {budget!r}")
    topk = defaults.draft_topk if p.draft_topk is None else p.draft_topk
    if not _int(topk) or topk < 1:
        raise invalid("draft_topk", f"must be an integer >= 1, got {topk!r}")
    seed = p.seed
    if t > 0 and seed is None:
        seed = secrets.randbits(63)  # reported in the usage, so the output can be reproduced
    sampling = SamplingParams(temperature=float(t), top_p=float(top_p), top_k=top_k, seed=seed)
    return ResolvedParams(p.max_tokens, sampling, tuple(dict.fromkeys(p.stop_token_ids)), tuple(p.stop),
                          bool(p.ignore_eos), budget, topk)


def fit_max_tokens(params: ResolvedParams, context_tokens: int, limits: Limits, defaults: Defaults) -> int:
    """max_new_tokens for a turn generated after `context_tokens`: the request's (checked against the
    room left) or the default capped by the room left. INVALID_ARGUMENT naming max_tokens otherwise."""
    room = limits.max_session_len - context_tokens - params.tree_nodes
    if params.max_tokens is not None:
        if params.max_tokens > room:
            raise invalid("max_tokens", f"{params.max_tokens} do not fit: the context holds {context_tokens} tokens "
                                        f"and a draft tree needs {params.tree_nodes} rows of the "
                                        f"{limits.max_session_len} a session may use ({max(room, 0)} left)")
        return params.max_tokens
    if room < 1:
        raise invalid("max_tokens", f"no room left: the context holds {context_tokens} tokens of the "
                                    f"{limits.max_session_len} a session may use")
    return min(defaults.max_tokens, room)
