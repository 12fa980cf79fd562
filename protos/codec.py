"""Wire codecs: torch tensors, draft requests and draft trees <-> ddtree.v1 protobuf messages.

Protobuf stays at the edge: servicers and transport clients call these functions and pass
dataclasses and tensors inward. A tensor travels as raw little-endian row-major bytes with dtype
and shape (remote transport), or as a slice of a shared region registered when the stream was
opened (co-located transport, see `protos.shared_region`). Decoding checks every size against the
message before touching bytes: a malformed message raises `WireError` naming the field; it never
reads out of bounds and never trusts a length.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Mapping, Sequence

import grpc
import numpy as np
import torch

from drafter_service.api import DraftRequest
from kernels.tree_build import TreeBatch
from protos.ddtree.v1 import common_pb2, drafter_pb2
from protos.doorbell import Doorbell
from protos.shared_region import IpcEvent, RegionArena, SharedRegion

if sys.byteorder != "little":  # the wire is little-endian and tensors are sent as their memory
    raise ImportError("protos.codec supports little-endian hosts only")

DTYPE_TO_PB = {
    torch.float32: common_pb2.DTYPE_FLOAT32, torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16, torch.float64: common_pb2.DTYPE_FLOAT64,
    torch.int32: common_pb2.DTYPE_INT32, torch.int64: common_pb2.DTYPE_INT64,
    torch.uint8: common_pb2.DTYPE_UINT8, torch.bool: common_pb2.DTYPE_BOOL,
}
PB_TO_DTYPE = {v: k for k, v in DTYPE_TO_PB.items()}
MAX_DIMS = 8
MAX_CACHED_VIEWS = 256  # tensor_from_pb's view cache starts over past this many entries
TREE_FIELDS = TreeBatch._FIELDS  # tokens, parent, depth, first_child, next_sibling, logw
TREE_DTYPES = {"tokens": torch.int32, "parent": torch.int32, "depth": torch.int32, "first_child": torch.int32,
               "next_sibling": torch.int32, "logw": torch.float32}
_TREE_PB_DTYPES = tuple(DTYPE_TO_PB[TREE_DTYPES[f]] for f in TREE_FIELDS)


class WireError(ValueError):
    """A message that does not decode; the text names the field and what is wrong."""


# --- tensors ---------------------------------------------------------------------------------------
def tensor_to_pb(t: torch.Tensor, out: common_pb2.Tensor | None = None,
                 arena: RegionArena | None = None, where: common_pb2.RegionSlice | None = None) -> common_pb2.Tensor:
    """Encode t into `out` (or a new message): at `where` when t was placed in a region already, else
    into the arena's region when given and t fits, otherwise inline as little-endian bytes."""
    if t.dtype not in DTYPE_TO_PB:
        raise TypeError(f"dtype {t.dtype} cannot travel on the wire (supported: {sorted(map(str, DTYPE_TO_PB))})")
    msg = out if out is not None else common_pb2.Tensor()
    msg.dtype = DTYPE_TO_PB[t.dtype]
    msg.shape[:] = list(t.shape)
    if where is None and arena is not None:
        where = arena.place(t)
    if where is not None:
        msg.region.CopyFrom(where)
    else:
        msg.data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return msg


def tensor_from_pb(msg: common_pb2.Tensor, field: str, regions: Mapping[int, SharedRegion] | None = None,
                   copy: bool = True, views: dict | None = None) -> torch.Tensor:
    """Decode; `copy=False` returns a view of the shared region (valid until the peer reuses it). `views`: a
    cache of such views, which the caller keeps no longer than its regions: a peer that places its tensors at the
    same offsets each step then costs no view ops (host time before the co-located drafter's first launch)."""
    dtype, shape, nbytes = _layout(msg, field)
    which = msg.WhichOneof("storage")
    if which == "region":
        region = _region_of(msg, field, regions, dtype.itemsize, nbytes)
        key = (region.region_id, msg.region.offset, msg.dtype, *shape)
        t = views.get(key) if views is not None else None
        if t is None:
            t = region.view(msg.region.offset, nbytes).view(dtype).view(shape)
            if views is not None:
                if len(views) >= MAX_CACHED_VIEWS:
                    views.clear()
                views[key] = t
        return t.clone() if copy else t
    data = msg.data if which == "data" else b""
    if len(data) != nbytes:
        raise WireError(f"{field}: {len(data)} bytes for shape {shape} of {dtype} (expected {nbytes})")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)


def _layout(msg: common_pb2.Tensor, field: str) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, byte size) of a Tensor message, checked."""
    if msg.dtype not in PB_TO_DTYPE:
        raise WireError(f"{field}: unknown dtype {msg.dtype}")
    dtype = PB_TO_DTYPE[msg.dtype]
    shape = list(msg.shape)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise WireError(f"{field}: invalid shape {shape}")
    return dtype, shape, math.prod(shape) * dtype.itemsize


def _region_of(msg: common_pb2.Tensor, field: str, regions: Mapping[int, SharedRegion] | None, itemsize: int,
               nbytes: int) -> SharedRegion:
    """The region holding a Tensor message's `nbytes`, checked: known, aligned, in bounds."""
    region = (regions or {}).get(msg.region.region_id)
    if region is None:
        raise WireError(f"{field}: unknown shared region {msg.region.region_id}")
    offset = msg.region.offset
    if offset % itemsize:
        raise WireError(f"{field}: region offset {offset} is not aligned to {itemsize} bytes")
    if offset + nbytes > region.nbytes:
        raise WireError(f"{field}: slice [{offset}, {offset + nbytes}) is outside region {region.region_id} "
                        f"of {region.nbytes} bytes")
    return region


# --- draft requests (verifier -> drafter) ------------------------------------------------------------
def draft_request_to_pb(r: DraftRequest, arena: RegionArena | None = None,
                        where: common_pb2.RegionSlice | None = None) -> drafter_pb2.SessionDraftRequest:
    """`where`: ctx_features were placed in a region already (`RegionArena.place_many`)."""
    msg = drafter_pb2.SessionDraftRequest(session_id=r.session_id, ctx_start=r.ctx_start, root_token=r.root_token,
                                          root_pos=r.root_pos, budget=r.budget, topk=r.topk,
                                          traceparent=r.traceparent)
    tensor_to_pb(r.ctx_features, msg.ctx_features, arena, where)
    return msg


def draft_request_from_pb(msg: drafter_pb2.SessionDraftRequest, regions: Mapping[int, SharedRegion] | None = None,
                          copy: bool = True) -> DraftRequest:
    """Structural decode only; the drafter checks values against its model (`drafter_service.server`)."""
    feats = tensor_from_pb(msg.ctx_features, f"session {msg.session_id!r}: ctx_features", regions, copy)
    if feats.dim() != 2:
        raise WireError(f"session {msg.session_id!r}: ctx_features must be 2-D [rows, features], "
                        f"got shape {list(feats.shape)}")
    return DraftRequest(msg.session_id, msg.ctx_start, feats, msg.root_token, msg.root_pos, msg.budget, msg.topk,
                        msg.traceparent)


# --- draft trees (drafter -> verifier) ---------------------------------------------------------------
def _new_trees(out: drafter_pb2.DraftTrees | None, step_id: int, session_ids: list[str], n_nodes: list[int],
               **fields) -> drafter_pb2.DraftTrees:
    """A DraftTrees with these fields: `out` itself (empty, e.g. a response's `trees`: no copy into a wrapper
    afterwards) when given, else a new message."""
    if out is None:
        return drafter_pb2.DraftTrees(step_id=step_id, session_ids=session_ids, n_nodes=n_nodes, **fields)
    out.step_id = step_id
    out.session_ids.extend(session_ids)
    out.n_nodes.extend(n_nodes)
    for k, v in fields.items():
        setattr(out, k, v)
    return out


def trees_to_pb(trees: TreeBatch, session_ids: list[str], step_id: int, arena: RegionArena | None = None,
                event: IpcEvent | None = None, bell: tuple[Doorbell, int] | None = None,
                out: drafter_pb2.DraftTrees | None = None) -> drafter_pb2.DraftTrees:
    """Encode (into `out` when given: an empty message, e.g. the response's); with an arena the tensors go into its
    region, handed over before this returns: by ringing `bell` = (the peer's doorbell, the step's value) on the GPU
    after the writes (`doorbell_value` set) when given, else by recording `event` (the peer polls it; `after_event`
    set), else by waiting for the GPU."""
    if len(session_ids) != trees.tokens.shape[0]:
        raise ValueError(f"{len(session_ids)} session ids for {trees.tokens.shape[0]} trees")
    msg = _new_trees(out, step_id, session_ids, trees.n_nodes)
    packed, start = trees.packed, None
    packed = packed if packed is not None and packed.dtype == torch.int32 else None
    if arena is None and packed is not None:  # bytes of one [6, R, M] host buffer: six slices of one array
        host = packed.device.type == "cpu" and packed.is_contiguous()  # a GPU drafter's pinned copy: as it is
        raw = (packed if host else packed.detach().contiguous().cpu()).numpy()
        shape = list(packed.shape[1:])
        for i, (f, code) in enumerate(zip(TREE_FIELDS, _TREE_PB_DTYPES)):
            m = getattr(msg, f)
            m.dtype, m.data = code, raw[i].tobytes()
            m.shape.extend(shape)
        return msg
    if arena is not None and packed is not None:
        start = arena.place_block(packed)  # the graphed drafter's trees: one buffer, one copy
    fields = [t if (t := getattr(trees, f)).dtype == TREE_DTYPES[f] else t.to(TREE_DTYPES[f]) for f in TREE_FIELDS]
    if start is None and arena is not None:
        start = arena.place_stacked(fields)
    in_region = start is not None
    if in_region:  # the usual layout (`_packed_trees` reads it back): set the six messages directly
        shape, step, rid = list(fields[0].shape), fields[0].numel() * 4, arena.region.region_id
        for i, (f, code) in enumerate(zip(TREE_FIELDS, _TREE_PB_DTYPES)):
            m = getattr(msg, f)
            m.dtype, m.region.region_id, m.region.offset = code, rid, start + i * step
            m.shape.extend(shape)
    else:
        places = arena.place_many(fields) if arena is not None else [None] * len(fields)
        for f, t, where in zip(TREE_FIELDS, fields, places):
            tensor_to_pb(t, getattr(msg, f), where=where)
        in_region = any(p is not None for p in places)
    if arena is not None:
        _hand_over(msg, arena, event, bell, in_region)
    return msg


def code_name(value: int) -> str:
    """Name of the grpc.StatusCode with this integer value (UNKNOWN outside the enum)."""
    return next((c.name for c in grpc.StatusCode if c.value[0] == value), "UNKNOWN")


def answer_errors(msg: drafter_pb2.DraftTrees, answered: Sequence[str], asked: Collection[str]) -> dict[str, str]:
    """The sessions a trees answer refused (session id -> "CODE: message"), checked against those it answered:
    disjoint, and together exactly the asked ones (WireError otherwise)."""
    errors = {e.session_id: f"{code_name(e.code)}: {e.message}" for e in msg.errors}
    if set(answered) & set(errors) or set(answered) | set(errors) != set(asked):
        raise WireError(f"step {msg.step_id}: answered sessions {sorted(set(answered) | set(errors))} "
                        f"!= asked {sorted(asked)}")
    return errors


def trees_in_place(trees: TreeBatch, session_ids: list[str], step_id: int, rows: list[int], n_rows: int,
                   width: int, arena: RegionArena, event: IpcEvent | None = None,
                   bell: tuple[Doorbell, int] | None = None, out: drafter_pb2.DraftTrees | None = None
                   ) -> drafter_pb2.DraftTrees:
    """Encode for DraftStep.trees_in_place: the step's trees as one int32 block [6, n_rows, width] at offset 0 of
    the arena's (fresh) region, session_ids[j]'s tree in row rows[j], every other row all -1 (logw -inf), then
    handed over as `trees_to_pb` does; the answer names no tensors (`in_place`). ValueError when the block does not
    fit the region or the arena has placed something already (the layout is the verifier's, not ours). `out`: as
    for `trees_to_pb`."""
    if len(session_ids) != trees.tokens.shape[0] or len(rows) != len(session_ids):
        raise ValueError(f"{len(session_ids)} session ids and {len(rows)} rows for {trees.tokens.shape[0]} trees")
    dev = arena.region.device
    packed = trees.pack()
    if packed.device == dev and packed.dtype == torch.int32 and tuple(packed.shape[1:]) == (n_rows, width) \
            and rows == list(range(n_rows)):
        block = packed.contiguous()  # every session answered, in order, at the laid-out width: the usual step
    else:
        block = torch.full((6, n_rows, width), -1, dtype=torch.int32, device=dev)
        block[5].view(torch.float32).fill_(float("-inf"))
        w = min(width, packed.shape[2])
        for j, r in enumerate(rows):  # a copy per tree: no index upload, no kernel the usual step does not run
            block[:, r, :w].copy_(packed[:, j, :w])
    if arena.cursor or arena.place_block(block) != 0:
        raise ValueError(f"trees in place: a [6, {n_rows}, {width}] int32 block ({block.numel() * 4} bytes) does "
                         f"not fit at offset 0 of the response region ({arena.region.nbytes} bytes)")
    msg = _new_trees(out, step_id, session_ids, trees.n_nodes, in_place=True)
    _hand_over(msg, arena, event, bell, True)
    return msg


def _hand_over(msg: drafter_pb2.DraftTrees, arena: RegionArena, event: IpcEvent | None,
               bell: tuple[Doorbell, int] | None, in_region: bool) -> None:
    """The region's writes -> the peer: ring `bell` after them, else record `event`, else wait for the GPU."""
    if bell is not None:
        arena.ring(*bell)
        msg.doorbell_value = bell[1]
    else:
        arena.hand_over(event)
        msg.after_event = event is not None and in_region


def _usual_layout(msg: drafter_pb2.DraftTrees, R: int) -> tuple[list[common_pb2.Tensor], int, str] | None:
    """(the six field messages, M, their one storage kind) when the fields are laid out as `trees_to_pb` lays them
    out: [R, M] each, M > 0, their TREE_DTYPES, one storage kind; else None (the general decoder says what is wrong)."""
    ms = [getattr(msg, f) for f in TREE_FIELDS]
    storage = {m.WhichOneof("storage") for m in ms}
    if len(storage) != 1 or tuple(m.dtype for m in ms) != _TREE_PB_DTYPES:
        return None
    shape = tuple(ms[0].shape)
    if len(shape) != 2 or shape[0] != R or any(tuple(m.shape) != shape for m in ms[1:]) or 0 in shape:
        return None
    return ms, shape[1], storage.pop()


def _inline_block(ms: list[common_pb2.Tensor], R: int, M: int) -> bytes | None:
    """Six inline [R, M] 4-byte fields -> their bytes back to back ([6, R, M]), None when a size is off."""
    step = R * M * 4
    if any(len(m.data) != step for m in ms):
        return None
    return b"".join(m.data for m in ms)


def _session_ids(msg: drafter_pb2.DraftTrees) -> list[str]:
    ids = list(msg.session_ids)
    if len(msg.n_nodes) != len(ids):
        raise WireError(f"trees: {len(msg.n_nodes)} n_nodes for {len(ids)} session ids")
    if len(set(ids)) != len(ids):
        raise WireError("trees: duplicate session ids")
    return ids


def inline_trees(msg: drafter_pb2.DraftTrees) -> tuple[list[str], list[int], np.ndarray] | None:
    """A bytes answer in `trees_to_pb`'s layout -> (session ids, node counts, [6, R, M] int32 read-only array in
    TREE_FIELDS order, logw's bits last), with one join and numpy alone (no torch ops: the gRPC landing decodes
    every step's answer this way); None for any other layout (`trees_from_pb` decodes it, or says what is wrong).
    WireError when the ids do not add up. The trees' contents are checked on the GPU (`tree_verdicts`)."""
    ids = _session_ids(msg)
    R = len(ids)
    layout = _usual_layout(msg, R)
    if layout is None or layout[2] != "data":
        return None
    raw = _inline_block(layout[0], R, layout[1])
    if raw is None:
        return None
    return ids, list(msg.n_nodes), np.frombuffer(raw, dtype=np.int32).reshape(6, R, layout[1])


def _packed_trees(msg: drafter_pb2.DraftTrees, R: int, regions: Mapping[int, SharedRegion] | None, copy: bool
                  ) -> TreeBatch | None:
    """The usual layouts (`trees_to_pb`'s): six 4-byte [R, M] fields back to back in one region, in TREE_FIELDS
    order, or all six inline -> the batch as views of one buffer, with as few message reads and tensor ops as
    possible (this runs every draft step). None when the message is laid out otherwise or does not add up (the
    general decoder checks it and says what is wrong)."""
    layout = _usual_layout(msg, R)
    if layout is None:
        return None
    ms, M, storage = layout
    if storage == "data":  # inline bytes: one join, one tensor
        raw = _inline_block(ms, R, M)
        if raw is None:
            return None
        packed = torch.frombuffer(bytearray(raw), dtype=torch.int32)
        return TreeBatch.from_packed(packed.view(6, R, M), list(msg.n_nodes))
    if storage != "region":
        return None
    rid, start = ms[0].region.region_id, ms[0].region.offset
    step = R * M * 4
    if any(m.region.region_id != rid or m.region.offset != start + i * step for i, m in enumerate(ms)):
        return None
    region = (regions or {}).get(rid)
    if region is None or start % 4 or start + 6 * step > region.nbytes:
        return None  # the general decoder says what is wrong
    packed = region.view(start, 6 * step).view(torch.int32).view(6, R, M)
    return TreeBatch.from_packed(packed.clone() if copy else packed, list(msg.n_nodes))


def trees_from_pb(msg: drafter_pb2.DraftTrees, regions: Mapping[int, SharedRegion] | None = None,
                  copy: bool = True) -> tuple[list[str], TreeBatch]:
    """Decode the batch structure: six [R, M] tensors of the right dtypes, R session ids and node
    counts. Inline fields are host tensors; fields in a shared region are copied out on the region's
    device (one copy per region, on the current stream: the peer may reuse the region once this
    process hands it back), so trees from a CUDA region never visit the host. copy=False: trees laid out
    as `trees_to_pb` lays them out come back as a view of the region instead (`TreeBatch.packed`; valid
    until the region is handed back). The trees' contents are checked by `verifier_service.tree_validation`."""
    ids = _session_ids(msg)
    R = len(ids)
    packed = _packed_trees(msg, R, regions, copy)
    if packed is not None:
        return ids, packed
    arrays: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    in_region: dict[int, list[tuple[str, int, int]]] = {}  # region id -> (field, offset, nbytes)
    for f in TREE_FIELDS:
        if not msg.HasField(f):
            raise WireError(f"trees: {f} is missing")
        m = getattr(msg, f)
        dtype, shape, nbytes = _layout(m, f"trees.{f}")
        if dtype != TREE_DTYPES[f]:
            raise WireError(f"trees.{f}: dtype {dtype}, expected {TREE_DTYPES[f]}")
        if len(shape) != 2 or shape[0] != R:
            raise WireError(f"trees.{f}: shape {shape}, expected [{R}, M]")
        shapes[f] = shape
        if m.WhichOneof("storage") == "region":
            _region_of(m, f"trees.{f}", regions, dtype.itemsize, nbytes)
            in_region.setdefault(m.region.region_id, []).append((f, m.region.offset, nbytes))
        else:
            arrays[f] = tensor_from_pb(m, f"trees.{f}")
    M = shapes["tokens"][1]
    bad = [f for f, shape in shapes.items() if shape[1] != M]
    if bad:
        raise WireError(f"trees: {bad} do not have M = {M} columns like tokens")
    for rid, fields in in_region.items():  # one copy of the span covering the region's fields
        lo = min(off for _, off, _ in fields)
        hi = max(off + n for _, off, n in fields)
        mine = regions[rid].view(lo, hi - lo).clone()
        for f, off, n in fields:
            arrays[f] = mine[off - lo : off - lo + n].view(TREE_DTYPES[f]).view(shapes[f])
    return ids, TreeBatch(**{f: arrays[f] for f in TREE_FIELDS}, n_nodes=[int(n) for n in msg.n_nodes])
