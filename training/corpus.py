"""The training corpus: Python standard-library sources installed on this machine, split by file hash.

Nobody on the project wrote them, they are real code, and they are present on every machine of this
workplace (CPython 3.11.7 under pyenv). Files whose path hash falls in bucket 0 of 20 are held out
for evaluation (about 5%); the split depends only on the path relative to the library root, so it is
the same on every machine. Third-party `site-packages` are excluded; files that are not UTF-8 are
skipped (a handful of encoding tests).
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path

HELDOUT_BUCKETS = 20  # 1 in 20 files is held out


def default_root() -> Path:
    """The running interpreter's standard library folder (e.g. .../lib/python3.11)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    return hashlib.sha1(rel.encode()).digest()[0] % HELDOUT_BUCKETS == 0


def list_files(root: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    """-> (train, heldout) sorted lists of .py files under root (site-packages excluded)."""
    root = Path(root) if root is not None else default_root()
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no standard library folder")
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or "__pycache__" in rel:
            continue
        (held if is_heldout(rel) else train).append(p)
    return train, held


def read_texts(files: list[Path]) -> list[str]:
    """UTF-8 contents of the files (non-UTF-8 files skipped)."""
    out = []
    for p in files:
        try:
            out.append(p.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def describe(root: str | Path | None = None) -> dict:
    train, held = list_files(root)
    return {"root": str(root or default_root()), "python": sys.version.split()[0], "train_files": len(train),
            "heldout_files": len(held), "train_bytes": sum(p.stat().st_size for p in train),
            "heldout_bytes": sum(p.stat().st_size for p in held)}
