"""The KV chunk rules (kernels/mla_attention.py `chunk_spans`, the kernels' own `chunk_span` on host ints; pure
Python): chunks tile 0..p at tile boundaries, none empty or short, at most NCH, the launcher's grid covers them, and
the balanced rule's counts at the benchmark's prefixes."""

from __future__ import annotations

import pytest

from kernels.mla_attention import _C_MIN, _NCH, CHUNK_RULES, DEFAULT_BLOCK_N, chunk_spans, max_chunks

RULES = sorted(CHUNK_RULES)

KNOBS = [  # block_n, nch, c_min
    (DEFAULT_BLOCK_N, _NCH, _C_MIN), (16, 4, 32), (16, 4, 16), (16, 8, 64), (64, 16, 64), (32, 3, 96)]


def chunk_lengths(p: int, rule: str, block_n: int, nch: int, c_min: int) -> list[int]:
    """Key counts of the chunks of position p; checks they tile 0..p in order at tile boundaries."""
    spans = chunk_spans(p, rule, block_n, nch, c_min)
    assert 1 <= len(spans) <= nch, (p, spans)
    assert spans[0][0] == 0 and spans[-1][1] == p + 1, (p, spans)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (p, spans)
    assert all(s % block_n == 0 and e > s for s, e in spans), f"p={p}: unaligned or empty chunk in {spans}"
    return [e - s for s, e in spans]


@pytest.mark.parametrize("chunk_rule", RULES)
@pytest.mark.parametrize("block_n,nch,c_min", KNOBS)
def test_chunk_rule_properties(block_n, nch, c_min, chunk_rule):
    """For every position up to past the cap (and a sample far beyond): chunks cover 0..p in order,
    start at tile boundaries, none is empty, at most NCH of them, and `max_chunks(cap)` (the
    launcher's grid) covers every position < cap. Balanced: the chunk count is round(K / C_MIN)
    clamped to [1, NCH] and never decreases; chunks are floor or ceil of tiles / nc tiles with the
    ceil last, so the last chunk is never short; a row with several chunks has none below C_MIN / 2.
    The spans depend on p and the fixed knobs alone: `chunk_spans` gets nothing else."""
    top = 2 * nch * c_min + 3 * block_n
    positions = list(range(top)) + list(range(top, 64 * nch * c_min, 997)) + [2**20 - 1, 2**24 + 7]
    seen = 0  # largest chunk count so far
    for p in positions:
        K = p + 1
        lens = chunk_lengths(p, chunk_rule, block_n, nch, c_min)
        nc = len(lens)
        seen = max(seen, nc)
        assert max_chunks(K, chunk_rule, block_n, nch, c_min) >= seen, f"grid of cap {K} misses a chunk"
        if chunk_rule != "balanced":
            continue
        assert nc == max(1, min(nch, (2 * K + c_min) // (2 * c_min))), (p, nc)  # round half up
        assert nc == seen, f"p={p}: chunk count went down"
        assert max_chunks(K, chunk_rule, block_n, nch, c_min) == nc
        tiles = -(-K // block_n)
        counts = [-(-n // block_n) for n in lens]
        assert set(counts) <= {tiles // nc, -(-tiles // nc)} and counts[-1] == -(-tiles // nc), (p, lens)
        assert lens[-1] > max(lens) - block_n, f"p={p}: short last chunk {lens}"
        assert nc == 1 or min(lens) >= c_min // 2, f"p={p}: short chunk {lens}"


def test_chunk_rule_examples():
    """The default knobs at the benchmark's prefixes: legacy's one-key last chunks are gone, and with
    32-key tiles the chunk count never exceeds legacy's (never more partials). With 64-key tiles (the
    default) legacy rounds its chunk size up to 576 keys above 8192 keys and can have one chunk fewer."""
    b32 = dict(block_n=32)
    assert chunk_spans(1024, "legacy", **b32) == [(0, 512), (512, 1024), (1024, 1025)]
    assert chunk_spans(1024, **b32) == [(0, 512), (512, 1025)]
    assert [e - s for s, e in chunk_spans(4096 + 10, **b32)] == [512] * 7 + [523]
    assert len(chunk_spans(4096 + 10, "legacy", **b32)) == 9
    assert chunk_spans(8192, "legacy", **b32)[-1] == (8160, 8193)  # C = 544: a 33-key 16th chunk
    assert chunk_spans(8192, **b32)[-1] == (7680, 8193)
    assert [e - s for s, e in chunk_spans(32768 + 20, **b32)] == [2048] * 15 + [2069]
    assert len(chunk_spans(766, **b32)) == 1 and len(chunk_spans(767, **b32)) == 2  # 1.5 C_MIN: rounds up
    for p in range(0, 40000, 7):
        assert len(chunk_spans(p, **b32)) <= len(chunk_spans(p, "legacy", **b32)), p
    assert DEFAULT_BLOCK_N == 64
    assert chunk_spans(1024) == [(0, 512), (512, 1025)]
    assert [e - s for s, e in chunk_spans(4096 + 10)] == [512] * 7 + [523]
    assert chunk_spans(8192, "legacy")[-1] == (8064, 8193) and len(chunk_spans(8192, "legacy")) == 15
    assert chunk_spans(8192)[-1] == (7680, 8193) and len(chunk_spans(8192)) == 16
    assert [e - s for s, e in chunk_spans(32768 + 20)] == [2048] * 15 + [2069]
    assert len(chunk_spans(766)) == 1 and len(chunk_spans(767)) == 2
    with pytest.raises(ValueError):
        chunk_spans(5, "new")
