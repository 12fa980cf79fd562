"""Run a script that compiles Gluon kernels for sm_90 (PTX + ptxas, no GPU needed) in a subprocess and return the
JSON object it prints last. A subprocess, because the test process may run Triton in interpreter mode; skipped
where the installed Triton cannot compile Gluon for sm_90."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_sm90_script(tmp_path, script: str, *args: str, timeout: float = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton_cache"), TRITON_DUMP_PTXAS_LOG="1")
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=ROOT)
    if res.returncode != 0:
        err = res.stderr.lower()
        if "no module named 'triton.experimental.gluon" in err or "backend" in err:
            pytest.skip(f"this triton build cannot compile Gluon for sm_90: {res.stderr[-200:]}")
        raise AssertionError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])
