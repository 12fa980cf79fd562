"""The persistent MLA kernel's bookkeeping (kernels/_mla_gluon_persistent.py), checked on the CPU.

Gluon has no interpreter, so the kernel itself only runs on a GPU (tests/kernels/test_mla_attention_gpu.py's
persistent tests). This file replays the kernel's scalar control flow (the loader, the computer, the pending record,
the stage and query barriers, the cp.async groups) line for line in Python over real work lists (the kernel's own
chunk rule on host ints) and checks what a mistake there would break on the GPU: every non-empty (query tile, chunk)
item of the program is computed once, tiles in order; a tile is waited on the phase its stage's barrier completes
and is the tile last loaded into that stage; no stage or query tile is reloaded while an MMA still reads it; the
pending record is never overwritten; nothing is left in flight at the end. Keep it in step with the kernel.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kernels.mla_attention import CHUNK_RULES, chunk_spans, max_chunks

BLOCK_N = 64


@dataclass
class Item:
    w: int
    pid_c: int
    nc: int
    start: int
    end: int
    n_tiles: int
    n_tma: int


def work_list(rows, sessions, cap, rule, box):
    """rows: [(p, L)] per query tile (position, committed rows of its session), sessions: [(L, n)], cap: the block
    table's rows -> item(w), TOTAL (the kernel's nc_max bound), tiles, nc_max, the grid's chunk count."""
    gc = max_chunks(cap, rule)
    k_max = max(L + n for L, n in sessions)  # as the kernel: prefix + new rows, the most keys a row can have
    nc_max = max(1, min(-(-k_max // 512), 16, gc))
    tiles = len(rows)

    def item(w):
        pid_t, pid_c = w % tiles, w // tiles
        p, L = rows[pid_t]
        spans = chunk_spans(p, rule)
        nc = len(spans)
        start, end = spans[pid_c] if pid_c < nc else (0, 0)
        ident = min(end, L)
        n_tma = max(ident - start, 0) // BLOCK_N if box else 0
        return Item(w, pid_c, nc, start, end, -(-(end - start) // BLOCK_N), n_tma)

    return item, tiles * nc_max, tiles, nc_max, gc


def run_program(item, TOTAL, NPROG, pid):
    """The kernel's control flow for program `pid`; returns the (w, j) it computes in order and the items it
    stores, asserting the invariants of the module docstring."""
    log, stored = [], []
    stage_tiles = [[], []]  # per stage: the tiles loaded into it, as (g, tma)
    stage_waits = [0, 0]  # TMA completions waited per stage
    reading = {0: None, 1: None}  # stage -> tile an MMA may still read
    q_loads, q_waits = [], 0
    g_load = 0  # next global tile index the loader issues
    s_done = -1  # the last tile whose S is done

    def next_item(w):  # _next_item / _find_item: None when nothing is left
        while w < TOTAL:
            it = item(w)
            if it.pid_c < it.nc:
                return it
            w += NPROG
        return None

    def issue(stage, lit, lj, pend):  # _issue
        nonlocal g_load
        if lit is None:
            return pend
        assert reading[stage] is None, f"stage {stage} reloaded while tile {reading[stage]} is read"
        stage_tiles[stage].append((g_load, lj < lit.n_tma))
        g_load += 1
        if lj == 0:  # a new item's query tile: every earlier tile's S must be done
            assert s_done == g_load - 2, "query tile reloaded while an S may read it"
            assert pend is None, "pending record overwritten"
            q_loads.append(lit.w)
            pend = lit
        return pend

    def advance(lit, lj):
        if lit is None:
            return None, lj
        lj += 1
        if lj == lit.n_tiles:
            return next_item(lit.w + NPROG), 0
        return lit, lj

    def wait_tile(g, stage, tma, ph):
        assert stage_tiles[stage][-1][0] == g, f"tile {g} is no longer in stage {stage}"
        assert stage_tiles[stage][-1][1] == tma
        if tma:
            done = stage_waits[stage]
            assert done % 2 == ph, f"tile {g}: phase {ph} waited, the barrier completes {done % 2}"
            assert sum(t for _, t in stage_tiles[stage]) == done + 1, "a TMA tile waited twice or skipped"
            stage_waits[stage] += 1

    # prologue: tile 0 and the first query tile, taken by the computer at once
    lit = next_item(pid)
    if lit is None:
        return log, stored
    lj = 0
    cit = issue(0, lit, lj, None)
    pending = None
    lit, lj = advance(lit, lj)
    tph = 0
    wait_tile(0, 0, cit.n_tma > 0, 0)
    if cit.n_tma > 0:
        tph = 1
    assert q_loads[q_waits] == cit.w
    q_waits += 1
    s_done = 0  # S_0, then a CTA barrier
    cj, stage, g = 0, 0, 0
    while cit is not None:
        pending = issue(1 - stage, lit, lj, pending)  # tile g + 1
        lit, lj = advance(lit, lj)
        log.append((cit.w, cj))
        reading[stage] = g  # PV_g in flight
        last = cj + 1 == cit.n_tiles
        if not last or pending is not None:
            nxt = 1 - stage
            n_tma = (pending.n_tma > 0) if last else (cj + 1 < cit.n_tma)
            wait_tile(g + 1, nxt, n_tma, (tph >> nxt) & 1)
            if n_tma:
                tph ^= 1 << nxt
            if last:
                assert q_loads[q_waits] == pending.w, "S of a new item before its query tile was loaded"
                q_waits += 1
            s_done = g + 1  # S_{g+1} issued and waited here
        else:
            assert lit is None, "the loader has tiles the computer will never reach"
        reading[stage] = None  # PV_g waited, CTA barrier
        if last:
            stored.append(cit.w)
            cit, pending, cj = pending, None, 0
        else:
            cj += 1
        stage = 1 - stage
        g += 1
    assert g_load == g, "tiles loaded and never computed"
    assert q_waits == len(q_loads) and all(sum(t for _, t in s) == n for s, n in zip(stage_tiles, stage_waits))
    return log, stored


def random_rows(rng, count, tree):
    rows, sessions = [], []
    for _ in range(count):
        L = rng.choice([0, 1, 63, 64, 65, 500, 1000, 2047, 4097, 9001, rng.randrange(0, 20000)])
        n = rng.choice([0, 1, 2, 9, 33, 65])
        depths = [0] + [rng.randrange(1, i + 1) for i in range(1, n)] if tree else list(range(n))
        rows += [(L + d, L) for d in depths[:n]]
        sessions.append((L, n))
    return rows, sessions


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("box", [0, 16])
def test_persistent_schedule_covers_every_item_in_order(seed, box):
    rng = random.Random(seed)
    rows, sessions = random_rows(rng, rng.randrange(1, 6), tree=seed % 2 == 0)
    if not rows:
        rows, sessions = [(0, 0)], [(0, 1)]
    cap = max(L + n for L, n in sessions) + rng.choice([0, 5000])  # spare block-table rows: empty chunk indices
    for rule in CHUNK_RULES:
        item, total, tiles, nc_max, gc = work_list(rows, sessions, cap, rule, box)
        assert nc_max <= gc
        want = [w for w in range(tiles * gc) if item(w).pid_c < item(w).nc]
        assert all(w < total for w in want), "an item past the nc_max bound"
        for nprog in {1, 3, 132, min(tiles * gc, 132)}:
            done = []
            for pid in range(nprog):
                log, stored = run_program(item, total, nprog, pid)
                mine = [w for w in want if w % nprog == pid]
                assert stored == mine
                assert log == [(w, j) for w in mine for j in range(item(w).n_tiles)]
                done += stored
            assert sorted(done) == want
