"""Shared regions of the co-located transport: byte buffers both processes map, registered once.

The verifier creates two regions when it opens a Draft stream (requests: context features it
writes; responses: trees the drafter writes) and announces them in `OpenStream.regions`; the
drafter attaches to them. Each step then moves only a small control message: tensors are placed
in a region by a `RegionArena` (a bump allocator reset every message) and the message carries
`RegionSlice {region_id, offset}`.

- CPU: a file in /dev/shm (created 0600, mapped MAP_SHARED through `torch.from_file`). The owner
  unlinks it as soon as the peer has mapped it (both mappings stay valid), so nothing is left in
  /dev/shm even when a process is killed.
- CUDA: one device allocation shared through CUDA IPC (`cudaIpcGetMemHandle`, via
  torch.multiprocessing's reductions); the handle's fields travel as explicit proto fields, never
  pickled. Writers synchronise their stream before the control message leaves, so the reader
  sees the bytes.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import torch

from protos.ddtree.v1 import common_pb2, drafter_pb2

ALIGN = 64  # byte alignment of every slice (covers every dtype's itemsize)


def shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


class SharedRegion:
    """A flat uint8 tensor `buf` of `nbytes` that another process on this host can map too."""

    def __init__(self, region_id: int, buf: torch.Tensor, path: Path | None = None, owner: bool = False,
                 cuda: drafter_pb2.CudaIpcHandle | None = None):
        self.region_id = region_id
        self.buf = buf  # [nbytes] uint8 (CPU shared mapping or CUDA allocation)
        self.path = path
        self.owner = owner
        self._cuda = cuda

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    @property
    def device(self) -> torch.device:
        return self.buf.device

    # --- owner side --------------------------------------------------------------------------------
    @classmethod
    def create(cls, region_id: int, nbytes: int, device: torch.device | str = "cpu") -> SharedRegion:
        """A new region on `device`: /dev/shm file for CPU, CUDA IPC allocation for a GPU."""
        if nbytes <= 0:
            raise ValueError(f"shared region size must be positive, got {nbytes}")
        device = torch.device(device)
        if device.type == "cuda":
            return cls._create_cuda(region_id, nbytes, device)
        if device.type != "cpu":
            raise ValueError(f"shared regions live on cpu or cuda, not {device}")
        path = shm_dir() / f"ddtree-{os.getpid()}-{uuid.uuid4().hex[:12]}-{region_id}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        buf = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return cls(region_id, buf, path, owner=True)

    @classmethod
    def _create_cuda(cls, region_id: int, nbytes: int, device: torch.device) -> SharedRegion:
        from torch.multiprocessing.reductions import reduce_tensor

        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _, args = reduce_tensor(buf)
        # args: (cls, size, stride, tensor_offset, storage_cls, dtype, device, handle, storage_size_bytes,
        #        storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset,
        #        event_handle, event_sync_required)
        handle = drafter_pb2.CudaIpcHandle(
            device=int(args[6]), handle=args[7], storage_size_bytes=int(args[8]),
            storage_offset_bytes=int(args[9]), ref_counter_handle=args[11], ref_counter_offset=int(args[12]),
            event_handle=args[13] or b"", event_sync_required=bool(args[14]), tensor_offset=int(args[3]))
        return cls(region_id, buf, None, owner=True, cuda=handle)

    def to_pb(self) -> drafter_pb2.SharedRegion:
        msg = drafter_pb2.SharedRegion(region_id=self.region_id, nbytes=self.nbytes)
        if self._cuda is not None:
            msg.cuda.CopyFrom(self._cuda)
        else:
            msg.shm_path = str(self.path)
        return msg

    # --- peer side ---------------------------------------------------------------------------------
    @classmethod
    def attach(cls, msg: drafter_pb2.SharedRegion) -> SharedRegion:
        """Map a region announced by the peer; ValueError says why it cannot be (not co-located?)."""
        if msg.nbytes <= 0:
            raise ValueError(f"shared region {msg.region_id}: size must be positive")
        which = msg.WhichOneof("location")
        if which == "shm_path":
            path = Path(msg.shm_path)
            if not path.is_absolute() or not path.name.startswith("ddtree-"):
                raise ValueError(f"shared region {msg.region_id}: {msg.shm_path!r} is not a ddtree region file")
            try:
                size = path.stat().st_size
            except OSError as e:
                raise ValueError(f"shared region {msg.region_id}: cannot open {path} ({e.strerror}); "
                                 "are the verifier and the drafter on the same host? use --transport grpc "
                                 "otherwise") from None
            if size != msg.nbytes:
                raise ValueError(f"shared region {msg.region_id}: {path} has {size} bytes, expected {msg.nbytes}")
            buf = torch.from_file(str(path), shared=True, size=msg.nbytes, dtype=torch.uint8)
            return cls(msg.region_id, buf, path, owner=False)
        if which == "cuda":
            return cls._attach_cuda(msg)
        raise ValueError(f"shared region {msg.region_id}: no location")

    @classmethod
    def _attach_cuda(cls, msg: drafter_pb2.SharedRegion) -> SharedRegion:
        if not torch.cuda.is_available():
            raise ValueError(f"shared region {msg.region_id} is a CUDA IPC allocation, but this process has no GPU")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        h = msg.cuda
        buf = rebuild_cuda_tensor(
            torch.Tensor, (msg.nbytes,), (1,), h.tensor_offset, torch.storage.TypedStorage, torch.uint8, h.device,
            h.handle, h.storage_size_bytes, h.storage_offset_bytes, False, h.ref_counter_handle,
            h.ref_counter_offset, h.event_handle or None, h.event_sync_required)
        return cls(msg.region_id, buf, None, owner=False)

    # --- both --------------------------------------------------------------------------------------
    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) as a uint8 view; ValueError when out of bounds."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"slice [{offset}, {offset + nbytes}) is outside region {self.region_id} "
                             f"of {self.nbytes} bytes")
        return self.buf[offset : offset + nbytes]

    def unlink(self) -> None:
        """Owner: remove the file once the peer has mapped it; every existing mapping stays valid."""
        if self.owner and self.path is not None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Drop this mapping (the owner also removes the file if it still exists)."""
        self.unlink()
        self.buf = torch.empty(0, dtype=torch.uint8)


class RegionArena:
    """Bump allocator over one region for one message: reset(), then place() tensors in order."""

    def __init__(self, region: SharedRegion):
        self.region = region
        self.cursor = 0
        self._devices: set[torch.device] = set()  # CUDA devices whose streams wrote into the region

    def reset(self) -> None:
        self.cursor = 0

    def place(self, t: torch.Tensor) -> common_pb2.RegionSlice | None:
        """Copy t (any device) into the region; None when it does not fit (send it inline instead)."""
        nbytes = t.numel() * t.element_size()
        start = -(-self.cursor // ALIGN) * ALIGN
        if start + nbytes > self.region.nbytes:
            return None
        if nbytes:
            dst = self.region.buf[start : start + nbytes]
            dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=False)
            self._devices.update(d for d in (t.device, dst.device) if d.type == "cuda")
        self.cursor = start + nbytes
        return common_pb2.RegionSlice(region_id=self.region.region_id, offset=start)

    def sync(self) -> None:
        """Make device writes visible to the peer before the control message is sent."""
        for d in self._devices:
            torch.cuda.synchronize(d)
        self._devices.clear()
