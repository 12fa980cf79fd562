"""The gateway's command line: the exact flags the Kubernetes manifests use, DDTREE_API_KEY read only by
the CLI, `ddtree serve`'s model pair choice, `ddtree generate --target | --server`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.cli import build_parser, main
from gateway.commands import serve as serve_cmd
from gateway.commands.gateway import config_from_args
from gateway.state import GatewayConfig

GATEWAY = ["gateway", "serve", "--listen", "0.0.0.0:50050", "--http-listen", "0.0.0.0:8080", "--verifier-address",
           "ddtree-verifier:50051", "--tokenizer", "/models/k", "--model-name", "kimi", "--max-queue", "7",
           "--metrics-listen", "0.0.0.0:9400"]


def strict(only: str | None = None) -> argparse.ArgumentParser:
    p = build_parser(only)
    for sub in (a for a in p._actions if isinstance(a, argparse._SubParsersAction)):
        for q in sub.choices.values():
            q.allow_abbrev = False
            for inner in (a for a in q._actions if isinstance(a, argparse._SubParsersAction)):
                for r in inner.choices.values():
                    r.allow_abbrev = False
    return p


@pytest.mark.parametrize("only", [None, "gateway"])
def test_gateway_serve_flags_contract(only):
    a = strict(only).parse_args(GATEWAY)
    assert (a.listen, a.http_listen, a.verifier_address, a.tokenizer, a.model_name, a.max_queue, a.metrics_listen) \
        == ("0.0.0.0:50050", "0.0.0.0:8080", "ddtree-verifier:50051", "/models/k", "kimi", 7, "0.0.0.0:9400")
    cfg = config_from_args(a, {"DDTREE_API_KEY": "k"})
    assert cfg.api_key == "k" and cfg.max_queue == 7 and cfg.model_name == "kimi"
    assert config_from_args(a, {}).api_key is None and config_from_args(a, {"DDTREE_API_KEY": ""}).api_key is None


def test_serve_and_generate_flags_contract():
    a = strict().parse_args(["serve", "--target", "T", "--drafter", "D", "--host", "0.0.0.0", "--port", "1",
                             "--http-port", "2"])
    assert (a.target, a.drafter, a.host, a.port, a.http_port) == ("T", "D", "0.0.0.0", 1, 2)
    d = strict().parse_args(["serve"])
    assert (d.target, d.drafter, d.host, d.port, d.http_port) == (None, None, "127.0.0.1", 50050, 8080)
    g = strict().parse_args(["generate", "--server", "h:1", "--prompt", "x"])
    assert g.server == "h:1" and g.target is None
    for argv in (["generate", "--prompt", "x"], ["generate", "--server", "h:1", "--target", "t", "--prompt", "x"]):
        with pytest.raises(SystemExit):
            strict().parse_args(argv)


def test_generate_flag_misuse_is_reported(capsys):
    assert main(["generate", "--server", "127.0.0.1:1", "--prompt", "x", "--drafter", "d"]) == 2
    assert "--drafter and --block-size describe a local model" in capsys.readouterr().err
    assert main(["generate", "--target", "t", "--prompt", "x", "--stop", "a"]) == 2
    assert "--stop and --timeout apply to --server" in capsys.readouterr().err


def test_serve_model_pair(tmp_path, monkeypatch):
    ns = argparse.Namespace(target="t", drafter=None)
    with pytest.raises(ValueError, match="--target and --drafter go together"):
        serve_cmd.model_pair(ns)
    assert serve_cmd.model_pair(argparse.Namespace(target="t", drafter="d")) == (Path("t"), Path("d"), None)
    import gateway.commands.demo as demo

    monkeypatch.setattr(demo, "default_pair", lambda: tmp_path / "absent")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    target, drafter, note = serve_cmd.model_pair(argparse.Namespace(target=None, drafter=None))
    assert target == tmp_path / "cache" / "ddtree" / "tiny-random" / "target" and "random tiny" in note
    assert (target / "tiktoken.model").exists() and (drafter / "config.json").exists()
    present = tmp_path / "pair"
    for sub in ("target", "drafter"):
        (present / sub).mkdir(parents=True)
        (present / sub / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "default_pair", lambda: present)
    assert serve_cmd.model_pair(argparse.Namespace(target=None, drafter=None)) == (present / "target",
                                                                                   present / "drafter", None)


def test_serve_checks_before_starting_anything(tmp_path, capsys):
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be a port number" in capsys.readouterr().err
    assert main(["serve", "--target", str(tmp_path), "--drafter", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("kw, words", [
    ({"max_queue": -1}, "max_queue"), ({"max_sessions": 0}, "max_sessions"), ({"grace_s": -1}, "grace"),
    ({"api_key": ""}, "empty API key"), ({"default_max_tokens": 0}, "max_tokens"),
])
def test_gateway_config_is_validated(kw, words):
    with pytest.raises(ValueError, match=words):
        GatewayConfig(listen="a:1", http_listen=None, verifier_address="v:1", tokenizer_dir="t", **kw)
