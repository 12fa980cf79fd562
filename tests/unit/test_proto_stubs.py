"""The committed protobuf stubs are exactly what the .proto files generate (grpcio-tools 1.84)."""

from __future__ import annotations

import pytest

from protos.generate import GRPC_FLOOR, PACKAGE_DIR, generate


def test_committed_stubs_equal_a_fresh_generation(tmp_path):
    files = generate(tmp_path)
    committed = sorted(p.name for p in PACKAGE_DIR.glob("*_pb2*.py*"))
    assert sorted(f.name for f in files) == committed
    assert {"drafter_pb2_grpc.py", "verifier_pb2_grpc.py", "common_pb2.pyi"} <= set(committed)
    drifted = [f.name for f in files if f.read_text() != (PACKAGE_DIR / f.name).read_text()]
    assert not drifted, f"stubs drifted from the .proto files: {drifted}; run `python -m protos.generate`"


def test_stubs_import_from_the_installed_package():
    from protos.ddtree.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2_grpc

    src = (PACKAGE_DIR / "drafter_pb2.py").read_text()
    assert "from protos.ddtree.v1 import common_pb2" in src and "from ddtree.v1" not in src
    assert drafter_pb2_grpc.GRPC_GENERATED_VERSION == GRPC_FLOOR == "1.84.0"
    assert drafter_pb2.DESCRIPTOR.package == "ddtree.v1"
    assert hasattr(verifier_pb2_grpc, "VerifierStub") and hasattr(drafter_pb2_grpc, "DrafterServicer")


@pytest.mark.parametrize("field", ["max_new_tokens", "budget", "topk", "temperature", "top_p", "top_k", "seed"])
def test_meaningful_zeros_are_optional(field):
    from protos.ddtree.v1 import verifier_pb2

    msg = verifier_pb2.DecodeParams()
    assert not msg.HasField(field)
    setattr(msg, field, 0)
    assert msg.HasField(field)  # "0" differs from "unset"
