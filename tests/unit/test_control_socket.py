"""The co-located control socket's framing (`protos.control_socket`): whole protobuf frames both ways,
and every way a frame can go wrong ends in a clear exception rather than a misread message."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from protos.control_socket import ControlClosed, ControlListener, ControlSocket
from protos.ddtree.v1 import drafter_pb2


@pytest.fixture(params=[0.0, 0.3], ids=["blocking", "spinning"])
def pair(request):
    """Both ends; "spinning": each polls up to 0.3 s for a frame before it blocks (ControlSocket.spin_s)."""
    listener = ControlListener(max_frame_bytes=1 << 16)
    client = ControlSocket.connect(listener.path, 1 << 16, spin_s=request.param)
    server = listener.accept(5, spin_s=request.param)
    assert client.spin_s == server.spin_s == request.param
    mode = stat.S_IMODE(os.stat(listener.path).st_mode)
    listener.close()
    yield client, server, mode, listener.path
    client.close()
    server.close()


def step(i: int) -> drafter_pb2.DraftStreamRequest:
    return drafter_pb2.DraftStreamRequest(step=drafter_pb2.DraftStep(step_id=i, response_region_id=2))


def test_frames_round_trip_in_order(pair):
    client, server, mode, path = pair
    assert mode == 0o600 and not Path(path).exists()  # only this user could connect; nothing left behind
    for i in range(1, 4):
        client.send(step(i))
    got = [server.recv(drafter_pb2.DraftStreamRequest, timeout=5) for _ in range(3)]
    assert [m.step.step_id for m in got] == [1, 2, 3] and got[0].step.HasField("response_region_id")
    big = drafter_pb2.DraftStreamResponse(trees=drafter_pb2.DraftTrees(step_id=9, session_ids=["s" * 30000]))
    server.send(big)
    assert client.recv(drafter_pb2.DraftStreamResponse, timeout=5) == big  # a frame over several socket reads
    empty = drafter_pb2.DraftStreamRequest()  # serialises to 0 bytes: still a frame
    client.send(empty)
    assert server.recv(drafter_pb2.DraftStreamRequest, timeout=5).WhichOneof("kind") is None


def test_timeout_end_and_concurrent_senders(pair):
    client, server, _, _ = pair
    for timeout in (0.05, 0.5):  # within the spin, and past it (then blocking for the rest)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            server.recv(drafter_pb2.DraftStreamRequest, timeout=timeout)
        assert timeout <= time.perf_counter() - t0 < timeout + 1.0
    threading.Timer(0.1, lambda: client.send(step(7))).start()  # arrives while the reader polls or sleeps
    assert server.recv(drafter_pb2.DraftStreamRequest, timeout=5).step.step_id == 7
    threading.Timer(0.5, lambda: client.send(step(8))).start()  # past the spin: the blocking read gets it
    assert server.recv(drafter_pb2.DraftStreamRequest, timeout=5).step.step_id == 8
    threads = [threading.Thread(target=lambda k=k: [client.send(step(100 * k + j)) for j in range(50)])
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = sorted(server.recv(drafter_pb2.DraftStreamRequest, timeout=5).step.step_id for _ in range(200))
    assert ids == sorted(100 * k + j for k in range(4) for j in range(50))  # frames never interleave
    client.close()
    client.close()  # idempotent
    with pytest.raises(ControlClosed):
        server.recv(drafter_pb2.DraftStreamRequest, timeout=5)


def test_close_wakes_a_blocked_reader(pair):
    client, server, _, _ = pair
    errors = []

    def read():
        try:
            server.recv(drafter_pb2.DraftStreamRequest)
        except (ControlClosed, OSError) as e:
            errors.append(e)

    t = threading.Thread(target=read)
    t.start()
    server.close()  # from another thread, as the drafter does when the gRPC stream ends
    t.join(5)
    assert not t.is_alive() and errors


def test_oversized_and_garbage_frames(pair):
    client, server, _, _ = pair
    with pytest.raises(ValueError, match="exceeds the limit"):
        client.send(drafter_pb2.DraftStreamResponse(trees=drafter_pb2.DraftTrees(session_ids=["x" * (1 << 16)])))
    client.sock.sendall((1 << 20).to_bytes(4, "little"))  # a header announcing more than the limit
    with pytest.raises(ValueError, match="exceeds the limit"):
        server.recv(drafter_pb2.DraftStreamRequest, timeout=5)
    client2, server2 = _fresh()
    client2.sock.sendall((3).to_bytes(4, "little") + b"\xff\xff\xff")
    with pytest.raises(ValueError, match="does not parse"):
        server2.recv(drafter_pb2.DraftStreamRequest, timeout=5)
    client2.sock.sendall((10).to_bytes(4, "little") + b"\x08")  # a frame cut short, then the end
    client2.close()
    with pytest.raises(ControlClosed):
        server2.recv(drafter_pb2.DraftStreamRequest, timeout=5)
    server2.close()


def _fresh():
    listener = ControlListener(max_frame_bytes=1 << 16)
    try:
        client = ControlSocket.connect(listener.path, 1 << 16)
        return client, listener.accept(5)
    finally:
        listener.close()


def test_accept_timeout_and_unreachable_path(tmp_path):
    listener = ControlListener(max_frame_bytes=1024)
    with pytest.raises(TimeoutError, match="did not connect"):
        listener.accept(0.05)
    listener.close()
    with pytest.raises(OSError):
        ControlSocket.connect(str(tmp_path / "nobody.sock"), 1024, timeout=1)
