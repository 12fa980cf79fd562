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


def test_the_serve_commands_take_the_flag():
    from gateway.cli import build_parser

    p = build_parser()
    args = p.parse_args(["drafter", "serve", "--listen", "127.0.0.1:0", "--target", "t", "--drafter", "d",
                         "--gil-switch-us", "200"])
    assert args.gil_switch_us == 200
    args = p.parse_args(["verifier", "serve", "--listen", "127.0.0.1:0", "--target", "t"])
    assert args.gil_switch_us == 0
