"""The verifier's step request (verifier_service.step_message): the rows kept for a resend, bounded by the window,
and the DraftStep that carries them, with the older rows of a long window sent ahead in context messages."""

from __future__ import annotations

import torch

from drafter_service.api import DraftRequest
from protos.codec import draft_request_from_pb, tensor_from_pb
from protos.ddtree.v1 import drafter_pb2
from protos.shared_region import RegionArena, SharedRegion
from verifier_service.step_message import PendingRows, step_message

WIDTH = 6  # row width of the tests' context features


def _rows(start: int, n: int, dtype=torch.float16) -> torch.Tensor:
    """Rows whose values say their position (exact in fp16 for these sizes)."""
    pos = torch.arange(start, start + n, dtype=torch.float32).view(n, 1)
    return (pos * 16 + torch.arange(WIDTH, dtype=torch.float32)).to(dtype)


def _req(sid: str, start: int, n: int, root_pos: int | None = None, **kw) -> DraftRequest:
    root = start + n if root_pos is None else root_pos
    return DraftRequest(sid, start, _rows(start, n, **kw), 7, root, 16, 4)


def test_pending_rows_keep_the_window_and_restart_on_a_gap():
    p = PendingRows(window=8)
    for start, n in ((0, 3), (3, 4), (7, 5)):  # 12 rows: the first chunk goes whole, then one row of the second
        p.queue(_req("a", start, n))
    start, feats = p.rows(_req("a", 12, 0), synced=True)
    assert start == 4 and torch.equal(feats, _rows(4, 8))
    p.queue(_req("a", 20, 2))  # not contiguous with 12: only the new chunk is kept
    start, feats = p.rows(_req("a", 22, 0), synced=True)
    assert start == 20 and torch.equal(feats, _rows(20, 2))
    p.queue(_req("a", 22, 0))  # no rows: nothing changes
    assert p.rows(_req("a", 22, 0), synced=True)[0] == 20
    p.acknowledge("a")
    start, feats = p.rows(_req("a", 30, 0, root_pos=30), synced=True)
    assert (start, feats.shape[0]) == (30, 0)


def test_an_unseen_session_without_rows_starts_at_its_root():
    p = PendingRows(window=8)
    start, feats = p.rows(_req("b", 5, 0, root_pos=9), synced=False)
    assert (start, feats.shape[0]) == (9, 0)
    start, feats = p.rows(_req("b", 5, 0, root_pos=9), synced=True)
    assert (start, feats.shape[0]) == (5, 0)


def _decoded(ahead, step, regions=None):
    """-> {sid: (start, rows)} of what the drafter gets: the context messages, then the step's own rows."""
    got: dict[str, list] = {}
    for m in ahead:
        c = m.context
        t = tensor_from_pb(c.ctx_features, "ctx_features")
        got.setdefault(c.session_id, []).append((c.ctx_start, t))
    if step.HasField("ctx_features"):
        rows, at = tensor_from_pb(step.ctx_features, "ctx_features", regions), 0
        for s in step.sessions:
            got.setdefault(s.session_id, []).append((s.ctx_start, rows[at : at + s.ctx_rows]))
            at += s.ctx_rows
    else:
        for s in step.sessions:
            r = draft_request_from_pb(s, regions)
            got.setdefault(s.session_id, []).append((r.ctx_start, r.ctx_features))
    return got


def _check_contiguous(parts, start, n):
    """The parts, in order, are rows start .. start + n - 1 exactly."""
    assert parts[0][0] == start
    at = start
    for s, t in parts:
        assert s == at and torch.equal(t, _rows(at, t.shape[0]))
        at += t.shape[0]
    assert at == start + n


def test_a_long_window_goes_ahead_and_the_newest_rows_ride_in_the_step():
    p = PendingRows(window=64)
    reqs = [_req("a", 0, 40), _req("b", 100, 3), _req("c", 0, 0, root_pos=0)]
    for r in reqs:
        p.queue(r)
    row_bytes = WIDTH * 2
    room = 10 * row_bytes  # 10 rows may ride in the step
    for step_features in (True, False):
        step = drafter_pb2.DraftStep(step_id=1)
        ahead = step_message(step, reqs, p, {"a", "b"}, None, room, step_features)
        assert [(m.context.session_id, m.context.ctx_start, m.context.ctx_features.shape[0]) for m in ahead] == \
            [("a", 0, 10), ("a", 10, 10), ("a", 20, 10), ("b", 100, 3)]  # oldest first, each message up to `room`
        got = _decoded(ahead, step)
        _check_contiguous(got["a"], 0, 40)
        _check_contiguous(got["b"], 100, 3)
        assert got["a"][-1][1].shape[0] == 10  # the newest 10 rows of a fill the step; b's go ahead, all of them
        assert [s.session_id for s in step.sessions] == ["a", "b", "c"]
        assert got["c"] == [] or got["c"][0][1].shape[0] == 0
        # nothing is acknowledged by sending: b's rows stay pending for a resend
        assert torch.equal(p.rows(reqs[1], synced=True)[1], _rows(100, 3))
        assert step.HasField("ctx_features") == step_features


def test_rows_in_the_request_region(tmp_path):
    region = SharedRegion.create(1, 1 << 16, "cpu")
    try:
        p = PendingRows(window=64)
        reqs = [_req("a", 0, 5), _req("b", 50, 2)]
        for r in reqs:
            p.queue(r)
        for step_features in (True, False):
            arena = RegionArena(region)
            step = drafter_pb2.DraftStep(step_id=2)
            assert step_message(step, reqs, p, set(), arena, 1 << 20, step_features) == []
            assert arena.placed >= 1
            got = _decoded([], step, {1: region})
            _check_contiguous(got["a"], 0, 5)
            _check_contiguous(got["b"], 50, 2)
    finally:
        region.close()
