"""`ddtree demo` contract: one JSON object with text, tokens_per_s, mean_acceptance, budget; DDTree and plain
decoding agree; without models/ it falls back to the random tiny preset and says so."""

from __future__ import annotations

import json

import pytest

from gateway.cli import main
from gateway.commands import demo

KEYS = {"text", "tokens_per_s", "mean_acceptance", "budget", "ar_tokens_per_s", "identical_to_ar", "note"}


def run_json(capsys, *argv) -> dict:
    assert main(["demo", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_demo_falls_back_to_random_tiny_pair(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "default_pair", lambda: tmp_path / "absent")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = run_json(capsys, "--max-new-tokens", "12", "--budget", "8")
    assert KEYS <= out.keys() and "random tiny pair" in out["note"]
    assert out["budget"] == 8 and out["new_tokens"] == 12 and out["identical_to_ar"] is True
    assert (tmp_path / "cache" / "ddtree" / "tiny-random" / "drafter" / "config.json").exists()


@pytest.mark.skipif(not (demo.default_pair() / "drafter" / "config.json").exists(),
                    reason="models/kimi-mini is not in this checkout")
def test_demo_on_committed_pair(capsys):
    out = run_json(capsys, "--max-new-tokens", "24", "--budget", "16")
    assert KEYS <= out.keys() and out["note"] is None and out["pair"].endswith("kimi-mini")
    assert out["identical_to_ar"] is True and out["new_tokens"] == 24 and out["text"]
    assert out["mean_acceptance"] > 1.5 and out["tokens_per_s"] > 0


def test_demo_rejects_bad_flags(capsys):
    assert main(["demo", "--budget", "0"]) == 2
    assert "--budget" in capsys.readouterr().err
