"""Run a script that compiles Gluon kernels for sm_90 (PTX + ptxas, no GPU needed) in a subprocess and return the
JSON object it prints last. A subprocess, because the test process may run Triton in interpreter mode; skipped
where the installed Triton cannot compile Gluon for sm_90. The scripts compile with `compile_gluon_sm90`."""

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


def compile_gluon_sm90(fn, sig: dict, constexprs: dict, aligned, **options):
    """In a compile script: Gluon kernel `fn` compiled for sm_90 with the runtime arguments `sig` (name -> type), then
    `constexprs` (name -> value), the arguments named in `aligned` 16-byte aligned, and Triton `options` (num_warps,
    maxnreg) -> (compiled kernel, PTX, the ptxas -v log: TRITON_DUMP_PTXAS_LOG, and ptxas runs on an empty cache)."""
    import contextlib
    import io

    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {**sig, **{k: "constexpr" for k in constexprs}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in set(aligned)}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        k = compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                    target=GPUTarget("cuda", 90, 32), options=options)
    return k, k.asm["ptx"], log.getvalue()
