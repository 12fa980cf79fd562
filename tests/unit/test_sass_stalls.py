"""bench/sass_stalls.py reads ncu's per-instruction SASS export (the column names of a real one, ncu 2025) and ranks
the stalls by reason, by opcode and by instruction."""

from __future__ import annotations

import gzip
import io

import pytest

from bench import sass_stalls

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"# Samples","Instructions Executed","stall_barrier","stall_long_sb","stall_wait",'
          '"stall_barrier (Not Issued)","stall_long_sb (Not Issued)","stall_wait (Not Issued)"')


def _export(kernels: dict[str, list[tuple[str, int, int, int, int, int]]]) -> str:
    """name -> rows of (source, all samples, executed, barrier, long_sb, wait), as ncu --csv writes them."""
    out = []
    for name, rows in kernels.items():
        out += [f'"Kernel Name","{name}",', HEADER]
        for i, (src, n, ex, bar, lsb, wait) in enumerate(rows):
            out.append(f'"0x{0x1000 + 16 * i:x}","      {src}","{n}","{n}","{n}","{ex}","{bar}","{lsb}","{wait}",'
                       f'"{bar}","{lsb}","{wait}"')
    return "\n".join(out) + "\n"


ROWS = [("LDG.E.128 R4, desc[UR4][R2.64]", 10, 100, 0, 0, 10),
        ("@!P0 BAR.SYNC.DEFER_BLOCKING 0x0", 30, 100, 30, 0, 0),
        ("IMAD R6, R4, 0x2, RZ", 60, 100, 0, 45, 5),  # 10 samples of a reason without a column
        ("EXIT", 0, 100, 0, 0, 0)]


def test_ranks_reasons_opcodes_and_instructions(tmp_path):
    p = tmp_path / "sass.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write(_export({"_moe_w13_wgmma_kernel": ROWS, "_moe_w2_wgmma_kernel": ROWS[:2]}))
    kernels = sass_stalls.read(str(p))
    assert [k.name for k in kernels] == ["_moe_w13_wgmma_kernel", "_moe_w2_wgmma_kernel"]
    assert [len(k.rows) for k in kernels] == [4, 2]
    assert sass_stalls.reasons(kernels[0].rows[2]) == {"long_sb": 45, "wait": 5, "unlisted": 10}
    assert sass_stalls.opcode("@!P0 BAR.SYNC.DEFER_BLOCKING 0x0") == "BAR"
    buf = io.StringIO()
    sass_stalls.report(kernels[0], top=2, context=1, out=buf)
    text = buf.getvalue()
    assert "4 instructions, 100 stall samples, 400 warp instructions executed" in text
    lines = text.splitlines()
    by_reason = lines[lines.index("-- by reason") + 1:lines.index("-- by reason") + 4]
    assert [ln.split()[0] for ln in by_reason] == ["long_sb", "barrier", "wait"]
    assert "45.0%" in by_reason[0]
    top = [ln for ln in lines if "<-" in ln]
    assert len(top) == 2 and "IMAD R6" in top[0] and "60.0%" in top[0] and "BAR.SYNC" in top[1]
    assert lines[lines.index(top[0]) + 1].strip() == "[1] @!P0 BAR.SYNC.DEFER_BLOCKING 0x0"  # the one before


def test_refuses_a_file_without_sass_rows(tmp_path):
    p = tmp_path / "details.txt"
    p.write_text("==PROF== Disconnected\n")
    with pytest.raises(SystemExit, match="no SASS rows"):
        sass_stalls.read(str(p))
