"""What a request asks of the sampler (DESIGN 3.2): temperature, top-p, top-k and the seed.

Pure Python (no torch), so the gateway and the client SDK can build and validate it anywhere.
The device-side tensors are built from it in `verifier_service.sampler`.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass

MAX_SEED = 2**63 - 1  # seeds live in int64 tensors on the device
MIN_TEMPERATURE = 1e-5  # below this, logits / T overflows fp32: ask for 0 (greedy) instead


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy argmax (top_p/top_k/seed unused); top_p 1 and top_k 0 = filter off.

    seed None = the engine draws one at admission and records it on the Session, so every output
    can be reproduced; with the same seed DDTree at any budget emits the tokens of AR sampling.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t!r}")
        p = self.top_p
        if not _is_real(p) or not 0 < p <= 1:  # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1] or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one (drawn from the OS, not from any global RNG)."""
    return params.seed if params.seed is not None else secrets.randbits(63)
