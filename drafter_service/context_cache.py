"""Per-session context KV cache of the drafter, bounded by the draft window (DESIGN 2.2, 3.4).

Per layer, a preallocated ring `[max_sessions, window, kv_heads, head_dim]` for K and V. Appending
n rows writes ring positions (count + i) % window; attention reads the first min(count, window)
ring rows (the drafter's context attention is unmasked, so ring order does not matter). Rope is
applied before the rows are stored, so they carry their absolute positions.
"""

from __future__ import annotations

import torch


class DraftContextCache:
    def __init__(self, num_layers: int, max_sessions: int, window: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if window <= 0:
            raise ValueError(f"draft window must be positive, got {window}")
        self.window = window
        shape = (num_layers, max_sessions, window, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(max_sessions - 1, -1, -1))
        self._row: dict[str, int] = {}
        self._count: dict[str, int] = {}

    def __contains__(self, sid: str) -> bool:
        return sid in self._row

    def row(self, sid: str) -> int:
        if sid not in self._row:
            if not self._free:
                raise RuntimeError(f"drafter context cache is full ({self.k.shape[1]} sessions)")
            self._row[sid] = self._free.pop()
            self._count[sid] = 0
        return self._row[sid]

    def length(self, sid: str) -> int:
        return min(self._count.get(sid, 0), self.window)

    def append(self, sid: str, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """kv: per layer (K, V) [n, kv_heads, head_dim] for n new context rows, in position order."""
        row = self.row(sid)
        n = kv[0][0].shape[0]
        if n == 0:
            return
        keep = min(n, self.window)  # older rows would be overwritten within this append anyway
        start = self._count[sid] + (n - keep)
        ring = (torch.arange(keep, device=self.k.device) + start) % self.window
        for layer, (k, v) in enumerate(kv):
            self.k[layer, row, ring] = k[n - keep :].to(self.k.dtype)
            self.v[layer, row, ring] = v[n - keep :].to(self.v.dtype)
        self._count[sid] += n

    def release(self, sid: str) -> None:
        if sid in self._row:
            self._free.append(self._row.pop(sid))
            del self._count[sid]
