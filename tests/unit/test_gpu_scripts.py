"""The device scripts' defaults name things that exist: a typo there costs a lent GPU's minutes, not a CI run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench.bench_int4_moe import GLUON_VARIANTS
from kernels.int4_moe_wgmma import check_schedule

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _default(script: str, var: str) -> str:
    m = re.search(rf"^{var}=\$\{{{var}:-(['\"])(.*?)\1\}}$", (BENCH / script).read_text(), re.M)
    assert m, f"{script}: no default for {var}"
    return m.group(2)


def test_run_gpu_moe_defaults_are_known_variants_and_runnable_schedules():
    variants = _default("run_gpu_moe.sh", "VARIANTS").split()
    assert variants and set(variants) <= set(GLUON_VARIANTS), set(variants) - set(GLUON_VARIANTS)
    schedules = _default("run_gpu_moe.sh", "SCHEDULES").split(";")
    for s in schedules:
        check_schedule(json.loads(s))  # ValueError for an option or value the kernels cannot run


def test_run_gpu_standings_defaults_are_known_variants():
    variants = _default("run_gpu_standings.sh", "VARIANTS").split()
    assert variants and set(variants) <= set(GLUON_VARIANTS), set(variants) - set(GLUON_VARIANTS)


def test_run_gpu_moe_stalls_names_the_kernels_and_a_runnable_schedule():
    script = (BENCH / "run_gpu_moe_stalls.sh").read_text()
    check_schedule(json.loads(_default("run_gpu_moe_stalls.sh", "OPTIONS")))
    kernels = (BENCH.parent / "kernels" / "_int4_moe_wgmma.py").read_text()
    for k in re.search(r"^for k in (.*); do$", script, re.M).group(1).split():
        assert f"def _moe_{k}_wgmma_kernel(" in kernels


def test_every_device_script_parses_and_sources_what_exists():
    for script in sorted(BENCH.glob("*.sh")):
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, (script.name, res.stderr)
        for sourced in re.findall(r"^\s*\.\s+(\S+)$", script.read_text(), re.M):
            assert (BENCH.parent / sourced).is_file(), (script.name, sourced)


def test_run_gpu_standings_selects_every_gpu_test_of_drafting_ahead_and_the_doorbells():
    """The standings' second pytest call picks its tests with -k: every GPU test function of test_gpu_transport.py
    must have a case in it (its equality test's cases without drafting ahead run in run_gpu_transport.sh). One named
    for neither "ahead" nor "doorbell" went unrun for a session while the script was said to run it. Collected by
    pytest itself, as on the device."""
    script = (BENCH / "run_gpu_standings.sh").read_text()
    call = r"python -m pytest -q -rs -m gpu (tests/unit/test_draft_ahead\.py[^\n]*?) \\\n\s*(\S+) -k \"([^\"]+)\""
    m = re.search(call, script)
    assert m, "run_gpu_standings.sh: the ahead tests' pytest call changed shape"
    files, expr = [*m.group(1).split(), m.group(2)], m.group(3)
    root = BENCH.parent

    def collect(*args: str) -> set[str]:
        res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-m", "gpu", *files, *args], capture_output=True, text=True, cwd=root)
        assert res.returncode in (0, 5), res.stdout[-2000:] + res.stderr[-2000:]
        return {line for line in res.stdout.splitlines() if "::" in line}

    def functions(ids: set[str]) -> set[str]:
        return {t.split("[")[0] for t in ids if t.startswith("tests/integration/test_gpu_transport.py::")}

    chosen, every = functions(collect("-k", expr)), functions(collect())
    assert len(every) >= 3 and every <= chosen, sorted(every - chosen)


def test_run_gpu_vsplit_selects_the_value_split_tests():
    """run_gpu_vsplit.sh's -k picks the seesaw kernel's value-split GPU tests and nothing else (collected by pytest, as
    on the device, where the bench runs only if they pass)."""
    script = (BENCH / "run_gpu_vsplit.sh").read_text()
    m = re.search(r"pytest (tests/kernels/\S+\.py) [^\n]*\\\n\s*-k (\S+)", script)
    assert m, "run_gpu_vsplit.sh: the tests' pytest call changed shape"
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", m.group(1),
                          "-k", m.group(2)], capture_output=True, text=True, cwd=BENCH.parent)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    assert len(ids) == 15 and all("::test_mla_seesaw_value_split_gives_the_same_bits[" in i for i in ids), ids
