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


def hgmma_loops(cubin: bytes) -> list[dict]:
    """In a compile script: the innermost loops of a compiled kernel that issue warpgroup MMAs, by the SASS of the
    installed Triton's nvdisasm, in code order: {"n": instructions, and the count of each opcode that says where the
    loop computes its wgmma descriptors: HGMMA, R2UR (a vector value moved to a uniform register), UIADD3, IMAD,
    IADD3, and the spill traffic LDL / STL}. A loop is a backward branch to a label."""
    import collections
    import re
    import tempfile

    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    ins, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line.strip()):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            ins.append(m.group(1))
    loops = []
    for i, s in enumerate(ins):
        m = re.search(r"\bBRA(?:\.\w+)* `?\(?(\.L_x_\d+)", s)
        if m and labels.get(m.group(1), len(ins)) <= i:
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0]
                                      for b in ins[labels[m.group(1)]:i + 1])
            if ops["HGMMA"]:
                loops.append((labels[m.group(1)], i, ops))
    inner = [x for x in loops if not any(y is not x and x[0] <= y[0] and y[1] <= x[1] for y in loops)]
    return [{"n": i - a + 1, **{k: ops[k] for k in ("HGMMA", "R2UR", "UIADD3", "IMAD", "IADD3", "LDL", "STL")}}
            for a, i, ops in inner]


RING_STEP_SYNC = ["wait", "bar", "fence", "cp", "commit", "bar", "lds"]


def ring_loop_syncs(ptx: str) -> list[list[str]]:
    """In a compile script: for each innermost PTX loop that issues warpgroup MMAs, the order in which its body first
    does each of: `wait` (cp.async.wait_group), `bar` (bar.sync), `fence` (fence.proxy.async), `cp` (cp.async),
    `commit`, `lds` (ld.shared), `mma` (wgmma.mma_async), repeats of the same kind merged. A ring step of
    `kernels._int4_moe_wgmma` begins RING_STEP_SYNC: two CTA barriers before its reads of the step's slot."""
    import re

    lines = ptx.splitlines()
    kinds = (("wait", "cp.async.wait_group"), ("bar", "bar.sync"), ("fence", "fence.proxy.async"),
             ("cp", "cp.async.cg"), ("commit", "cp.async.commit_group"), ("lds", "ld.shared"),
             ("mma", "wgmma.mma_async"))
    out = []
    for i, line in enumerate(lines):
        if "Inner Loop Header" not in line:
            continue
        # the loop's label: on the header line, or (a nested loop) a few comment lines above it
        m = next(m for k in range(i, -1, -1) if (m := re.match(r"^(\$L__BB\d+_\d+):", lines[k])))
        end = next(j for j in range(i + 1, len(lines)) if re.search(rf"\bbra(\.uni)?\s+{re.escape(m.group(1))};",
                                                                    lines[j]))
        body = lines[i:end + 1]
        if not any("wgmma.mma_async" in b for b in body):
            continue
        seq: list[str] = []
        for b in body:
            for key, pat in kinds:
                if pat in b and (not seq or seq[-1] != key):
                    seq.append(key)
        out.append(seq)
    return out
