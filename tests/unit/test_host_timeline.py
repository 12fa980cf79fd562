"""telemetry.host_timeline records marks only when on, in order, flushed in batches and on demand;
bench/host_timeline.py lines steps up by `step_sent` and takes each hand-off's median."""

from __future__ import annotations

import os
import threading

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
        assert [t for _, t, _, _, _ in lines] == ["step_sent", "step_out", "step_in"]
        assert {p for p, _, _, _, _ in lines} == {str(os.getpid())}
        assert {tid for _, _, _, tid, _ in lines} == {str(threading.get_native_id())}
        ns = [int(n) for _, _, n, _, _ in lines]
        cpu = [int(c) for _, _, _, _, c in lines]
        assert ns == sorted(ns) and cpu == sorted(cpu) and cpu[0] > 0
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
    assert out["cpu"] == {} and out["side"] == {}  # records without threads; no side marks
    assert hand_offs(steps_of(lines), skip=2)["steps"] == 1


def test_cpu_time_is_taken_between_marks_of_one_thread_and_side_marks_after_step_sent():
    lines = []
    for k in range(4):  # step_sent and step_out on thread 7; step_in in another process; verify_queued on 7
        t0 = k * 10**6
        lines += [f"1 step_sent {t0} 7 {k * 10**5}", f"1 step_out {t0 + 4000} 7 {k * 10**5 + 1000 * (k + 1)}",
                  f"2 step_in {t0 + 9000} 9 {k}", f"1 verify_queued {t0 + 2000 + 1000 * k} 7 0"]
    out = hand_offs(steps_of(lines))
    assert [s[:2] for s in out["segments"]] == [("step_sent", "step_out"), ("step_out", "step_in")]
    assert out["cpu"] == {("step_sent", "step_out"): 2.5}  # 1, 2, 3, 4 us of CPU in 4 us of wall time
    med, p10, p90 = out["side"]["verify_queued"]
    assert (med, p10, p90) == (3.5, 2.0, 5.0)


def test_lead_marks_count_the_last_one_before_the_next_step():
    lines = []
    for k in range(4):  # another engine's draft_asked comes first between two steps: the last one counts
        t0 = k * 10**6
        lines += [f"1 step_sent {t0}", f"1 draft_asked {t0 + 500_000}", f"1 draft_asked {t0 + 990_000 - 1000 * k}"]
    out = hand_offs(steps_of(lines))
    assert out["lead"]["draft_asked"] == (11.0, 10.0, 12.0)  # 10, 11, 12 us before the next step_sent (3 pairs)
