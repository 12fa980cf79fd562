"""The drafter's context projection, `ctx = hidden_norm(fc(concat(taps)))` (DESIGN 2.2), held by the verifier.

A committed token's target taps are num_taps x D_target values (6 x 7168 bf16 = 84 KiB at Kimi K2.6); its
projected context row is D values (7168 bf16 = 14 KiB), and the drafter needs nothing else of it: every drafter
layer's context K/V is a function of that row (`DFlashDrafter.context_kv_from`). So the verifier's engine projects
the taps of the tokens it commits before they leave it, when it holds the projection: 6x fewer bytes per
committed token on every transport (the gRPC messages, the co-located regions) and 6x less pending context per
session while the drafter has not acknowledged it. The GEMM moves from the drafter's step to the verifier's (the
same 0.6 GB of `fc` read once per step at K2.6), both on the critical path of a step, so the step's work is the same.

In-process the projection is the drafter's own modules (`from_model`: no second copy). A verifier with a remote
drafter loads `fc` and `hidden_norm` from the drafter's checkpoint (`load`, `ddtree verifier serve
--context-projection DIR`) and offers the projection's `fingerprint` when it opens a Draft stream; a drafter whose own
projection has another fingerprint refuses the stream (OpenStream.context_projection), so projected rows never meet
the wrong weights. Without it the verifier sends the taps and the drafter projects them itself.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import torch
from torch import nn

from drafter_service.config import DFlashConfig
from kernels.rmsnorm import RMSNorm
from verifier_service.safetensors_io import CheckpointError, ShardedReader

FINGERPRINT_SAMPLES = 1 << 16  # values sampled per weight (evenly strided) for the fingerprint


class ContextProjection(nn.Module):
    """fc [D, num_taps * D_target] (no bias) then hidden_norm (RMSNorm over D): taps [n, F] -> rows [n, D]."""

    def __init__(self, fc: nn.Linear, hidden_norm: RMSNorm):
        super().__init__()
        if fc.bias is not None or hidden_norm.weight.shape[0] != fc.out_features:
            raise ValueError(f"context projection: fc must be a bias-free [D, F] linear and hidden_norm a [D] norm, "
                             f"got fc {list(fc.weight.shape)} and hidden_norm {list(hidden_norm.weight.shape)}")
        self.fc, self.hidden_norm = fc, hidden_norm
        self._fingerprint: str | None = None

    @classmethod
    def from_model(cls, model: nn.Module) -> ContextProjection:
        """The projection of a loaded `DFlashDrafter`, sharing its modules (the in-process drafter)."""
        return cls(model.fc, model.hidden_norm)

    @classmethod
    @torch.no_grad()
    def load(cls, folder: str | Path, dtype: torch.dtype, device: str | torch.device) -> ContextProjection:
        """Read only `fc.weight` and `hidden_norm.weight` (or their `model.` forms) of a drafter checkpoint."""
        folder = Path(folder)
        cfg = DFlashConfig.from_file(folder)
        with ShardedReader(folder) as reader:
            w = {}
            for name in ("fc.weight", "hidden_norm.weight"):
                src = name if name in reader else "model." + name
                if src not in reader:
                    raise CheckpointError(f"{reader.index_path}: tensor {name!r} (or 'model.{name}') is missing")
                # a copy out of the memory map, which closes below (`.to` alone returns the map itself on a match)
                w[name] = reader.view(src).to(device=device, dtype=dtype, copy=True)
        fc_w, norm_w = w["fc.weight"], w["hidden_norm.weight"]
        if fc_w.dim() != 2 or fc_w.shape[0] != cfg.hidden_size or fc_w.shape[1] % cfg.num_taps:
            raise CheckpointError(f"{folder}: fc.weight has shape {list(fc_w.shape)}, expected [{cfg.hidden_size}, "
                                  f"{cfg.num_taps} taps x target hidden]")
        if tuple(norm_w.shape) != (cfg.hidden_size,):
            raise CheckpointError(f"{folder}: hidden_norm.weight has shape {list(norm_w.shape)}, expected "
                                  f"[{cfg.hidden_size}]")
        with torch.device("meta"):
            fc = nn.Linear(fc_w.shape[1], fc_w.shape[0], bias=False)
            norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        fc.weight = nn.Parameter(fc_w, requires_grad=False)
        norm.weight = nn.Parameter(norm_w, requires_grad=False)
        return cls(fc, norm).eval()

    @property
    def in_features(self) -> int:
        return self.fc.in_features

    @property
    def out_features(self) -> int:
        return self.fc.out_features

    def forward(self, taps: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(taps))

    @property
    @torch.no_grad()
    def fingerprint(self) -> str:
        """Names the weights, not their dtype or device: sha256 over the shapes, the norm's eps and an evenly strided
        sample of FINGERPRINT_SAMPLES values of each weight (as float32). Two checkpoints of different training
        differ in it; one weight changed in place would not (a sample, so that a 0.6 GB weight hashes in
        milliseconds). Computed once."""
        if self._fingerprint is None:
            h = hashlib.sha256(b"ddtree-context-projection/1")
            h.update(struct.pack("<d", float(self.hidden_norm.eps)))
            for w in (self.fc.weight, self.hidden_norm.weight):
                flat = w.detach().reshape(-1)
                step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
                h.update(struct.pack(f"<{w.dim() + 1}q", w.dim(), *w.shape))
                h.update(flat[::step].float().cpu().numpy().tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint
