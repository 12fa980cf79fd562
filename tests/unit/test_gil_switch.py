"""`--gil-switch-us`: set in microseconds, 0 leaves the interpreter's interval, negative is refused."""

from __future__ import annotations

import sys

import pytest

from gateway.commands.gil_switch import set_gil_switch


def test_sets_the_interval_in_microseconds_and_zero_leaves_it():
    before = sys.getswitchinterval()
    try:
        assert set_gil_switch(250) == pytest.approx(250, rel=1e-6)
        assert sys.getswitchinterval() == pytest.approx(250e-6)
        assert set_gil_switch(0) == pytest.approx(250, rel=1e-6)  # unchanged
        with pytest.raises(ValueError, match="gil-switch-us"):
            set_gil_switch(-1)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("component", ["verifier", "drafter"])
def test_the_serve_commands_hand_the_flag_to_run_server(component, monkeypatch):
    import importlib

    from gateway.cli import build_parser

    cmd = importlib.import_module(f"gateway.commands.{component}")
    seen = []
    monkeypatch.setattr(cmd, "run_server", lambda serve, cfg, level, name, gil_switch_us=0.0: seen.append(
        gil_switch_us) or 0)
    base = [component, "serve", "--listen", "127.0.0.1:0", "--target", "t"]
    base += ["--drafter-address", "127.0.0.1:1"] if component == "verifier" else ["--drafter", "d"]
    for extra in ([], ["--gil-switch-us", "200"]):
        args = build_parser().parse_args([*base, *extra])
        assert args.func(args) == 0
    assert seen == [0.0, 200.0]
