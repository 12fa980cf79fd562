"""Which transport the verifier uses: local addresses and the flags' resolution (verifier_service.transport)."""

from __future__ import annotations

import pytest

from verifier_service.transport import is_local_address, resolve_transport


@pytest.mark.parametrize("address, local", [
    ("127.0.0.1:5000", True), ("localhost:5000", True), ("[::1]:5000", True), ("unix:/tmp/d.sock", True),
    ("dns:///localhost:5000", True), ("ipv4:127.0.0.2:5000", True), ("10.1.2.3:5000", False),
    ("drafter.svc.cluster.local:5000", False),
])
def test_local_addresses(address, local):
    assert is_local_address(address) == local


def test_transport_resolution():
    assert resolve_transport(None, "127.0.0.1:1", None) == "colocated"
    assert resolve_transport(None, "10.0.0.1:1", None) == "grpc"
    assert resolve_transport("grpc", "127.0.0.1:1", None) == "grpc"
    assert resolve_transport(None, None, "/d") == "inprocess"
    with pytest.raises(ValueError, match="needs --drafter DIR"):
        resolve_transport("inprocess", None, None)
    with pytest.raises(ValueError, match="needs --drafter-address"):
        resolve_transport("colocated", None, None)
    with pytest.raises(ValueError, match="only for --transport inprocess"):
        resolve_transport("grpc", "h:1", "/d")
