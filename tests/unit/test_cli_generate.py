"""The `ddtree init-random` / `ddtree generate` contract (kept stable; external checks use it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from gateway.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_init_random_then_generate_json(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "init-random", "--preset", "tiny", "--out", str(tmp_path), "--seed", "3")
    assert code == 0
    for f in ("config.json", "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / "target" / f).exists()
    assert (tmp_path / "drafter" / "config.json").exists()
    base = ["generate", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
            "--prompt", "def main():", "--max-new-tokens", "24", "--json"]
    code, out, _ = run_cli(capsys, *base, "--budget", "8", "--topk", "3", "--block-size", "8")
    dd = json.loads(out)
    assert code == 0 and dd["mode"] == "ddtree" and len(dd["tokens"]) == 24
    assert dd["steps"] == len(dd["accepted_per_step"]) and isinstance(dd["text"], str)
    assert dd["mean_acceptance"] == pytest.approx(sum(dd["accepted_per_step"]) / dd["steps"])
    code, out, _ = run_cli(capsys, *base, "--budget", "0")
    ar = json.loads(out)
    assert ar["mode"] == "ar" and ar["tokens"] == dd["tokens"] and ar["mean_acceptance"] == 1.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    assert main(["init-random", "--preset", "tiny", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("extra,needle", [
    (["--budget", "65"], "budget"),
    (["--budget", "-1"], "budget"),
    (["--block-size", "1"], "block-size"),
    (["--block-size", "16"], "block_size"),
    (["--topk", "0"], "topk"),
    (["--prompt-ids", "1,2,99999"], "vocabulary"),
    (["--prompt-ids", ""], "empty"),
    (["--prompt-ids", "1,x"], "prompt-ids"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
])
def test_bad_input_fails_before_model_work(pair, capsys, extra, needle):
    argv = ["generate", "--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--json"]
    if not any(a.startswith("--prompt") for a in extra):
        argv += ["--prompt-ids", "1,2,3"]
    code, out, err = run_cli(capsys, *argv, *extra)
    assert code != 0 and out == "" and needle in err, err


def test_drafter_for_another_target_is_refused(pair, tmp_path, capsys):
    bad = tmp_path / "drafter"
    shutil.copytree(pair / "drafter", bad)
    cfg = json.loads((bad / "config.json").read_text())
    for field, value, needle in (("hidden_size", 128, "hidden_size"), ("vocab_size", 512, "vocab_size")):
        (bad / "config.json").write_text(json.dumps({**cfg, field: value}))
        code, _, err = run_cli(capsys, "generate", "--target", str(pair / "target"), "--drafter", str(bad),
                               "--prompt-ids", "1,2", "--json")
        assert code != 0 and needle in err, err
    cfg["dflash_config"]["target_layer_ids"] = [1, 9]
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "generate", "--target", str(pair / "target"), "--drafter", str(bad),
                           "--prompt-ids", "1,2", "--json")
    assert code != 0 and "target_layer_ids" in err, err


def test_console_script_exits_nonzero(pair):
    exe = shutil.which("ddtree")
    cmd = [exe] if exe else [sys.executable, "-m", "gateway.cli"]
    r = subprocess.run([*cmd, "generate", "--target", str(pair / "target"), "--drafter", str(pair / "drafter"),
                        "--prompt-ids", "1", "--budget", "99"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "budget" in r.stderr
