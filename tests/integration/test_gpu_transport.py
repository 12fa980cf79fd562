"""The co-located transport on the GPU: CUDA IPC regions between this process and a drafter process.

`ddtree drafter serve --device cuda` runs in its own process on the committed kimi-mini pair; this
process runs the verifier engine on the same GPU (bf16, batch-invariant, as `build_local_engine`
builds it) with the in-process drafter, and with the drafter process reached through the co-located
transport (CUDA IPC regions) and through grpc (bytes). Greedy output must be the in-process engine's
token for token, over several sessions: a concurrent wave, then a second wave with other parameters
on the same stream after the first released its sessions. No step may fall back to autoregressive,
and the co-located stream must have used its CUDA regions both ways (regions on the GPU, context
rows placed there, every step's trees read back from there, every answer handed over by the trees doorbell
our stream waits on, or by an IPC event with the doorbell off; with colocated_in_place, every step after the
stream's first written where the verifier laid it out and verified before the answer was read): no silent fallback
to bytes or to host waits.
Closing
the clients ends the streams: the drafter frees every session and mapping.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.harness import Service, drafter_info, wait_until

PAIR = Path(__file__).resolve().parents[2] / "models" / "kimi-mini"
pytestmark = [pytest.mark.integration, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not (PAIR / "drafter" / "config.json").exists(), reason="models/kimi-mini missing")]

TEXTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n',
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description=",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for line in open(path):\n        if line.startswith('#'):\n            continue\n",
    "try:\n    import json\nexcept ImportError:\n",
    "def read_config(filename):\n    with open(filename) as f:\n",
]


@pytest.fixture(scope="module")
def setup():
    from gateway.tokenizer import Tokenizer
    from verifier_service.engine import EngineConfig
    from verifier_service.local import build_local_engine

    drafter = Service("drafter-gpu", ["drafter", "serve", "--listen", "127.0.0.1:0", "--target", str(PAIR / "target"),
                                      "--drafter", str(PAIR / "drafter"), "--device", "cuda", "--dtype", "bfloat16",
                                      "--grace-s", "5"])
    try:  # the drafter loads in its process while the target loads here
        cfg = EngineConfig(num_pages=1024, max_sessions=8)
        engine = build_local_engine(PAIR / "target", PAIR / "drafter", torch.bfloat16, "cuda", cfg)
        tok = Tokenizer.load(PAIR / "target")
        address = drafter.wait_for("serving", timeout=240)
        yield dict(address=address, engine=engine, cfg=cfg, prompts=[tok.encode(t) for t in TEXTS])
    finally:
        drafter.stop()


def waves():
    from verifier_service.session import DecodeParams

    return [(slice(0, 4), DecodeParams(max_new_tokens=40, budget=16, topk=8, ignore_eos=True)),
            (slice(4, 6), DecodeParams(max_new_tokens=24, budget=6, topk=3, ignore_eos=True))]


def run(engine, prompts) -> list[list[int]]:
    return [s.output for sl, params in waves() for s in engine.generate(prompts[sl], params)]


@pytest.fixture(scope="module")
def reference(setup):
    return run(setup["engine"], setup["prompts"])


@pytest.mark.parametrize("transport", ["colocated", "colocated_in_place", "colocated_events", "grpc",
                                       "colocated_ahead", "colocated_in_place_ahead", "grpc_ahead"])
def test_split_drafter_on_the_gpu_equals_in_process(setup, reference, transport):
    """..._ahead: the engine drafts ahead (EngineConfig.draft_ahead): co-located, its steps after the first of a wave
    go out before it has read the last one back (verifier_service.ahead_steps); over gRPC right after it has
    (`draft_ahead.ask_early`)."""
    import dataclasses

    from verifier_service.engine import Engine
    from verifier_service.transport import StreamClientConfig
    from verifier_service.transport_stream import DraftStreamClient

    info = drafter_info(setup["address"])
    assert info.device.startswith("cuda") and info.dtype == "bfloat16"
    colocated, ahead = transport.startswith("colocated"), transport.endswith("_ahead")
    in_place = "on" if "in_place" in transport else "auto"
    client = DraftStreamClient(StreamClientConfig(setup["address"], colocated=colocated, region_device="cuda",
                                                  draft_timeout_s=30, doorbell=transport != "colocated_events",
                                                  trees_in_place=in_place))
    client.start()
    try:
        model = client.wait_ready(timeout=60)
        engine = Engine(setup["engine"].target, client, model.target_layer_ids,
                        dataclasses.replace(setup["cfg"], draft_ahead=ahead))
        assert run(engine, setup["prompts"]) == reference
        stats = client.stats
        assert stats["steps"] > 0 and stats["fallback_steps"] == 0 and stats["invalid_trees"] == 0, stats
        assert stats["reconnects"] == 0, stats
        if colocated:  # CUDA IPC, both ways, every step, handed over by the doorbell or by IPC events
            devices = client.region_devices
            assert devices and all(d.startswith("cuda") for d in devices.values()), devices
            assert stats["region_tensors"] > 0 and stats["region_trees"] == stats["steps"], stats
            handed = "event_steps" if transport == "colocated_events" else "doorbell_steps"
            assert client.ipc_events and stats[handed] == stats["steps"] and not stats["doorbell_timeouts"], stats
            # in place from the stream's second step on: the verify step queued before the drafter's answer
            if transport in ("colocated_in_place", "colocated_events"):  # auto: in place once the rings beat answers
                assert stats["in_place_steps"] == (stats["steps"] - 1 if in_place == "on" else 0), stats
            if ahead:  # every step but each wave's first (its sessions are new to the stream)
                assert stats["ahead_steps"] >= stats["steps"] - 2 * len(waves()) - 2, stats
                # each rang the request doorbell after its writes (the drafter queues its draft behind it)
                assert stats["request_rings"] >= stats["ahead_steps"], stats
                assert stats["in_place_steps"] >= (stats["steps"] - 1 if in_place == "on" else 0), stats
        else:
            assert client.region_devices == {} and stats["region_tensors"] == stats["region_trees"] == 0, stats
        assert drafter_info(setup["address"]).streams == 1
    finally:
        client.close()
    # the stream ended: the drafter dropped its sessions and its mappings of the regions
    wait_until(lambda: drafter_info(setup["address"]).streams == 0, what="the drafter closed the stream")
    assert drafter_info(setup["address"]).active_sessions == 0


def ahead_engine(setup, colocated: bool):
    """A stream client to the drafter process (started) and an engine drafting ahead through it."""
    import dataclasses

    from verifier_service.engine import Engine
    from verifier_service.transport import StreamClientConfig
    from verifier_service.transport_stream import DraftStreamClient

    client = DraftStreamClient(StreamClientConfig(setup["address"], colocated=colocated, region_device="cuda",
                                                  draft_timeout_s=30))
    client.start()
    try:
        model = client.wait_ready(timeout=60)
    except Exception:
        client.close()
        raise
    return client, Engine(setup["engine"].target, client, model.target_layer_ids,
                          dataclasses.replace(setup["cfg"], draft_ahead=True))


@pytest.mark.parametrize("colocated", [False, True], ids=["grpc", "colocated"])
def test_a_session_joining_drops_the_draft_asked_ahead(setup, reference, colocated):
    """Sessions join a running batch twice: the draft asked ahead for the others (over gRPC, early, its trees landing
    behind a wait on our GPU; co-located, from the device's values) is let go, waited for, and the stream goes on: no
    fallback, no reconnect, and every session's output is the in-process engine's. The drafter's errors are read
    after every step, as the scheduler does, while an early ask is on its way."""
    client, engine = ahead_engine(setup, colocated)
    try:
        (first, params), prompts = waves()[0], setup["prompts"]
        sessions = [engine.add(p, params) for p in prompts[first][:2]]

        def step():  # as the verifier's scheduler steps: the drafter's errors read after each step
            engine.step()
            assert client.take_errors() == {}

        for late in prompts[first][2:4]:
            for _ in range(2):
                step()
            assert engine.ahead is not None  # a draft asked ahead, which this join drops
            sessions.append(engine.add(late, params))
        while any(not s.done for s in sessions):
            step()
        assert [s.output for s in sessions] == reference[:4]
        stats = client.stats
        assert stats["fallback_steps"] == 0 and stats["reconnects"] == 0 and stats["invalid_trees"] == 0, stats
        assert stats["ahead_steps" if colocated else "landed_steps"] > 0, stats
    finally:
        client.close()
    wait_until(lambda: drafter_info(setup["address"]).streams == 0, what="the drafter closed the stream")


def test_a_request_ring_that_never_comes_ends_the_drafters_wait_and_the_stream(setup, reference, monkeypatch):
    """The verifier's stream skips one ring of its request doorbell (a verifier stuck mid-step, as the drafter sees
    it), a few steps in, where the drafter queues its ahead drafts behind a GPU wait for that ring: the drafter's own
    watch ends the wait at its deadline (`draft_stream.EVENT_TIMEOUT_S`, 10 s), the draft goes on from the rows our
    writes already put there, and the drafter ends the stream at our next message. The client reconnects and every
    session's output is the in-process engine's. (A drafter that polled our event instead would never stall: the
    event is recorded as usual, so the test needs the wait to pass.)"""
    import time

    from protos.doorbell import Doorbell

    rings, ring, clients = [], Doorbell.ring, []

    def ring_but_the_third(self, value, stream=None):
        # this process also rings the landing bells of answers that come by message (the first step's): only the
        # request doorbell's rings are counted, and its third is skipped
        bell = clients[0]._request_bell if clients else None
        if bell is not None and self is bell[1]:
            rings.append(value)
            if len(rings) == 3:
                return
        ring(self, value, stream)

    monkeypatch.setattr(Doorbell, "ring", ring_but_the_third)
    client, engine = ahead_engine(setup, colocated=True)
    clients.append(client)
    try:
        t0 = time.monotonic()
        assert run(engine, setup["prompts"]) == reference
        stats = client.stats
        # one stall of the drafter's deadline (armed when it queued the wait, so a little under 10 s here)
        assert rings == list(range(1, len(rings) + 1)), rings
        assert len(rings) == stats["request_rings"] > 3 and time.monotonic() - t0 >= 9.0, (rings, stats)
        assert stats["reconnects"] == 1 and stats["invalid_trees"] == 0 and not stats["doorbell_timeouts"], stats
    finally:
        client.close()
    wait_until(lambda: drafter_info(setup["address"]).streams == 0, what="the drafter closed the stream")
