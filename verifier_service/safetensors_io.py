"""Sharded safetensors reading and writing (Hugging Face layout with model.safetensors.index.json).

Reading parses each shard's JSON header (8-byte little-endian length + JSON) without touching tensor
data, so a checkpoint can be validated against its config before any weight moves; data is then
read through a read-only memory map as zero-copy views (`ShardedReader.view`), one tensor at a
time, so peak host memory stays around one tensor, never one shard. Shards are opened lazily: a
rank that needs a quarter of the experts maps only the shards holding them. `stats` counts the
tensors and bytes actually read, which the expert-parallel tests check.

Writing (`write_sharded_lazy`) takes tensor *specs* (name, shape, dtype, chunk generator): shard
boundaries and headers are computed from the specs first, then each tensor is generated and written
chunk by chunk, so a real-shape Kimi checkpoint is written with host memory bounded by one chunk.
Within a shard tensors are ordered by decreasing element size (as the safetensors library does) so
every tensor starts aligned; the files are byte-compatible with `safetensors.safe_open`.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 << 20  # the safetensors library's own limit

DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype (safetensors name), shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one shard's header (no tensor data is read)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n}, file size {size})")
            raw = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (s, e) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        want = numel * DTYPES[dtype].itemsize
        if e - s != want or s < 0 or base + e > size:
            raise CheckpointError(f"{path}: tensor {name!r} byte range [{s}, {e}) does not fit shape {list(shape)} "
                                  f"{dtype} ({want} bytes) in a file of {size} bytes (truncated or corrupt file?)")
        out[name] = TensorInfo(path, dtype, shape, base + s, want)
    return out


@dataclass
class ReadStats:
    tensors: int = 0
    bytes: int = 0
    names: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)


class ShardedReader:
    """A Hugging Face safetensors folder: index + shards, headers parsed lazily, data memory-mapped."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        idx = self.folder / INDEX
        if idx.exists():
            try:
                self.weight_map: dict[str, str] = dict(json.loads(idx.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{idx}: not a valid safetensors index ({e!r})") from None
            self.index_path = idx
        elif (self.folder / SINGLE).exists():
            self.weight_map = {k: SINGLE for k in read_header(self.folder / SINGLE)}
            self.index_path = self.folder / SINGLE
        else:
            raise CheckpointError(f"{self.folder}: neither {INDEX} nor {SINGLE} exists")
        for shard in sorted(set(self.weight_map.values())):
            if not (self.folder / shard).exists():
                raise CheckpointError(f"{self.folder / shard}: shard listed in {INDEX} is missing")
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self.stats = ReadStats()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def keys(self):
        return self.weight_map.keys()

    def file_of(self, name: str) -> Path:
        return self.folder / self.weight_map[name]

    def info(self, name: str) -> TensorInfo:
        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.index_path}: tensor {name!r} is not in the checkpoint")
        hdr = self._headers.get(shard)
        if hdr is None:
            hdr = self._headers[shard] = read_header(self.folder / shard)
        if name not in hdr:
            raise CheckpointError(f"{self.folder / shard}: {INDEX} maps tensor {name!r} to this shard, "
                                  "but the shard does not contain it")
        return hdr[name]

    def open(self, path: Path) -> mmap.mmap:
        """The read-only memory map of one shard (created on first use)."""
        m = self._maps.get(path)
        if m is None:
            with open(path, "rb") as f:
                m = self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                m.madvise(mmap.MADV_SEQUENTIAL)
        return m

    def raw(self, info: TensorInfo, start: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """Zero-copy uint8 view of bytes [start, start + nbytes) of a tensor (page cache, read-only)."""
        n = info.nbytes - start if nbytes is None else nbytes
        with warnings.catch_warnings():  # the mapping is read-only; the views are never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self.open(info.file), dtype=torch.uint8, count=n, offset=info.start + start)

    def view(self, name: str) -> torch.Tensor:
        """The tensor as a zero-copy view of the memory map (a copy only if the file misaligns it)."""
        info = self.info(name)
        self.record(name, info)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.torch_dtype)
        b = self.raw(info)
        if info.start % info.torch_dtype.itemsize:
            b = b.clone()
        return b.view(info.torch_dtype).view(info.shape)

    get = view

    def record(self, name: str, info: TensorInfo) -> None:
        self.stats.tensors += 1
        self.stats.bytes += info.nbytes
        self.stats.names.add(name)
        self.stats.files.add(info.file.name)

    def drop_pages(self, path: Path, start: int, end: int) -> None:
        """Release the mapped pages of [start, end) (whole pages inside only) from this process."""
        m = self._maps.get(path)
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, end // page * page
        if m is not None and hi > lo and hasattr(mmap, "MADV_DONTNEED"):
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the map closes when it is collected
                pass
        self._maps.clear()

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- writing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: `make()` yields its data as row chunks (any split along dim 0)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def _write_shard(path: Path, specs: list[TensorSpec]) -> None:
    order = sorted(specs, key=lambda s: -s.dtype.itemsize)  # stable: keeps generation order per dtype size
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in order:
        header[s.name] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % 8)  # data starts 8-byte aligned
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for s in order:
            wrote = 0
            for chunk in s.make():
                if chunk.dtype != s.dtype:
                    raise ValueError(f"{s.name}: generator produced {chunk.dtype}, spec says {s.dtype}")
                b = chunk.contiguous().view(torch.uint8).reshape(-1).numpy()
                f.write(memoryview(b))
                wrote += b.nbytes
                del chunk, b  # release before the generator makes the next chunk: one chunk resident
            if wrote != s.nbytes:
                raise ValueError(f"{s.name}: generator produced {wrote} bytes, spec {list(s.shape)} needs {s.nbytes}")
    os.replace(tmp, path)


def write_sharded_lazy(folder: str | Path, specs: Iterable[TensorSpec], max_shard_bytes: int) -> list[str]:
    """Write specs in order into shards of at most ~max_shard_bytes plus the index; returns shard names."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for fname, group in zip(names, shards):
        _write_shard(folder / fname, group)
        weight_map.update({s.name: fname for s in group})
    total = sum(s.nbytes for g in shards for s in g)
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return names


def eager_spec(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, tuple(t.shape), t.dtype, lambda: iter((t,)))


def write_sharded(folder: str | Path, tensors, max_shard_bytes: int) -> None:
    """Write (name, tensor) pairs (a dict or an iterable, e.g. a generator) into shards plus the index.

    A generator is consumed one shard at a time: each shard is written as soon as it is full, so host
    memory holds one shard of tensors, not the checkpoint.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    items: Iterator = iter(tensors.items() if isinstance(tensors, dict) else tensors)
    written: list[tuple[Path, list[str]]] = []
    shard: list[TensorSpec] = []
    size = total = 0

    def flush():
        tmp = folder / f"shard-{len(written):05d}.partial"
        _write_shard(tmp, shard)
        written.append((tmp, [s.name for s in shard]))

    for name, t in items:
        spec = eager_spec(name, t.detach().contiguous())
        if shard and size + spec.nbytes > max_shard_bytes:
            flush()
            shard, size = [], 0
        shard.append(spec)
        size += spec.nbytes
        total += spec.nbytes
    if shard or not written:
        flush()
    weight_map = {}
    for i, (tmp, names) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(tmp, folder / fname)
        weight_map.update({k: fname for k in names})
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
