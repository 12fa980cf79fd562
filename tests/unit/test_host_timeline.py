"""telemetry.host_timeline records marks only when on, in order, flushed in batches and on demand;
bench/host_timeline.py lines steps up by `step_sent` and takes each hand-off's median."""

from __future__ import annotations

import os

from bench.host_timeline import hand_offs, steps_of
from telemetry import host_timeline


def test_marks_are_recorded_only_when_on(tmp_path, monkeypatch):
    path = tmp_path / "tl.log"
    monkeypatch.setattr(host_timeline, "_records", [])
    host_timeline.enable(None)
    host_timeline.mark("step_sent")
    assert host_timeline._records == [] and not path.exists()
    host_timeline.enable(str(path))
    try:
        for tag in ("step_sent", "step_out", "step_in"):
            host_timeline.mark(tag)
        assert not path.exists()  # held until a batch is full or a flush
        host_timeline.flush()
        lines = [line.split() for line in path.read_text().splitlines()]
        assert [t for _, t, _ in lines] == ["step_sent", "step_out", "step_in"]
        assert {p for p, _, _ in lines} == {str(os.getpid())}
        ns = [int(n) for _, _, n in lines]
        assert ns == sorted(ns)
        monkeypatch.setattr(host_timeline, "FLUSH_EVERY", 2)
        host_timeline.mark("draft_begin")
        host_timeline.mark("draft_queued")  # the second fills the batch: appended
        assert path.read_text().splitlines()[-1].split()[1] == "draft_queued"
    finally:
        host_timeline.enable(None)


def test_steps_line_up_by_step_sent_and_drop_incomplete_ones():
    def step(t0, gaps):  # marks step_sent, step_out, step_in with these gaps (ns), two processes
        tags = ("step_sent", "step_out", "step_in")
        times = [t0, t0 + gaps[0], t0 + gaps[0] + gaps[1]]
        return [f"{1 if tag != 'step_in' else 2} {tag} {t}" for tag, t in zip(tags, times)]

    lines = step(0, (1000, 3000)) + step(10**6, (2000, 1000)) + step(2 * 10**6, (3000, 2000))
    lines += ["1 step_sent 3000000"]  # a last step that never went out: dropped
    lines.reverse()  # order in the file does not matter: time does
    out = hand_offs(steps_of(lines))
    assert out["marks"] == ["step_sent", "step_out", "step_in"] and out["steps"] == 3
    (a, b, med, p10, p90), (c, d, med2, _, _) = out["segments"]
    assert (a, b, med, p10, p90) == ("step_sent", "step_out", 2.0, 1.0, 3.0)
    assert (c, d, med2) == ("step_out", "step_in", 2.0)
    assert out["added_us"] is None  # no draft_begin / answer marks in this log
    assert hand_offs(steps_of(lines), skip=2)["steps"] == 1
