"""The three services plus gateways as real processes on loopback, for the gateway's integration tests.

`start_stack(pair, gateways)` starts one drafter, one verifier (co-located transport, float64 like
the in-process reference) and one gateway process per entry of `gateways` (name -> extra flags and
environment), all on free ports, and stops everything on exit. Also: the sampled in-process
reference (autoregressive with the same seed; DDTree must equal it) and small helpers.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from tests.integration.harness import (
    Service,
    drafter_argv,
    drafter_info,
    free_port,
    verifier_argv,
    verifier_info,
    wait_until,
)


@dataclass
class Gateway:
    grpc: str
    http: str
    service: Service


@dataclass
class Stack:
    drafter: str
    verifier: str
    gateways: dict[str, Gateway] = field(default_factory=dict)

    def idle(self) -> bool:
        """No session holds KV on the verifier, and the drafter holds no context."""
        info = verifier_info(self.verifier)
        return (info.kv_pages_free == info.kv_pages_total and info.open_sessions == 0
                and drafter_info(self.drafter).active_sessions == 0)

    def wait_idle(self, what: str = "KV freed on the verifier and the drafter") -> None:
        wait_until(self.idle, timeout=20, what=what)


@contextmanager
def environment(**values: str | None):
    """Set (or unset, with None) environment variables while a child process is created."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def gateway_argv(verifier: str, tokenizer, *extra: str) -> list[str]:
    return ["gateway", "serve", "--listen", "127.0.0.1:0", "--http-listen", f"127.0.0.1:{free_port()}",
            "--verifier-address", verifier, "--tokenizer", str(tokenizer), "--grace-s", "5", *extra]


def start_gateway(name: str, verifier: str, tokenizer, *extra: str, api_key: str | None = None) -> Gateway:
    """One more gateway for a running verifier; waits until it serves. The caller stops `.service`."""
    with environment(DDTREE_API_KEY=api_key):
        svc = Service(name, gateway_argv(verifier, tokenizer, *extra))
    try:
        addr = svc.wait_for("serving")
    except BaseException:
        svc.stop()
        raise
    return Gateway(addr, svc.seen["http_listening"]["address"], svc)


@contextmanager
def start_stack(pair, gateways: dict[str, tuple[list[str], str | None]]):
    """gateways: name -> (extra `gateway serve` flags, API key or None)."""
    procs: list[Service] = []
    t0 = time.monotonic()
    try:
        d = Service("drafter", drafter_argv(pair, "127.0.0.1:0"))
        procs.append(d)
        da = d.wait_for("listening")
        v = Service("verifier", verifier_argv(pair, "127.0.0.1:0", da))
        procs.append(v)
        va = v.wait_for("listening")
        stack = Stack(da, va)
        for name, (flags, key) in gateways.items():  # they wait for the verifier themselves
            with environment(DDTREE_API_KEY=key):
                svc = Service(f"gateway-{name}", gateway_argv(va, pair[0], *flags))
            procs.append(svc)
            stack.gateways[name] = Gateway("", "", svc)
        d.wait_for("serving")
        v.wait_for("serving")
        for g in stack.gateways.values():
            g.grpc = g.service.wait_for("serving")
            g.http = g.service.seen["http_listening"]["address"]
        print(f"gateway stack up in {time.monotonic() - t0:.1f} s")
        yield stack
    finally:
        for p in reversed(procs):
            p.stop()


def sampled_reference(reference, prompt: list[int], new: int, temperature: float, top_p: float = 1.0,
                      top_k: int = 0, seed: int = 0) -> list[int]:
    """Autoregressive sampling of the in-process engine (fp64) with this seed: what DDTree must emit."""
    from verifier_service.engine import Engine, EngineConfig
    from verifier_service.sampling_params import SamplingParams
    from verifier_service.session import DecodeParams

    eng = Engine(reference.target, None, (), EngineConfig(page_size=16, num_pages=256, max_sessions=1))
    params = DecodeParams(max_new_tokens=new, budget=0, ignore_eos=True,
                          sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed))
    with torch.no_grad():
        (s,) = eng.generate([prompt], params)
    return s.output
