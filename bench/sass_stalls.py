"""Rank where a kernel's warps stall, from Nsight Compute's per-instruction SASS export.

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    python bench/sass_stalls.py sass.csv.gz [--top 25] [--context 3]

Prints, from the warp stall samples (`Warp Stall Sampling (All Samples)` and the per-reason `stall_*` columns):
the share of each stall reason over the kernel; the share of each opcode (the SASS mnemonic without its modifiers);
the top instructions with their main reasons, each with the `--context` instructions before it (what a stall at an
instruction waits for is usually an instruction shortly above it); and how many instructions ran per executed
instruction slot. Reads plain or gzipped CSV; several kernels in one export are reported one after the other.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import sys
from collections import Counter
from dataclasses import dataclass, field

ALL = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Kernel:
    name: str
    rows: list[dict[str, str]] = field(default_factory=list)


def read(path: str) -> list[Kernel]:
    """The export's kernels, each with its instruction rows (dicts by column name)."""
    kernels: list[Kernel] = []
    header: list[str] | None = None
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as raw:
        records = list(csv.reader(raw))
    for rec in records:
        if not rec:
            continue
        if rec[0] == "Kernel Name":
            kernels.append(Kernel(rec[1]))
            header = None
        elif rec[0] == "Address":
            header = rec
            if not kernels:
                kernels.append(Kernel("(unnamed)"))
        elif header is not None:
            kernels[-1].rows.append(dict(zip(header, rec)))
    if not kernels or not any(k.rows for k in kernels):
        raise SystemExit(f"{path}: no SASS rows (expected ncu --page source --csv --print-source sass)")
    return kernels


def _num(v: str | None) -> int:
    try:
        return int(float(v)) if v not in (None, "", "-") else 0
    except ValueError:
        return 0


def reasons(row: dict[str, str]) -> Counter:
    """stall reason -> samples at this instruction (all samples, not only the not-issued ones). Samples of reasons
    the export has no column for (some ncu versions leave out e.g. the wgmma ones) count as `unlisted`."""
    c = Counter({k[len("stall_"):]: _num(v) for k, v in row.items()
                 if k.startswith("stall_") and "(Not Issued)" not in k and _num(v)})
    rest = _num(row.get(ALL)) - sum(c.values())
    if rest > 0:
        c["unlisted"] = rest
    return c


def opcode(source: str) -> str:
    """'@!P0 LDGSTS.E.BYPASS.128 [R1], ...' -> 'LDGSTS'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def report(k: Kernel, top: int, context: int, out=sys.stdout) -> None:
    total = sum(_num(r.get(ALL)) for r in k.rows)
    executed = sum(_num(r.get(EXECUTED)) for r in k.rows)
    print(f"=== {k.name}: {len(k.rows)} instructions, {total} stall samples, {executed} warp instructions executed",
          file=out)
    if not total:
        print("no stall samples (was SourceCounters collected?)", file=out)
        return
    by_reason: Counter = Counter()
    by_op: Counter = Counter()
    for r in k.rows:
        by_reason.update(reasons(r))
        by_op[opcode(r["Source"])] += _num(r.get(ALL))
    print("-- by reason", file=out)
    for name, n in by_reason.most_common():
        print(f"  {name:20s} {n:9d} {100 * n / total:5.1f}%", file=out)
    print("-- by opcode (samples at instructions of that opcode)", file=out)
    for name, n in by_op.most_common(15):
        print(f"  {name:20s} {n:9d} {100 * n / total:5.1f}%", file=out)
    print(f"-- top {top} instructions (share, main reasons; the {context} before each)", file=out)
    order = sorted(range(len(k.rows)), key=lambda i: -_num(k.rows[i].get(ALL)))[:top]
    for i in order:
        r = k.rows[i]
        n = _num(r.get(ALL))
        if not n:
            break
        main = ", ".join(f"{name} {100 * v / n:.0f}%" for name, v in reasons(r).most_common(3))
        print(f"  {100 * n / total:5.1f}%  [{i}] {r['Address']}  {r['Source'].strip()}   <- {main}", file=out)
        for j in range(max(0, i - context), i):
            print(f"            [{j}] {k.rows[j]['Source'].strip()}", file=out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--context", type=int, default=3)
    a = ap.parse_args(argv)
    for k in read(a.path):
        report(k, a.top, a.context)


if __name__ == "__main__":
    main()
