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
  pickled. The peer finds its own ordinal of the GPU by UUID (its CUDA_VISIBLE_DEVICES may differ).
  torch's IPC ref-counting keeps the allocation alive while the peer maps it: the owner freeing
  its region first parks the block (torch's "limbo") until the peer's mapping is dropped. A region
  attached in the process that created it (an in-process server, tests) is the owner's own tensor:
  CUDA cannot open an IPC handle in the process that exported it.
  Ordering: every message is a hand-over. Before a control message leaves, its sender waits for
  its current stream on the region's GPU (`RegionArena.sync`): its writes into the regions are
  complete and so are its reads of what the peer wrote last, so the peer may read and then
  overwrite. Both sides use their current stream for every region access.
  With IPC events (`IpcEvent`, negotiated when the stream opens) the sender records its event on
  its stream and sends at once, without waiting for its GPU; the receiver polls that event on the
  host (bounded by its deadline) before it touches the regions, so the sender's host work after the
  record (encoding, the socket, the receiver's decoding) overlaps the sender's GPU work. The wait is
  never put on the receiver's stream: a stream waiting on a dead peer's event never resumes.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from protos.ddtree.v1 import common_pb2, drafter_pb2
from protos.doorbell import Doorbell, poll_until

ALIGN = 64  # byte alignment of every slice (covers every dtype's itemsize)
# what torch.multiprocessing.reductions.rebuild_cuda_tensor takes (torch 2.x), matched by name
_REBUILD_ARGS = ("tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype",
                 "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "requires_grad",
                 "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
# CUDA regions created by this process, by (IPC handle, offset): attaching one here returns the tensor itself
_OWN_CUDA: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_OWN_LOCK = threading.Lock()
_REGION_POOLS: dict[int, torch.cuda.MemPool] = {}  # device index -> the pool regions are allocated from
_OWN_EVENTS: dict[bytes, torch.cuda.Event] = {}  # IPC events created here and not closed yet, by handle


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
        with torch.cuda.use_mem_pool(_region_pool(device), device=device):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        handle = _export_cuda(buf)
        with _OWN_LOCK:
            _OWN_CUDA[(handle.handle, handle.storage_offset_bytes, handle.tensor_offset)] = buf
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
        h = msg.cuda
        with _OWN_LOCK:
            own = _OWN_CUDA.get((h.handle, h.storage_offset_bytes, h.tensor_offset))
        if own is not None:  # created by this very process (an in-process drafter server, tests)
            if own.numel() != msg.nbytes:
                raise ValueError(f"shared region {msg.region_id}: {own.numel()} bytes here, announced {msg.nbytes}")
            try:  # no other process will drop the reference the export counted: drop it, so the block frees
                torch.UntypedStorage._release_ipc_counter_cuda(bytes(h.ref_counter_handle), h.ref_counter_offset)
            except Exception:  # noqa: BLE001 - torch internals, best effort: at worst the block stays parked
                pass
            return cls(msg.region_id, own, None, owner=False)
        if not torch.cuda.is_available():
            raise ValueError(f"shared region {msg.region_id} is a CUDA IPC allocation, but this process has no GPU; "
                             "use --transport grpc")
        if h.storage_size_bytes < h.tensor_offset + msg.nbytes:
            raise ValueError(f"shared region {msg.region_id}: {msg.nbytes} bytes at {h.tensor_offset} do not fit "
                             f"its storage of {h.storage_size_bytes}")
        return cls(msg.region_id, _open_cuda(msg), None, owner=False)

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
        """Drop this mapping (the owner also removes the file if it still exists). CUDA: the allocation
        lives on (torch's ref-counting) until the other side has dropped its mapping too."""
        self.unlink()
        self.buf = torch.empty(0, dtype=torch.uint8)


class IpcEvent:
    """A CUDA event shared with the peer process (cudaIpcGetEventHandle): the process that created it
    records it after its work on the regions, the peer polls it on the host (`wait_host`). Opened in the
    process that created it (an in-process drafter server, tests) it is the creator's own event."""

    def __init__(self, event: torch.cuda.Event, device: torch.device, handle: bytes, owner: bool):
        self.event, self.device, self.handle, self.owner = event, device, handle, owner

    @classmethod
    def create(cls, device: torch.device) -> IpcEvent:
        with torch.cuda.device(device):
            event = torch.cuda.Event(interprocess=True)
            handle = bytes(event.ipc_handle())
        with _OWN_LOCK:
            _OWN_EVENTS[handle] = event
        return cls(event, device, handle, owner=True)

    @classmethod
    def open(cls, handle: bytes, device: torch.device) -> IpcEvent:
        """The peer's event on this process's `device` (the regions' GPU); ValueError when it cannot be opened."""
        handle = bytes(handle)
        with _OWN_LOCK:
            own = _OWN_EVENTS.get(handle)
        if own is not None:
            return cls(own, device, handle, owner=False)
        try:
            event = torch.cuda.Event.from_ipc_handle(device, handle)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"cannot open the peer's CUDA IPC event on {device} ({e})") from e
        return cls(event, device, handle, owner=False)

    def record(self) -> None:
        """After this process's work on the regions, on its current stream."""
        self.event.record(torch.cuda.current_stream(self.device))

    def wait_host(self, timeout_s: float, abort: Callable[[], bool] | None = None) -> bool:
        """Poll until the peer's last record has completed -> True, or False after `timeout_s`. Never a
        GPU-side wait (`cudaStreamWaitEvent`): a stream waiting on a peer's event stays blocked for good when
        the peer dies before its work completes (measured on an H200: still waiting 20 s after the kill), and
        one verifier must not be able to wedge a drafter's GPU, nor a drafter a verifier's.
        `abort` (checked between polls) ends the wait early with False, e.g. once the peer's stream broke."""
        event = self.event  # `close` (the stream ending on another thread) may drop it meanwhile
        if event is None:
            return False
        try:
            return poll_until(event.query, timeout_s, abort)
        except RuntimeError:  # the peer is gone and its event with it
            return False

    def close(self) -> None:
        """Drop this side's reference (the creator also unregisters it) when the stream ends: events are
        released while the stream's owner runs, never left to the interpreter's final garbage collection."""
        if self.owner:
            with _OWN_LOCK:
                _OWN_EVENTS.pop(self.handle, None)
        self.event = None


def _region_pool(device: torch.device) -> torch.cuda.MemPool:
    """The process's memory pool for shared regions on `device`. A CUDA IPC handle maps the whole
    caching-allocator segment its tensor lies in, so a region carved from the default pool would show the peer
    whatever other tensors share that segment (a 4-byte doorbell sat in a 2 MB segment of small verifier
    tensors); in this pool regions share segments with other regions only. Created once and never dropped: torch
    aborts when a block is freed into a pool that was released before it (a pool per region, dropped with the
    region's tensor object, did that on an H200)."""
    d = torch.device(device)
    index = d.index if d.index is not None else torch.cuda.current_device()
    with _OWN_LOCK:
        pool = _REGION_POOLS.get(index)
        if pool is None:
            pool = _REGION_POOLS[index] = torch.cuda.MemPool()
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))  # never deallocated, not even at interpreter exit
        return pool


def _export_cuda(buf: torch.Tensor) -> drafter_pb2.CudaIpcHandle:
    """The IPC handle of a CUDA tensor's allocation, as proto fields (torch's reduce_tensor, which also
    arms its IPC ref-counting and records the event the peer waits for when it opens the handle)."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(buf)
    a = dict(zip(_rebuild_arg_names(rebuild), args, strict=True))
    index = int(a["storage_device"])
    return drafter_pb2.CudaIpcHandle(
        device=index, handle=a["storage_handle"], storage_size_bytes=int(a["storage_size_bytes"]),
        storage_offset_bytes=int(a["storage_offset_bytes"]), ref_counter_handle=a["ref_counter_handle"],
        ref_counter_offset=int(a["ref_counter_offset"]), event_handle=a["event_handle"] or b"",
        event_sync_required=bool(a["event_sync_required"]), tensor_offset=int(a["tensor_offset"]),
        device_uuid=cuda_uuid(index))


def _open_cuda(msg: drafter_pb2.SharedRegion) -> torch.Tensor:
    """Open a peer's CUDA region ([nbytes] uint8) on this process's ordinal of its GPU."""
    from torch.multiprocessing import reductions

    h = msg.cuda
    index = local_cuda_index(h.device_uuid, h.device, _visible_uuids())
    if index is None:
        raise ValueError(f"shared region {msg.region_id}: GPU {h.device_uuid} (cuda:{h.device} in the owner) is "
                         "not visible in this process; give both processes that GPU, or use --transport grpc")
    names = _rebuild_arg_names(reductions.rebuild_cuda_tensor)
    args = dict(tensor_cls=torch.Tensor, tensor_size=(msg.nbytes,), tensor_stride=(1,), tensor_offset=h.tensor_offset,
                storage_cls=torch.storage.TypedStorage, dtype=torch.uint8, storage_device=index,
                storage_handle=bytes(h.handle), storage_size_bytes=h.storage_size_bytes,
                storage_offset_bytes=h.storage_offset_bytes, requires_grad=False,
                ref_counter_handle=bytes(h.ref_counter_handle), ref_counter_offset=h.ref_counter_offset,
                event_handle=bytes(h.event_handle), event_sync_required=bool(h.event_sync_required))
    try:  # cudaIpcOpenMemHandle (once per handle in this process; torch caches it), then waits for the event
        return reductions.rebuild_cuda_tensor(**{k: args[k] for k in names})
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"shared region {msg.region_id}: cannot open its CUDA IPC handle on cuda:{index} ({e}); "
                         "are the verifier and the drafter on the same host? use --transport grpc otherwise") from e


def _rebuild_arg_names(fn) -> list[str]:
    """Parameter names of torch's rebuild_cuda_tensor, checked against the ones this module fills in."""
    names = list(inspect.signature(fn).parameters)
    if sorted(names) != sorted(_REBUILD_ARGS):
        raise RuntimeError(f"torch {torch.__version__}: rebuild_cuda_tensor takes {names}, this module knows "
                           f"{list(_REBUILD_ARGS)}; the CUDA IPC regions need updating for this torch")
    return names


def cuda_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _visible_uuids() -> list[str]:
    return [cuda_uuid(i) for i in range(torch.cuda.device_count())]


def local_cuda_index(uuid_text: str, owner_index: int, visible: list[str]) -> int | None:
    """This process's ordinal of the owner's GPU: by UUID when the owner sent one (None when that GPU
    is not visible here), else the owner's ordinal if it exists here."""
    if uuid_text:
        want = _norm_uuid(uuid_text)
        found = [i for i, u in enumerate(visible) if _norm_uuid(u) == want]
        return found[0] if found else None
    return owner_index if 0 <= owner_index < len(visible) else None


def _norm_uuid(text: str) -> str:
    return text.strip().lower().removeprefix("gpu-")


class RegionArena:
    """Bump allocator over one region for one message: reset(), then place() tensors in order."""

    def __init__(self, region: SharedRegion):
        self.region = region
        self.cursor = 0
        self.placed = 0  # tensors placed (observability: the co-located transport really used its region)
        # CUDA devices whose current streams touch the region: its own, plus sources of copies
        self._devices: set[torch.device] = {region.device} if region.device.type == "cuda" else set()

    def reset(self) -> None:
        self.cursor = 0

    def place(self, t: torch.Tensor) -> common_pb2.RegionSlice | None:
        """Copy t (any device) into the region; None when it does not fit (send it inline instead)."""
        nbytes = t.numel() * t.element_size()
        start = self._claim(nbytes, 1)
        if start is None:
            return None
        if nbytes:
            dst = self.region.buf[start : start + nbytes]
            dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))  # on the current stream
            if t.device.type == "cuda":
                self._devices.add(t.device)
        return common_pb2.RegionSlice(region_id=self.region.region_id, offset=start)

    def place_many(self, ts: list[torch.Tensor]) -> list[common_pb2.RegionSlice | None]:
        """place() each of ts; when they all live on the region's device and share an element size,
        back to back with one copy (one kernel on a GPU instead of one per tensor)."""
        start = self.place_stacked(ts)
        if start is None and (len(ts) < 2 or any(t.device != self.region.device or
                                                 t.element_size() != ts[0].element_size() for t in ts)):
            return [self.place(t) for t in ts]
        if start is None:
            start = self._cat(ts)
            if start is None:
                return [self.place(t) for t in ts]  # the ones that fit still go through the region
            sizes = [t.numel() * t.element_size() for t in ts]
        else:
            sizes = [ts[0].numel() * ts[0].element_size()] * len(ts)
        out = []
        for n in sizes:  # same element size: every offset stays aligned to it
            out.append(common_pb2.RegionSlice(region_id=self.region.region_id, offset=start))
            start += n
        return out

    def place_rows(self, ts: list[torch.Tensor]) -> int | None:
        """Row blocks [n_i, *rest] of one dtype and row shape on the region's device, back to back with one
        concatenation -> the offset of the [sum n_i, *rest] block; None (nothing placed) when they do not
        qualify or do not fit."""
        t0 = ts[0] if ts else None
        if t0 is None or t0.dim() == 0 or any(t.dtype != t0.dtype or t.shape[1:] != t0.shape[1:] or
                                              t.device != self.region.device for t in ts):
            return None
        return self._cat(ts)

    def _cat(self, ts: list[torch.Tensor]) -> int | None:
        """ts (on the region's device, one element size) back to back from the next aligned offset, one op."""
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        start = self._claim(nbytes, len(ts))
        if start is not None:
            torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in ts],
                      out=self.region.buf[start : start + nbytes])  # on the current stream
        return start

    def place_block(self, t: torch.Tensor) -> int | None:
        """A contiguous tensor on the region's device, copied in as it is (one op) -> its offset; None (nothing
        placed) when it is elsewhere or does not fit."""
        if t.device != self.region.device or not t.is_contiguous():
            return None
        nbytes = t.numel() * t.element_size()
        start = self._claim(nbytes, 1)
        if start is not None:
            self.region.buf[start : start + nbytes].view(t.dtype).view(t.shape).copy_(t)  # on the current stream
        return start

    def place_stacked(self, ts: list[torch.Tensor]) -> int | None:
        """Tensors of one shape and one 2-, 4- or 8-byte element size, on the region's device, back to back as
        one [len(ts), *shape] block with one stack (a batch's tree fields) -> the block's offset; None (nothing
        placed) when they do not qualify or do not fit."""
        t0 = ts[0] if ts else None
        if t0 is None or t0.element_size() not in (2, 4, 8) or t0.device != self.region.device:
            return None
        size = t0.element_size()
        if any(t.shape != t0.shape or t.element_size() != size or t.device != t0.device for t in ts[1:]):
            return None
        nbytes = len(ts) * t0.numel() * size
        start = self._claim(nbytes, len(ts))
        if start is None:
            return None
        word = {2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        torch.stack([t.detach() if t.dtype == word else t.detach().view(word) for t in ts],
                    out=self.region.buf[start : start + nbytes].view(word).view(len(ts), *t0.shape))  # current stream
        return start

    def _claim(self, nbytes: int, count: int) -> int | None:
        """The next ALIGN-aligned offset with room for nbytes, taken for `count` tensors; None (nothing taken) when
        the region has no room left."""
        start = -(-self.cursor // ALIGN) * ALIGN
        if start + nbytes > self.region.nbytes:
            return None
        self.cursor = start + nbytes
        self.placed += count
        return start

    def hand_over(self, event: IpcEvent | None) -> None:
        """Before the control message leaves: record `event` (the peer polls it) when this arena's
        work ran on the event's GPU only, else wait for the GPU (`sync`)."""
        if event is not None and self._devices <= {event.device}:
            event.record()
        else:
            self.sync()

    def ring(self, bell: Doorbell, value: int) -> None:
        """Before the control message leaves: ring the peer's doorbell with `value` on the GPU, after this
        arena's writes (work on another GPU is waited for first)."""
        if not self._devices <= {bell.device}:
            self.sync()
        bell.ring(value)

    def sync(self) -> None:
        """Before the control message leaves: wait until this process's work on the region's GPU is
        done (the copies into it, and any kernel still reading what the peer wrote there last), so
        the peer may read and overwrite it. The current stream only: a device-wide synchronize
        would also wait for unrelated streams (NCCL collectives of expert parallelism, for one)."""
        for d in self._devices:
            torch.cuda.current_stream(d).synchronize()
