"""`ddtree serve`: one command starts drafter, verifier and gateway co-located, prints the addresses,
serves and stops all three cleanly on SIGTERM or Ctrl-C.

- the tiny pair given with --target/--drafter (fp64): token-exact with the in-process engine;
- the default pair (the committed models/kimi-mini, a trained model with a real BPE tokenizer):
  DDTree through the gateway equals plain decoding through it, with acceptance well above 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from gateway.client import GatewayClient
from gateway.commands.demo import DEFAULT_PROMPT, default_pair
from gateway.text_tokenizer import decode, load_text_tokenizer
from tests.integration.harness import REPO, free_port

pytestmark = pytest.mark.integration
PROMPT = [5, 17, 99, 3]


def _check_tiny(info: dict, pair, reference) -> None:
    with GatewayClient(info["grpc"]) as c:
        r = c.generate(token_ids=PROMPT, max_tokens=12, ignore_eos=True, timeout=60)
    assert r.token_ids == reference([PROMPT], 12)[0]
    o = openai.OpenAI(base_url=f"http://{info['http']}/v1", api_key="x", max_retries=0)
    text = o.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert text == decode(load_text_tokenizer(pair[0]), r.token_ids)


def _check_trained(info: dict) -> None:
    with GatewayClient(info["grpc"]) as c:
        ar = c.generate(DEFAULT_PROMPT, max_tokens=48, ignore_eos=True, draft_budget=0, timeout=120)
        dd = c.generate(DEFAULT_PROMPT, max_tokens=48, ignore_eos=True, draft_budget=16, timeout=120)
    assert dd.token_ids == ar.token_ids and dd.text == ar.text  # lossless
    assert ar.usage.mean_accepted_length == 1.0 and dd.usage.mean_accepted_length > 1.5, dd.usage
    assert dd.usage.prompt_tokens < len(DEFAULT_PROMPT.encode())  # a real BPE: fewer tokens than bytes


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("which, how", [("tiny", "sigterm-to-ddtree"), ("default", "ctrl-c-to-the-group")])
def test_serve_starts_all_three_and_stops_them(pair, reference, which, how):
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(free_port()), "--http-port", str(free_port())]
    if which == "tiny":
        argv += ["--target", str(pair[0]), "--drafter", str(pair[1]), "--dtype", "float64"]
    elif not (default_pair() / "target" / "config.json").exists():
        pytest.skip("no committed models/kimi-mini pair (it would write a random pair to ~/.cache)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    try:
        lines: list[dict] = []
        deadline = time.monotonic() + 90
        while not any(e.get("event") == "serving" for e in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(err)[-3000:]
            line = proc.stdout.readline()
            if line.strip():
                lines.append(json.loads(line))
        info = lines[-1]
        assert {"grpc", "http", "verifier", "drafter"} <= set(info)
        deadline = time.monotonic() + 10
        while not any("OpenAI HTTP" in e for e in err) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("OpenAI HTTP" in e for e in err)  # the human-readable summary on stderr
        if which == "tiny":
            _check_tiny(info, pair, reference)
        else:
            _check_trained(info)
        if how == "sigterm-to-ddtree":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        assert proc.wait(60) == 0, "".join(err)[-3000:]
        assert json.loads(proc.stdout.readline()) == {"event": "stopped"}
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:  # no child left behind
            time.sleep(0.1)
        assert not _group_alive(proc.pid)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
