"""Stream checkpoint tensors from memory-mapped shards into preallocated model tensors, with a progress bar.

Input: `Copy` items (a source tensor in a shard, a contiguous destination view, e.g. one expert's gate
rows inside a layer's stacked `w13_packed` on the GPU). They are processed in file order, so the disk
is read sequentially, and no host copy larger than one staging slot is ever made: there is no
whole-shard read and no host-side stacking of experts.

- CPU destination: `dst.copy_(mmap view)` (converting dtype if needed), tensor by tensor.
- CUDA destination: a pipeline over `workers + 1` pinned staging slots of `slot_bytes`. Worker threads
  copy file bytes (page-cache -> pinned; this is where the disk is read, several regions in flight)
  while the main thread issues async host-to-device copies on a side stream; a slot is refilled only
  after the event of its previous H2D copy has completed. Tensors larger than a slot are split.
  Sources whose dtype differs from the destination are staged whole into a device temporary and
  converted on the GPU.
After a region has been copied its mapped pages are released (MADV_DONTNEED), so resident host memory
stays around `(workers + 1) * slot_bytes` plus the page-cache the kernel manages itself.
"""

from __future__ import annotations

import contextlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from verifier_service.safetensors_io import ShardedReader, TensorInfo


@dataclass
class Copy:
    name: str  # checkpoint tensor name (for stats and errors)
    src: TensorInfo
    dst: torch.Tensor  # contiguous view of the destination; same number of elements as src


class Progress:
    """A one-line progress bar on stderr (tqdm is not a dependency): percent, GB done, GB/s, ETA."""

    def __init__(self, total_bytes: int, label: str, enabled: bool | None = None, stream=None, min_interval=0.2):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total, self.done, self.label = max(total_bytes, 1), 0, label
        self.t0 = self.last = time.perf_counter()
        self.min_interval = min_interval

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self.last >= self.min_interval or self.done >= self.total):
            self.last = now
            self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        dt = max(now - self.t0, 1e-9)
        rate = self.done / dt
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        self.stream.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                          f"{rate / 1e9:.2f} GB/s ETA {eta:4.0f}s{end}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter(), "\n")


def stream_copies(reader: ShardedReader, copies: list[Copy], progress: Progress | None = None,
                  workers: int = 4, slot_bytes: int = 64 << 20, pipeline: bool | None = None) -> None:
    """Copy every item's source bytes into its destination (all destinations on one device).

    `pipeline` (default: only for CUDA) selects the staged multi-threaded path; on a CPU destination it
    runs with unpinned slots and synchronous copies, which is how the tests exercise its splitting.
    """
    copies = sorted(copies, key=lambda c: (str(c.src.file), c.src.start))
    for c in copies:
        if c.dst.numel() != _numel(c.src.shape) or not c.dst.is_contiguous():
            raise ValueError(f"internal: destination of {c.name!r} is {tuple(c.dst.shape)} "
                             f"(contiguous={c.dst.is_contiguous()}), source {list(c.src.shape)}")
    progress = progress or Progress(sum(c.src.nbytes for c in copies), "load", enabled=False)
    if not copies:
        return
    if pipeline if pipeline is not None else copies[0].dst.device.type == "cuda":
        _stream_staged(reader, copies, progress, max(1, workers), slot_bytes)
    else:
        _stream_host(reader, copies, progress)
    progress.close()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _stream_host(reader: ShardedReader, copies: list[Copy], progress: Progress) -> None:
    for c in copies:
        c.dst.copy_(reader.view(c.name).reshape(c.dst.shape))
        reader.drop_pages(c.src.file, c.src.start, c.src.start + c.src.nbytes)
        progress.update(c.src.nbytes)


def _stream_staged(reader: ShardedReader, copies: list[Copy], progress: Progress, workers: int, slot_bytes: int):
    # pieces: (copy index, byte offset in tensor, nbytes, offset in slot), grouped into slot-sized batches
    batches: list[list[tuple[int, int, int, int]]] = [[]]
    fill = 0
    for k, c in enumerate(copies):
        reader.record(c.name, c.src)
        off = 0
        while off < c.src.nbytes:
            n = min(c.src.nbytes - off, slot_bytes - fill)
            batches[-1].append((k, off, n, fill))
            off += n
            fill += n
            if fill == slot_bytes:
                batches.append([])
                fill = 0
    batches = [b for b in batches if b]
    nslots = min(workers + 1, len(batches))
    if nslots == 0:
        return
    device = copies[0].dst.device
    cuda = device.type == "cuda"
    slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(nslots)]
    stream = torch.cuda.Stream(device) if cuda else None
    if cuda:
        stream.wait_stream(torch.cuda.current_stream(device))  # destinations were allocated on the default stream
    temps: dict[int, torch.Tensor] = {}  # whole-tensor device staging for dtype-converting copies
    for f in {c.src.file for c in copies}:
        reader.open(f)  # map every shard here, not concurrently in the workers

    def fill_slot(b: int, slot: int, ev: torch.cuda.Event | None) -> None:
        if ev is not None:
            ev.synchronize()  # the H2D copy that last read this slot is done
        buf = slots[slot]
        for k, off, n, soff in batches[b]:
            buf[soff : soff + n].copy_(reader.raw(copies[k].src, off, n))
        spans: dict = {}
        for k, off, n, _ in batches[b]:
            s = copies[k].src
            lo, hi = spans.get(s.file, (s.start + off, s.start + off + n))
            spans[s.file] = (min(lo, s.start + off), max(hi, s.start + off + n))
        for f, (lo, hi) in spans.items():
            reader.drop_pages(f, lo, hi)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weight-stream") as pool:
        futures = {b: pool.submit(fill_slot, b, b % nslots, None) for b in range(nslots)}
        for b in range(len(batches)):
            slot = b % nslots
            futures.pop(b).result()
            moved = 0
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for k, off, n, soff in batches[b]:
                    c = copies[k]
                    src = slots[slot][soff : soff + n]
                    if c.dst.dtype == c.src.torch_dtype:
                        c.dst.view(-1).view(torch.uint8)[off : off + n].copy_(src, non_blocking=cuda)
                    else:  # stage the whole tensor on the device, convert once complete
                        tmp = temps.get(k)
                        if tmp is None:
                            tmp = temps[k] = torch.empty(c.src.nbytes, dtype=torch.uint8, device=device)
                        tmp[off : off + n].copy_(src, non_blocking=cuda)
                        if off + n == c.src.nbytes:
                            c.dst.copy_(temps.pop(k).view(c.src.torch_dtype).view(c.dst.shape))
                    moved += n
                ev = None
                if cuda:  # on a CPU destination the copies above were synchronous
                    ev = torch.cuda.Event()
                    ev.record(stream)
            progress.update(moved)
            if b + nslots < len(batches):
                futures[b + nslots] = pool.submit(fill_slot, b + nslots, slot, ev)
    if cuda:
        stream.synchronize()
        torch.cuda.current_stream(device).wait_stream(stream)
