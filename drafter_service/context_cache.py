"""Per-session context KV cache of the drafter, bounded by the draft window (DESIGN 2.2, 3.4).

Per layer, a preallocated ring `[max_sessions + 1, window, kv_heads, head_dim]` for K and V. Appending
n rows writes ring positions (count + i) % window; attention reads the first min(count, window)
ring rows (the drafter's context attention is unmasked, so ring order does not matter). Rope is
applied before the rows are stored, so they carry their absolute positions.

Row `pad_row` (the last one) belongs to no session. CUDA-graph replays (`drafter_service.cuda_graphs`)
pad with it: padded draft requests read it with context length 0 (masked out), padded append rows write
it (`pad_index`). So its contents are never seen by a session.

One step's appends for all sessions go through one plan (`plan`: the kept rows' cache row, ring slot
and absolute position, computed on the host as one index) and one scatter (`scatter`: one for K and one
for V over all layers, device-only, so a graph can hold it), then `commit` advances the counts; an append
costs the same launches for 1 or 64 sessions. Of an append of n > window rows only the last `window` are
kept (the older ones would be overwritten within the same append anyway); they are the only ones the
caller needs to project.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SMALL_PLAN_ROWS = 256  # plans of at most this many rows are built in Python, larger ones with tensor ops


@dataclass
class AppendPlan:
    """Where one batched append goes. Kept rows of every session, concatenated in plan order."""

    sids: list[str]
    counts: list[int]  # rows sent per session (n, may be 0)
    skip: list[int]  # leading rows dropped per session (n - kept, > 0 only when n > window)
    index: torch.Tensor  # [T, 3] int64 on the host: cache row, ring slot, absolute position

    @property
    def num_rows(self) -> int:
        return self.index.shape[0]


class DraftContextCache:
    def __init__(self, num_layers: int, max_sessions: int, window: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if window <= 0:
            raise ValueError(f"draft window must be positive, got {window}")
        if max_sessions <= 0:
            raise ValueError(f"max_sessions must be positive, got {max_sessions}")
        self.window = window
        self.max_sessions = max_sessions
        self.pad_row = max_sessions  # owned by no session (padded graph requests read it, masked)
        shape = (num_layers, max_sessions + 1, window, kv_heads, head_dim)
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
                raise RuntimeError(f"drafter context cache is full ({self.max_sessions} sessions)")
            self._row[sid] = self._free.pop()
            self._count[sid] = 0
        return self._row[sid]

    def length(self, sid: str) -> int:
        return min(self._count.get(sid, 0), self.window)

    def plan(self, sids: list[str], starts: list[int], counts: list[int]) -> AppendPlan:
        """Plan appending counts[i] rows at absolute positions starts[i].. to session sids[i] (reserving a
        cache row for a new session, also when it sends 0 rows). Session ids must be distinct."""
        if len(set(sids)) != len(sids):
            raise ValueError("a batched context append names a session twice")
        if not len(sids) == len(starts) == len(counts):
            raise ValueError(f"{len(sids)} sessions, {len(starts)} starts, {len(counts)} counts")
        rows = [self.row(s) for s in sids]
        keep = [min(n, self.window) for n in counts]
        skip = [n - k for n, k in zip(counts, keep)]
        if sum(keep) <= SMALL_PLAN_ROWS:  # a decode step's few rows: one tensor op instead of a dozen
            W = self.window
            index = torch.tensor([[r, (self._count[s] + k0 + i) % W, p + k0 + i]
                                  for s, r, p, k0, k in zip(sids, rows, starts, skip, keep) for i in range(k)],
                                 dtype=torch.int64).view(-1, 3)
            return AppendPlan(list(sids), list(counts), skip, index)
        keep_t = torch.tensor(keep, dtype=torch.int64)
        seg = torch.repeat_interleave(torch.arange(len(sids)), keep_t)  # [T] session of each kept row
        local = torch.arange(int(seg.numel())) - (torch.cumsum(keep_t, 0) - keep_t)[seg]  # index within its rows
        ring0 = torch.tensor([self._count[s] + k for s, k in zip(sids, skip)], dtype=torch.int64)
        pos0 = torch.tensor([p + k for p, k in zip(starts, skip)], dtype=torch.int64)
        index = torch.stack((torch.tensor(rows, dtype=torch.int64)[seg], (ring0[seg] + local) % self.window,
                             pos0[seg] + local), dim=1)
        return AppendPlan(list(sids), list(counts), skip, index)

    def pad_index(self, n: int) -> torch.Tensor:
        """[n, 3] host index of n pad rows: the pad row, ring slots 0, 1, ... (mod window), position 0."""
        slots = torch.arange(n, dtype=torch.int64)
        return torch.stack((torch.full_like(slots, self.pad_row), slots % self.window, torch.zeros_like(slots)), dim=1)

    def scatter(self, index: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """index: [T, 3] int64 on the cache's device (a plan's, maybe padded); kv: per layer (K, V)
        [T, kv_heads, head_dim] for those rows. Device ops only. A plan's ring slots are distinct (no
        write-write race); pad rows may collide only within the pad row, which no session reads."""
        rows, ring = index[:, 0], index[:, 1]
        self.k[:, rows, ring] = torch.stack([k for k, _ in kv]).to(self.k.dtype)  # [layers, T, KV, hd]
        self.v[:, rows, ring] = torch.stack([v for _, v in kv]).to(self.v.dtype)

    def commit(self, plan: AppendPlan) -> None:
        """The plan's rows are written: advance every session's count."""
        for sid, n in zip(plan.sids, plan.counts):
            self._count[sid] += n

    def advance(self, sids: list[str], counts: list[int]) -> None:
        """Rows a device-counted append wrote (`Drafter.draft_ahead`), once the host knows how many: advance each
        session's count (sessions released since are skipped: their rows went with them)."""
        for sid, n in zip(sids, counts, strict=True):
            if sid in self._count:
                self._count[sid] += n

    def release(self, sid: str) -> None:
        if sid in self._row:
            self._free.append(self._row.pop(sid))
            del self._count[sid]
