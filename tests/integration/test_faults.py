"""Faults between the verifier and its drafter, with real processes on loopback.

- an oracle drafter gets trees accepted deep: multi-token commits and context streaming through
  both transports stay token-exact;
- a drafter that sends a malformed tree for one session fails that session (INVALID_ARGUMENT)
  and nobody else;
- a drafter killed mid-generation: every session finishes autoregressively with the same tokens;
  a drafter started again on the same address is picked up and drafting resumes.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal

import grpc
import pytest

from tests.integration.harness import (
    Service,
    channel,
    drafter_argv,
    drafter_info,
    free_port,
    generate,
    request,
    verifier_argv,
    verifier_info,
    verifier_stub,
    wait_until,
)

pytestmark = pytest.mark.integration
PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7], list(range(60, 72))]
TREE = 17


def fake_drafter(pair, listen, *flags):
    return Service("fake-drafter", [*flags, *drafter_argv(pair, listen)[2:]], module="tests.integration.fake_drafter")


def idle(addr) -> bool:
    info = verifier_info(addr)
    return info.kv_pages_free == info.kv_pages_total and info.open_sessions == 0


@pytest.mark.parametrize("transport", ["colocated", "grpc"])
def test_oracle_trees_accepted_deep_through_the_wire(pair, reference, tmp_path, transport):
    new = 40
    ref = reference(PROMPTS, new)
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({f"o{i}": p + r for i, (p, r) in enumerate(zip(PROMPTS, ref))}))
    d = fake_drafter(pair, "127.0.0.1:0", "--oracle", str(oracle))
    v = None
    try:
        v = Service("verifier", verifier_argv(pair, "127.0.0.1:0", d.wait_for("serving"), "--transport", transport))
        addr = v.wait_for("serving")
        with channel(addr) as ch, concurrent.futures.ThreadPoolExecutor(3) as pool:
            stub = verifier_stub(ch)
            results = list(pool.map(lambda i: generate(stub, request(f"o{i}", PROMPTS[i], new, 16)), range(3)))
        assert [t for t, _ in results] == ref
        accepted = [m.stats.accepted_length for _, msgs in results for m in msgs[1:]]
        assert max(accepted) >= 5 and sum(accepted) / len(accepted) > 2.0, accepted
    finally:
        for p in (v, d):
            if p is not None:
                p.stop()


def test_corrupt_tree_fails_only_its_session(pair, reference):
    new = 20
    d = fake_drafter(pair, "127.0.0.1:0", "--corrupt", "bad")
    v = None
    try:
        da = d.wait_for("serving")
        v = Service("verifier", verifier_argv(pair, "127.0.0.1:0", da, "--transport", "grpc"))
        addr = v.wait_for("serving")
        reqs = [request("good-0", PROMPTS[0], new, 16), request("bad-1", PROMPTS[1], new, 16),
                request("good-2", PROMPTS[2], new, 16)]
        with channel(addr) as ch, concurrent.futures.ThreadPoolExecutor(3) as pool:
            stub = verifier_stub(ch)
            futs = [pool.submit(generate, stub, r) for r in reqs]
            with pytest.raises(grpc.RpcError) as e:
                futs[1].result()
            good = [futs[0].result()[0], futs[2].result()[0]]
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invalid tree" in e.value.details() and "not an earlier node" in e.value.details()
        assert good == reference([PROMPTS[0], PROMPTS[2]], new)
        wait_until(lambda: idle(addr), what="verifier KV freed")
        wait_until(lambda: drafter_info(da).active_sessions == 0, what="drafter contexts freed")
    finally:
        for p in (v, d):
            if p is not None:
                p.stop()


def test_drafter_killed_mid_generation_falls_back_and_reconnects(pair, reference):
    new = 80
    ref = reference(PROMPTS, new)
    port = free_port()
    d = Service("drafter", drafter_argv(pair, f"127.0.0.1:{port}"))
    v = d2 = None
    try:
        v = Service("verifier", verifier_argv(pair, "127.0.0.1:0", d.wait_for("serving"), "--draft-timeout-s", "2"))
        addr = v.wait_for("serving")
        with channel(addr) as ch:
            stub = verifier_stub(ch)
            calls = [stub.Generate(request(f"k{i}", p, new, 16), timeout=120) for i, p in enumerate(PROMPTS)]
            heads = [[next(c), next(c)] for c in calls]  # prefill + one drafted step each
            assert all(h[1].stats.tree_size == TREE for h in heads)
            d.signal(signal.SIGKILL)
            d.wait_exit(10)
            rest = [list(c) for c in calls]
        for h, r, expected in zip(heads, rest, ref):
            assert [t for m in h + r for t in m.tokens] == expected
            assert r[-1].stats.tree_size == 1  # finished autoregressively
        assert not verifier_info(addr).drafter_connected
        wait_until(lambda: idle(addr), what="KV freed")

        d2 = Service("drafter-again", drafter_argv(pair, f"127.0.0.1:{port}"))
        d2.wait_for("serving")
        wait_until(lambda: verifier_info(addr).drafter_connected, timeout=20, what="verifier reconnected")
        with channel(addr) as ch:
            tokens, msgs = generate(verifier_stub(ch), request("after", PROMPTS[0], 30, 16))
        assert tokens == reference([PROMPTS[0]], 30)[0]
        assert {m.stats.tree_size for m in msgs[1:]} == {TREE}  # drafting again
    finally:
        for p in (v, d, d2):
            if p is not None:
                p.stop()
