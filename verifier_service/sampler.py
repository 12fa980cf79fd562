"""The engine's posterior-token function: each session's warps and seeded noise, per tree node.

Owns `SamplerTable`: per-session sampling parameters in preallocated device buffers indexed by the
session's KV block-table row (written once at admission, so a verify step copies nothing to the
device for sampling), and `posterior`, the one function through which the engine turns target
logits into posterior tokens, both at prefill (the first token) and at every verify step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.sampling import sample_tokens
from verifier_service.sampling_params import SamplingParams


def sampling_tensors(params: list[SamplingParams], seeds: list[int], device: torch.device | str = "cpu"):
    """Per-row device tensors for `kernels.sampling.sample_tokens`:
    (inv_temp [R] fp32, 0 = greedy; top_p [R] fp32; top_k [R] int32; seed [R] int64).

    inv_temp is fp32(1 / T) rounded once here, the single place that defines it, so every caller
    (engine, tests, benchmarks) feeds the kernel bit-identical parameters."""
    if len(params) != len(seeds):
        raise ValueError(f"{len(params)} params but {len(seeds)} seeds")
    inv = [0.0 if p.greedy else 1.0 / p.temperature for p in params]
    return (torch.tensor(inv, dtype=torch.float32, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.int32, device=device),
            torch.tensor(seeds, dtype=torch.int64, device=device))


class SamplerTable:
    """Sampling parameters of up to `max_rows` sessions, on the device, indexed by KV row."""

    def __init__(self, max_rows: int, device: torch.device | str):
        self.device = torch.device(device)
        self.inv_temp = torch.zeros(max_rows, dtype=torch.float32, device=device)  # [rows], 0 = greedy
        self.top_p = torch.ones(max_rows, dtype=torch.float32, device=device)  # [rows]
        self.top_k = torch.zeros(max_rows, dtype=torch.int32, device=device)  # [rows], 0 = off
        self.seed = torch.zeros(max_rows, dtype=torch.int64, device=device)  # [rows]

    def set(self, row: int, params: SamplingParams, seed: int) -> None:
        """Admission: record a session's parameters (a few tiny host-to-device copies, once)."""
        for buf, val in zip((self.inv_temp, self.top_p, self.top_k, self.seed),
                            sampling_tensors([params], [seed], self.device), strict=True):
            buf[row : row + 1].copy_(val)

    def posterior(self, logits: Tensor, node_rows: Tensor | list[int], next_pos: Tensor | list[int],
                  sampled: bool) -> Tensor:
        """Posterior token per node -> [T] int64.

        logits [T, V]; node_rows [T]: the KV row of the session each node belongs to; next_pos [T]:
        absolute position of the token each node predicts (node position + 1); sampled: whether
        any of these sessions samples (a host bool, so all-greedy batches stay a plain argmax).
        """
        if not sampled:
            return logits.argmax(-1)
        rows = torch.as_tensor(node_rows, device=logits.device).long()
        pos = torch.as_tensor(next_pos, device=logits.device).long()
        inv_temp = self.inv_temp[rows]
        y = sample_tokens(logits, inv_temp, self.top_p[rows], self.top_k[rows], self.seed[rows], pos)
        if logits.dtype != torch.float32:
            # the kernel reads fp32; keep greedy rows exactly the argmax of the logits as given
            y = torch.where(inv_temp == 0, logits.argmax(-1), y)
        return y
