"""The co-located transport's control socket: the per-step messages of a Draft stream over a unix socket.

Why: on one host the tensors already move through shared regions, so a step's messages are a few
hundred bytes, and what a step costs is the hops around them. Through grpc.aio every message crosses
gRPC's request-iterator thread, the HTTP/2 stack, the drafter's event loop (twice) and the stream
reader thread: ~0.5 ms per round trip on an idle host, ~2 ms measured per step on the H200 host.
Over a unix socket the verifier's engine thread writes the request and reads the answer itself, and
the drafter's socket thread hands it to the model thread: ~0.1 ms.

Protocol (`OpenStream.control_socket`, see drafter.proto): the verifier listens on a fresh socket in
`shm_dir()` (the directory co-located processes share for the CPU regions; 0600) and names it in
`open`; the drafter connects before it answers `opened`; the verifier accepts and unlinks the path.
From then on every DraftStreamRequest (verifier -> drafter) and DraftStreamResponse (back) is a
frame: a 4-byte little-endian length, then the serialized message. The gRPC stream stays open for
the stream's lifetime: its end (either side, drain, a crash) ends the socket, and the socket's end
ends the stream. A frame longer than the peer's message limit, or one that does not parse, breaks
the stream (the verifier then drafts autoregressively and reconnects, as for any broken stream).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from protos.shared_region import shm_dir

_HEADER = struct.Struct("<I")
M = TypeVar("M", bound=Message)


class ControlClosed(ConnectionError):
    """The peer closed the control socket (or it was shut down here)."""


class ControlSocket:
    """One connected end: whole-frame send (thread-safe) and receive (one reader at a time).

    spin_s: how long `recv` polls for a frame, keeping its thread on the CPU, before it sleeps in the kernel.
    A thread that sleeps through the peer's work wakes on a core that has idled (deeper C-states, lower
    clocks, cold caches) and pays the kernel's wake-up; polling can shorten the hand-over where that is slow
    (on the H200 host it bought nothing measurable: docs/performance.md). Costs one core per receiving thread
    while it polls, and the GIL now and then (0: never poll)."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int, spin_s: float = 0.0):
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self.spin_s = spin_s
        self._send_lock = threading.Lock()
        self._closed = False

    @classmethod
    def connect(cls, path: str, max_frame_bytes: int, timeout: float = 5.0, spin_s: float = 0.0) -> ControlSocket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.settimeout(None)
        except OSError:
            sock.close()
            raise
        return cls(sock, max_frame_bytes, spin_s)

    def send(self, msg: Message) -> None:
        data = msg.SerializeToString()
        if len(data) > self.max_frame_bytes:
            raise ValueError(f"control frame of {len(data)} bytes exceeds the limit of {self.max_frame_bytes}")
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self, kind: type[M], timeout: float | None = None) -> M:
        """The next frame parsed as `kind`. TimeoutError when nothing complete arrived in `timeout` seconds
        (the stream is then out of step: drop it), ControlClosed at the end, ValueError for a bad frame."""
        if self.spin_s > 0:
            t0 = time.perf_counter()
            ready = self._spin(min(self.spin_s, timeout) if timeout is not None else self.spin_s)
            if timeout is not None:
                timeout -= time.perf_counter() - t0
                if not ready and timeout <= 0:
                    raise TimeoutError("no control frame within the timeout")
                timeout = max(timeout, 1e-6)  # 0 would make the socket non-blocking
        self.sock.settimeout(timeout)
        (n,) = _HEADER.unpack(self._exactly(_HEADER.size))
        if n > self.max_frame_bytes:
            raise ValueError(f"control frame of {n} bytes exceeds the limit of {self.max_frame_bytes}")
        msg = kind()
        try:
            msg.ParseFromString(self._exactly(n))
        except DecodeError as e:
            raise ValueError(f"control frame does not parse as {kind.__name__}: {e}") from None
        return msg

    def _spin(self, budget_s: float) -> bool:
        """Poll (non-blocking peeks, yielding the GIL between them) until a byte is readable or the peer has
        closed (-> True), or `budget_s` has passed (-> False)."""
        end = time.perf_counter() + budget_s
        sock, flags = self.sock, socket.MSG_PEEK | socket.MSG_DONTWAIT
        sock.settimeout(0.0)  # non-blocking: no poll before each peek (recv sets the timeout back)
        while True:
            try:
                sock.recv(1, flags)  # b"" (closed) or a byte: the read that follows returns at once
                return True
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:  # shut down here meanwhile: the read that follows reports it
                return True
            if time.perf_counter() >= end:
                return False
            time.sleep(0)  # other threads of this process may run

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ControlClosed("the peer closed the control socket")
            got += k
        return bytes(buf)

    def close(self) -> None:
        """Idempotent; wakes a thread blocked in recv (shutdown, then close)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class ControlListener:
    """The verifier's end before the drafter connects: a listening socket at a fresh 0600 path."""

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self.path = str(shm_dir() / f"ddtree-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is created 0600: only this user may connect
        try:
            self._sock.bind(self.path)
        finally:
            os.umask(old)
        self._sock.listen(1)

    def accept(self, timeout: float, spin_s: float = 0.0) -> ControlSocket:
        self._sock.settimeout(timeout)
        try:
            conn, _ = self._sock.accept()
        except TimeoutError:
            raise TimeoutError(f"the drafter did not connect to the control socket within {timeout:.1f} s") from None
        conn.settimeout(None)
        return ControlSocket(conn, self.max_frame_bytes, spin_s)

    def close(self) -> None:
        """Stop listening and remove the path (an accepted connection stays open)."""
        self._sock.close()
        Path(self.path).unlink(missing_ok=True)
