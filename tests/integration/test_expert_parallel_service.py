"""`ddtree verifier serve` under torchrun with 2 ranks on CPU (gloo): the deploy/k8s multi-gpu command.

Rank 0 alone binds the gRPC and metrics ports and serves; rank 1 holds the other half of the experts
and replays rank 0's forwards. Greedy DDTree output over gRPC equals the single-process autoregressive
reference; SIGTERM to torchrun drains rank 0, which then stops rank 1; both ranks exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.integration.harness import Service, free_port, request, verifier_argv, verifier_info
from tests.integration.test_split_services import PROMPTS, TREE, run_concurrently

pytestmark = pytest.mark.integration


def test_two_ranks_serve_exactly_and_stop_cleanly(pair, reference):
    argv = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "--module", "gateway.cli",
            *verifier_argv(pair, "127.0.0.1:0", None, "--transport", "inprocess", "--drafter", str(pair[1]),
                           "--device", "cpu", "--metrics-listen", "127.0.0.1:0", "--dist-timeout-s", "60")]
    v = Service("verifier-ep", argv, module="torch.distributed.run")
    try:
        addr = v.wait_for("serving", timeout=120)
        assert v.wait_for("metrics_listening")
        results = run_concurrently(addr, [request(f"ep-{i}", p, 16, 16) for i, p in enumerate(PROMPTS[:2])])
        assert [t for t, _ in results] == reference(PROMPTS[:2], 16)
        assert {m.stats.tree_size for _, msgs in results for m in msgs[1:]} == {TREE}  # DDTree steps, verified
        assert verifier_info(addr).drafter_connected
        v.signal(signal.SIGTERM)  # torchrun forwards it to both ranks, then exits 1 (it re-raises signals)
        v.wait_exit(60)
        log = v.log()
        assert "rank 1: stop from rank 0" in log, log  # rank 1 waited for rank 0's drain, then stopped cleanly
        assert "ChildFailedError" not in log and "SIGKILL" not in log, log  # both ranks exited 0, in time
        assert log.count("rank 1 of 2 joined") == 1 and "rank 1 following rank 0" in log
    except subprocess.TimeoutExpired:
        os.killpg(v.proc.pid, signal.SIGKILL)  # torchrun and its ranks: the session this test started
        raise
    finally:
        v.stop()
