"""Regenerate the Python stubs of protos/ddtree/v1/*.proto (the .proto files are the source of truth).

    python -m protos.generate            # rewrite the committed stubs in place
    python -m protos.generate --out DIR  # write them under DIR (the drift test compares the two)

Stubs must come from grpcio-tools 1.84.x: the deployment runs grpcio 1.84, and stubs from newer
tools refuse to import there. protoc writes imports as `from ddtree.v1 import ...`; they are
rewritten to `from protos.ddtree.v1 import ...` so the stubs resolve inside the installed package
while the .proto files keep their canonical paths (`ddtree/v1/common.proto`) for other languages.
The stubs' grpcio floor (GRPC_GENERATED_VERSION) is set to the series' first release, 1.84.0: the
generated code is identical across 1.84 patch releases, and any 1.84.x runtime must accept it.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # -I root: files are ddtree/v1/*.proto
PACKAGE_DIR = PROTO_ROOT / "ddtree" / "v1"
TOOLS_SERIES = "1.84."
GRPC_FLOOR = TOOLS_SERIES + "0"
_IMPORT = re.compile(r"^from ddtree\.v1 import ", re.MULTILINE)
_GRPC_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '[0-9.]+'$", re.MULTILINE)


def proto_files() -> list[str]:
    return sorted(f"ddtree/v1/{p.name}" for p in PACKAGE_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc into out_root (which receives ddtree/v1/...); returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    if not version.startswith(TOOLS_SERIES):
        raise RuntimeError(f"grpcio-tools {version} found; the stubs must be generated with {TOOLS_SERIES}x")
    out_root.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf well-known types
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--grpc_python_out={out_root}", f"--pyi_out={out_root}", *proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    generated = sorted((out_root / "ddtree" / "v1").glob("*_pb2*.py*"))
    for path in generated:
        text = _IMPORT.sub("from protos.ddtree.v1 import ", path.read_text())
        path.write_text(_GRPC_VERSION.sub(f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", text))
    return generated


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="output root (default: rewrite the committed stubs)")
    args = p.parse_args(argv)
    if args.out is not None:
        files = generate(Path(args.out))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            files = generate(Path(tmp))
            for f in files:
                (PACKAGE_DIR / f.name).write_text(f.read_text())
    print("\n".join(f.name for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
