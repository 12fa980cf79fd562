"""Per-session decoding parameters and state kept by the verifier engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verifier_service.sampling_params import SamplingParams

MAX_BUDGET = 64  # trees have at most 65 nodes: two 64-bit words of ancestor mask per node


@dataclass(frozen=True)
class DecodeParams:
    """What a request asks of the engine. budget 0 = plain autoregressive decoding."""

    max_new_tokens: int = 64
    budget: int = 16
    topk: int = 8
    eos_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling: SamplingParams = SamplingParams()  # greedy by default

    def __post_init__(self):
        if not 0 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be in 0..{MAX_BUDGET}, got {self.budget}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")


@dataclass
class Session:
    sid: str
    row: int  # KV block-table row
    params: DecodeParams
    prompt_len: int
    committed: int = 0  # tokens whose KV is in the target cache (the root sits at this position)
    root: int = -1  # last emitted token; root of the next tree
    output: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)  # tokens committed per verify step
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified per step (1 = autoregressive)
    tree_depth: int = 0  # deepest node of the last verified tree (0 = autoregressive)
    traceparent: str = ""  # W3C context the next draft request carries ("" = untraced; set by the scheduler)
    pending_start: int = 0  # position of pending_ctx[0]
    pending_ctx: torch.Tensor | None = None  # [n, F] taps not yet sent to the drafter
    finish_reason: str | None = None
    seed: int | None = None  # sampling seed used (drawn at admission when the request had none)
    persistent: bool = False  # keep the KV after a turn finishes (multi-turn), until Engine.release

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add_pending(self, start: int, feats: torch.Tensor, window: int) -> None:
        """Queue taps for the drafter; only the last `window` rows can ever be attended to."""
        if self.pending_ctx is None or self.pending_ctx.shape[0] == 0:
            self.pending_start, self.pending_ctx = start, feats
        else:
            self.pending_ctx = torch.cat((self.pending_ctx, feats))
        extra = self.pending_ctx.shape[0] - window
        if extra > 0:
            self.pending_ctx = self.pending_ctx[extra:]
            self.pending_start += extra

    def take_pending(self) -> tuple[int, torch.Tensor | None]:
        start, feats = self.pending_start, self.pending_ctx
        self.pending_ctx = None
        return start, feats

    def emit(self, tokens: list[int]) -> list[int]:
        """Append generated tokens, applying EOS and max_new_tokens; returns what was emitted."""
        out = []
        for t in tokens:
            if len(self.output) >= self.params.max_new_tokens:
                break
            self.output.append(t)
            out.append(t)
            if not self.params.ignore_eos and t in self.params.eos_ids:
                self.finish_reason = "stop"
                return out
        if len(self.output) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return out
