"""Paged latent KV pool of the target (DESIGN 3.4).

One preallocated tensor `kv [layers, (num_pages + 1) * page_size, row_dim]` (row = [c_kv | k_pe]; the
last page is scratch, owned by no session) and a preallocated block table
`[max_sessions, max_pages_per_session]` on the device. Sessions own a block-table row and a list of
pages; growing a session appends pages (host bookkeeping plus a tiny block-table write), releasing
returns them. Nothing is allocated per step.
"""

from __future__ import annotations

import torch

from drafter_service.device_copy import int64_to_device
from kernels.kv_compact import block_slots


class KVCapacityError(RuntimeError):
    """The pool cannot hold the requested tokens (maps to RESOURCE_EXHAUSTED at the service edge)."""


class KVPool:
    def __init__(self, num_layers: int, row_dim: int, num_pages: int, page_size: int, max_sessions: int,
                 max_session_len: int, dtype: torch.dtype, device: torch.device | str):
        if page_size <= 0 or num_pages <= 0 or max_sessions <= 0 or max_session_len <= 0:
            raise ValueError("KVPool: sizes must be positive")
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages_per_session = -(-max_session_len // page_size)
        self.max_session_len = self.max_pages_per_session * page_size
        # one extra page past the pages: scratch that no session owns. Its first row, `scratch_slot`, is the
        # target of padded (no-op) moves and writes, so fixed-shape device code never touches another
        # session's rows; a block-table row made only of `scratch_page` (the padding session of a CUDA-graph
        # batch, `verifier_service.cuda_graphs`) reads and writes nothing else.
        self.scratch_page = num_pages
        self.scratch_slot = num_pages * page_size
        self.kv = torch.zeros(num_layers, (num_pages + 1) * page_size, row_dim, dtype=dtype, device=device)
        self.block_table = torch.zeros(max_sessions, self.max_pages_per_session, dtype=torch.int32, device=device)
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_rows = list(range(max_sessions - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}

    # --- bookkeeping (host) ------------------------------------------------------------------------
    @property
    def free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    def open(self) -> int:
        if not self._free_rows:
            raise KVCapacityError(f"all {self.block_table.shape[0]} session slots are in use")
        row = self._free_rows.pop()
        self._pages[row] = []
        return row

    def capacity(self, row: int) -> int:
        return len(self._pages[row]) * self.page_size

    def ensure(self, row: int, n_tokens: int) -> None:
        """Make logical rows 0..n_tokens-1 of session `row` backed by pages."""
        self.ensure_many([row], [n_tokens])

    def ensure_many(self, rows: list[int], n_tokens: list[int]) -> None:
        """`ensure` for each (row, n_tokens) in order, with one block-table write for all the pages they gained (a
        step's page crossings: one upload and one scatter, not a blocking pageable copy and a copy per session). On
        KVCapacityError the rows before the failing one keep their new pages, written before it is raised."""
        cells: list[tuple[int, int, int]] = []  # (row, page index in the row, page)
        try:
            for row, n in zip(rows, n_tokens, strict=True):
                if n > self.max_session_len:
                    raise KVCapacityError(f"session needs {n} cache rows; the limit is {self.max_session_len}")
                pages = self._pages[row]
                need = -(-n // self.page_size) - len(pages)
                if need <= 0:
                    continue
                if need > len(self._free_pages):
                    raise KVCapacityError(f"KV pool exhausted: need {need} pages, {len(self._free_pages)} free")
                new = [self._free_pages.pop() for _ in range(need)]
                cells += [(row, len(pages) + i, p) for i, p in enumerate(new)]
                pages.extend(new)
        finally:
            if cells:
                rows_t, cols_t, pages_t = int64_to_device([list(c) for c in zip(*cells)], self.block_table.device)
                self.block_table[rows_t, cols_t] = pages_t.to(torch.int32)

    def release(self, row: int) -> None:
        self._free_pages.extend(reversed(self._pages.pop(row)))
        self._free_rows.append(row)

    # --- device-side address translation -------------------------------------------------------------
    def slots(self, rows: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        """rows [R] (block-table rows), logical [R, X] int -> physical slots [R, X] int64."""
        return block_slots(self.block_table, self.page_size, rows, logical)
