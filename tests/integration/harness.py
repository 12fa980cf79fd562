"""Real service processes on loopback for the integration tests, and a small verifier client.

`Service` starts `python -m gateway.cli ...` (or a test drafter module) in its own process group,
reads the JSON lifecycle lines it prints (`listening`, `serving`, `stopped`) and always cleans up:
SIGTERM, then SIGKILL, by process id. Servers run one torch thread each (2 CPU cores shared).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from protos.ddtree.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, name: str, argv: list[str], module: str = "gateway.cli", env: dict[str, str] | None = None):
        self.name = name
        self.events: queue.Queue = queue.Queue()
        self.seen: dict[str, dict] = {}
        self._stderr = tempfile.NamedTemporaryFile(prefix=f"ddtree-{name}-", suffix=".log", delete=False)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(ev, dict) and "event" in ev:
                self.seen[ev["event"]] = ev
                self.events.put(ev)

    def wait_for(self, event: str, timeout: float = START_TIMEOUT) -> str:
        """Block until the process prints {"event": event}; returns its address."""
        deadline = time.monotonic() + timeout
        while event not in self.seen:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before {event!r}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {event!r} within {timeout} s:\n{self.log()}")
            try:
                self.events.get(timeout=0.1)
            except queue.Empty:
                pass
        return self.seen[event]["address"]

    def log(self) -> str:
        return Path(self._stderr.name).read_text()[-4000:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a few seconds; never leaves the process behind."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(5)
        self._stderr.close()
        os.unlink(self._stderr.name)


def drafter_argv(pair, listen: str, *extra: str) -> list[str]:
    return ["drafter", "serve", "--listen", listen, "--target", str(pair[0]), "--drafter", str(pair[1]),
            "--dtype", "float64", "--grace-s", "5", *extra]


def verifier_argv(pair, listen: str, drafter: str | None, *extra: str) -> list[str]:
    argv = ["verifier", "serve", "--listen", listen, "--target", str(pair[0]), "--dtype", "float64",
            "--grace-s", "10", "--page-size", "16"]
    return argv + (["--drafter-address", drafter] if drafter else []) + list(extra)


# --- client side ---------------------------------------------------------------------------------------
def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address)


def verifier_stub(ch: grpc.Channel) -> verifier_pb2_grpc.VerifierStub:
    return verifier_pb2_grpc.VerifierStub(ch)


def drafter_info(address: str) -> drafter_pb2.DrafterInfo:
    with channel(address) as ch:
        return drafter_pb2_grpc.DrafterStub(ch).Info(drafter_pb2.DrafterInfoRequest(), timeout=10)


def verifier_info(address: str) -> verifier_pb2.VerifierInfo:
    with channel(address) as ch:
        return verifier_stub(ch).Info(verifier_pb2.InfoRequest(), timeout=10)


def request(sid: str, tokens: list[int], max_new: int, budget: int, topk: int = 4,
            **kw) -> verifier_pb2.GenerateRequest:
    return verifier_pb2.GenerateRequest(session_id=sid, tokens=tokens, params=verifier_pb2.DecodeParams(
        max_new_tokens=max_new, budget=budget, topk=topk, ignore_eos=True), **kw)


def generate(stub, req, timeout: float = 60.0) -> tuple[list[int], list[verifier_pb2.GenerateResponse]]:
    """Run one turn to its end: (tokens, every response)."""
    msgs = list(stub.Generate(req, timeout=timeout))
    return [t for m in msgs for t in m.tokens], msgs


def wait_until(pred, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)
