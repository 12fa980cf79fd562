"""Choosing and wiring the verifier <-> drafter transport (DESIGN 5).

Three transports sit behind the engine's `DraftClient` interface:
- `inprocess`: the `Drafter` object itself, in the verifier's process (the embedded mode);
- `colocated`: a drafter process on this host; tensors through shared memory (/dev/shm on CPU,
  CUDA IPC on GPU) registered once per stream, a small control message per step;
- `grpc`: a drafter anywhere; tensors as little-endian bytes in the messages.
`colocated` is the default when the drafter's address is on this host (loopback, this host's
name, or a unix socket), `grpc` otherwise. Also the stream client's configuration and what it
learns about the drafter (`StreamClientConfig`, `DrafterModel`); torch-free.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protos.ddtree.v1 import drafter_pb2

if TYPE_CHECKING:  # this module stays torch-free: the CLI builds its parser from TRANSPORTS
    from verifier_service.config import KimiConfig

TRANSPORTS = ("inprocess", "colocated", "grpc")


IN_PLACE_MODES = ("auto", "on", "off")  # StreamClientConfig.trees_in_place


@dataclass(frozen=True)
class StreamClientConfig:
    address: str
    colocated: bool = False  # tensors through shared regions instead of inline bytes
    region_device: str = "cpu"  # the engine's device: trees are delivered there, shared regions live there
    control_socket: bool = True  # co-located: the per-step messages over a unix socket (protos.control_socket)
    ipc_events: bool = True  # co-located on a GPU: hand the regions over with CUDA IPC events, no host waits
    # with ipc_events: the drafter rings a counter our stream waits on (protos.doorbell); gRPC on a GPU: the verify
    # step is queued before the trees arrive, behind a host doorbell the answer rings (verifier_service.tree_landing)
    doorbell: bool = True
    # co-located with the doorbell: ahead steps ring a counter of ours that the drafter's stream may wait on
    # (OpenStream.request_doorbell_region_id), so the drafter queues their draft at once instead of polling our event
    request_doorbell: bool = True
    # co-located with the doorbell: "on" = the trees go where the verifier laid them out (DraftStep.trees_in_place),
    # so the check and the verify step are queued behind the doorbell right after the request leaves, without waiting
    # for the answer (read after the step, `DraftStreamClient.take_errors`); "off" = queued once the answer is read;
    # "auto" = in place while the drafter's ring keeps beating its answer (its GPU step is shorter than the answer's
    # way back; H200: kimi-mini), answered otherwise (K2.6, where in place was 0.1-0.3 ms slower: a stream of ours
    # waiting on the GPU delays the drafter's context getting it; docs/performance.md)
    trees_in_place: str = "auto"
    control_spin_s: float = 0.0  # control socket: poll this long for the answer before sleeping (ControlSocket)
    # steps on the gRPC stream: KeepWarm messages shortly before each expected request and answer, not sooner than
    # this many ms into a silence (0: never; verifier_service.keepwarm)
    keepwarm_ms: float = 3.0
    check_graphs: bool = True  # on a GPU: the tree check of region trees replayed from CUDA graphs
    draft_timeout_s: float = 5.0  # one step's deadline
    connect_timeout_s: float = 5.0  # opening a stream (handshake included)
    max_message_bytes: int = 64 << 20
    window: int = 2048  # context rows kept per session for resending
    request_region_bytes: int = 64 << 20
    response_region_bytes: int = 1 << 20
    retry_min_s: float = 0.1
    retry_max_s: float = 2.0
    client_id: str = "verifier"
    # the fingerprint of the drafter's context projection the engine applies before sending (its rows are then
    # projected, `drafter_service.context_projection`); "": the engine sends taps
    context_projection: str = ""

    def __post_init__(self):
        for f in ("draft_timeout_s", "connect_timeout_s", "max_message_bytes", "window", "request_region_bytes",
                  "response_region_bytes", "retry_min_s", "retry_max_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"stream client: {f} must be positive, got {getattr(self, f)}")
        if self.control_spin_s < 0:
            raise ValueError(f"stream client: control_spin_s must be >= 0, got {self.control_spin_s}")
        if not 0 <= self.keepwarm_ms <= 1000:
            raise ValueError(f"stream client: keepwarm_ms must be in [0, 1000] (0: off), got {self.keepwarm_ms}")
        if not self.address:
            raise ValueError("stream client: the drafter address is empty")
        if self.trees_in_place not in IN_PLACE_MODES:
            raise ValueError(f"stream client: trees_in_place must be one of {IN_PLACE_MODES}, "
                             f"got {self.trees_in_place!r}")


@dataclass(frozen=True)
class DrafterModel:
    """What the verifier needs to know about the drafter (from DrafterInfo)."""

    model: str
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    max_budget: int

    @classmethod
    def from_pb(cls, info: drafter_pb2.DrafterInfo) -> DrafterModel:
        return cls(info.model, info.vocab_size, info.block_size, tuple(info.target_layer_ids),
                   info.target_hidden_size, info.max_budget)

    def same_shape(self, other: DrafterModel) -> bool:
        """Can one replace the other mid-flight (same depth, features and vocabulary)?"""
        return (self.vocab_size, self.block_size, self.target_layer_ids, self.target_hidden_size) == (
            other.vocab_size, other.block_size, other.target_layer_ids, other.target_hidden_size)


def projection_refusal(cfg: StreamClientConfig, info: drafter_pb2.DrafterInfo) -> str:
    """Why a drafter (its Info) would refuse this client's context projection, "" when it would not (or is still
    loading: no model yet, so no projection to compare)."""
    if not info.model or info.context_projection == cfg.context_projection:
        return ""
    return (f"the drafter at {cfg.address} ({info.model}) has another context projection "
            f"({info.context_projection[:16] or 'none'}...) than this verifier's ({cfg.context_projection[:16]}...): "
            "point --context-projection at that drafter's checkpoint, or leave it out (the verifier then sends taps)")


def address_host(address: str) -> str | None:
    """The host part of a gRPC target ('host:port', '[v6]:port', 'dns:///host:port', 'ipv4:a.b.c.d:port');
    None for unix sockets."""
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme):]
            break
    host, sep, _ = address.rpartition(":")
    host = host if sep else address
    return host.strip("[]")


def is_local_address(address: str) -> bool:
    host = address_host(address)
    if host is None:
        return True
    if host.lower() in ("localhost", socket.gethostname().lower(), socket.getfqdn().lower()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_transport(requested: str | None, drafter_address: str | None, drafter_dir: str | None) -> str:
    """The transport to use, from the flags; ValueError says which flag is missing or conflicting."""
    if requested is not None and requested not in TRANSPORTS:
        raise ValueError(f"--transport must be one of {', '.join(TRANSPORTS)}, got {requested!r}")
    if requested == "inprocess" or (requested is None and drafter_address is None):
        if drafter_dir is None:
            raise ValueError("--transport inprocess needs --drafter DIR (the drafter runs inside the verifier)")
        if drafter_address is not None:
            raise ValueError("--transport inprocess takes --drafter DIR, not --drafter-address")
        return "inprocess"
    if drafter_address is None:
        raise ValueError(f"--transport {requested} needs --drafter-address HOST:PORT")
    if drafter_dir is not None:
        raise ValueError("--drafter DIR is only for --transport inprocess; the remote drafter loads its own weights")
    return requested or ("colocated" if is_local_address(drafter_address) else "grpc")


def check_drafter_pair(model: DrafterModel, target: KimiConfig) -> None:
    """The same checks as `check_pair`, against a drafter known only through its Info."""
    if model.vocab_size != target.vocab_size:
        raise ValueError(f"drafter {model.model!r} has vocab_size {model.vocab_size}, the target "
                         f"{target.vocab_size}")
    if model.target_hidden_size != target.hidden_size:
        raise ValueError(f"drafter {model.model!r} expects target hidden size {model.target_hidden_size}, the "
                         f"target has {target.hidden_size}")
    bad = [i for i in model.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad or not model.target_layer_ids:
        raise ValueError(f"drafter {model.model!r} taps target layers {list(model.target_layer_ids)}, the target "
                         f"has {target.num_hidden_layers}")
    if model.block_size < 2:
        raise ValueError(f"drafter {model.model!r} reports block size {model.block_size}")
