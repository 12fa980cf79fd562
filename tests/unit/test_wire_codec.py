"""Wire codecs: tensors, draft requests, trees and decode parameters <-> protobuf, inline and through
shared regions; every malformed message is refused with a WireError naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter_service.api import DraftRequest
from kernels.tree_build import TreeBatch, build_tree
from protos.codec import (
    WireError,
    draft_request_from_pb,
    draft_request_to_pb,
    inline_trees,
    tensor_from_pb,
    tensor_to_pb,
    trees_from_pb,
    trees_in_place,
    trees_to_pb,
)
from protos.ddtree.v1 import common_pb2, drafter_pb2, verifier_pb2
from protos.shared_region import RegionArena, SharedRegion
from protos.verifier_codec import params_from_pb, params_to_pb
from verifier_service.sampling_params import SamplingParams
from verifier_service.session import DecodeParams

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.bool]


def sample(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(0, 200, shape, generator=g).to(dtype)


@pytest.fixture
def region():
    r = SharedRegion.create(7, 4096)
    yield r
    r.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (0, 6), (), (2, 3, 4)])
def test_tensor_roundtrip_inline(dtype, shape):
    t = sample(dtype, shape)
    msg = common_pb2.Tensor.FromString(tensor_to_pb(t).SerializeToString())
    back = tensor_from_pb(msg, "t")
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_inline_bytes_are_little_endian_row_major():
    msg = tensor_to_pb(torch.tensor([[1, 256], [2, 3]], dtype=torch.int32).T)  # non-contiguous input
    assert list(msg.shape) == [2, 2] and msg.dtype == common_pb2.DTYPE_INT32
    assert msg.data == bytes([1, 0, 0, 0, 2, 0, 0, 0, 0, 1, 0, 0, 3, 0, 0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tensor_roundtrip_through_a_region_mapped_twice(region, dtype):
    peer = SharedRegion.attach(region.to_pb())  # a second, independent mapping (what the peer does)
    arena = RegionArena(region)
    ts = [sample(dtype, (5, 3), seed=i) for i in range(3)]
    msgs = [tensor_to_pb(t, arena=arena) for t in ts]
    assert all(m.WhichOneof("storage") == "region" for m in msgs)
    assert all(m.region.offset % 64 == 0 for m in msgs)
    for t, m in zip(ts, msgs):
        assert torch.equal(tensor_from_pb(m, "t", {7: peer}), t)
    view = tensor_from_pb(msgs[0], "t", {7: peer}, copy=False)
    region.buf[msgs[0].region.offset] ^= 1  # a view sees the owner's later writes; a copy does not
    assert not torch.equal(view, ts[0])
    peer.close()


def test_arena_overflow_falls_back_to_inline(region):
    arena = RegionArena(region)
    big = torch.zeros(2000, dtype=torch.float32)  # 8000 bytes > 4096
    assert tensor_to_pb(big, arena=arena).WhichOneof("storage") == "data"
    assert tensor_to_pb(torch.ones(10), arena=arena).WhichOneof("storage") == "region"


@pytest.mark.parametrize("mutate, words", [
    (lambda m: setattr(m, "dtype", 99), "unknown dtype"),
    (lambda m: m.shape.append(-1), "invalid shape"),
    (lambda m: setattr(m, "data", m.data[:-1]), "bytes for shape"),
    (lambda m: m.shape.__setitem__(0, 4), "bytes for shape"),
    (lambda m: m.region.CopyFrom(common_pb2.RegionSlice(region_id=3, offset=0)), "unknown shared region"),
    (lambda m: m.region.CopyFrom(common_pb2.RegionSlice(region_id=7, offset=4088)), "outside region"),
    (lambda m: m.region.CopyFrom(common_pb2.RegionSlice(region_id=7, offset=2)), "not aligned"),
])
def test_malformed_tensors_are_refused(region, mutate, words):
    msg = tensor_to_pb(torch.ones(3, 2))
    mutate(msg)
    with pytest.raises(WireError, match=words) as e:
        tensor_from_pb(msg, "ctx_features", {7: region})
    assert "ctx_features" in str(e.value)


def test_draft_request_roundtrip_bf16():
    r = DraftRequest("s-1", 12, sample(torch.bfloat16, (4, 16)), 9, 16, 32, 4)
    back = draft_request_from_pb(draft_request_to_pb(r))
    assert (back.session_id, back.ctx_start, back.root_token, back.root_pos, back.budget, back.topk) == \
           ("s-1", 12, 9, 16, 32, 4)
    assert torch.equal(back.ctx_features, r.ctx_features)
    msg = draft_request_to_pb(DraftRequest("s", 0, torch.ones(3), 0, 0, 1, 1))
    with pytest.raises(WireError, match="2-D"):
        draft_request_from_pb(msg)


def trees(R=3, V=50, L=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(torch.randn(R, L, V, generator=g), -1)
    return build_tree(logq, torch.tensor([1, 2, 3][:R]), [16, 3, 8][:R], [4, 2, 3][:R])


@pytest.mark.parametrize("through_region", [False, True])
def test_trees_roundtrip(region, through_region):
    tb = trees()
    arena = RegionArena(region) if through_region else None
    msg = trees_to_pb(tb, ["a", "b", "c"], 5, arena)
    ids, back = trees_from_pb(msg, {7: region})
    assert ids == ["a", "b", "c"] and back.n_nodes == tb.n_nodes and msg.step_id == 5
    for f in TreeBatch._FIELDS:
        assert torch.equal(getattr(back, f), getattr(tb, f)), f


@pytest.mark.parametrize("through_region", [False, True])
def test_packed_trees_roundtrip(region, through_region):
    """A batch held as one [6, R, M] buffer (the graphed drafter's) goes into the region with one copy and comes
    back as one buffer again: the decoded batch's arrays are views of its `packed` (one tensor to check)."""
    tb = trees()
    packed = TreeBatch.from_packed(tb.pack().clone(), tb.n_nodes)
    assert packed.packed is not None and packed.tokens.data_ptr() == packed.packed.data_ptr()
    assert torch.equal(packed.logw, tb.logw) and packed.pack() is packed.packed
    arena = RegionArena(region) if through_region else None
    msg = trees_to_pb(packed, ["a", "b", "c"], 5, arena)
    if through_region:
        assert arena.placed == 1 and msg.tokens.WhichOneof("storage") == "region"
    ids, back = trees_from_pb(msg, {7: region})
    assert ids == ["a", "b", "c"] and back.n_nodes == tb.n_nodes
    for f in TreeBatch._FIELDS:
        assert torch.equal(getattr(back, f), getattr(tb, f)), f
    if through_region:  # one copy out of the region, not views of it (the peer reuses it next step)
        assert back.packed is not None and back.packed.data_ptr() != region.buf.data_ptr()
    else:  # inline: six slices of one array on the way out, one buffer on the way in
        assert back.packed is not None and back.tokens.data_ptr() == back.packed.data_ptr()
        assert msg == trees_to_pb(tb, ["a", "b", "c"], 5)  # the same message as from six separate tensors
    assert torch.equal(back.pack(), tb.pack())


@pytest.mark.parametrize("rows, packed, extra", [([0, 1, 2], True, 0), ([0, 1, 2], False, 3), ([2, 0], True, 1)])
def test_trees_in_place_are_where_the_step_asked(region, rows, packed, extra):
    """DraftStep.trees_in_place: one [6, R, width] int32 block at the region's offset 0, each tree in its session's
    row of the step (here also out of order, and one session without a tree: its row all -1, logw -inf), padded
    past its nodes; the answer names no tensors. packed + exact width + every row in order is the usual step."""
    tb = trees()
    mine = [0, 2] if len(rows) == 2 else [0, 1, 2]
    sel = TreeBatch.from_packed(tb.pack()[:, mine].contiguous(), [tb.n_nodes[j] for j in mine])
    if not packed:
        sel = TreeBatch(*(getattr(sel, f).clone() for f in TreeBatch._FIELDS), n_nodes=sel.n_nodes)
    M = tb.tokens.shape[1]
    width = M + extra
    region.buf.fill_(0x55)  # whatever the last step left there
    ids = [["a", "b", "c"][j] for j in mine]
    msg = trees_in_place(sel, ids, 9, rows, 3, width, RegionArena(region))
    assert msg.in_place and msg.step_id == 9 and list(msg.session_ids) == ids and list(msg.n_nodes) == sel.n_nodes
    assert not any(getattr(msg, f).ByteSize() for f in TreeBatch._FIELDS)
    block = region.view(0, 6 * 3 * width * 4).view(torch.int32).view(6, 3, width)
    back = TreeBatch.from_packed(block, [1, 1, 1])
    for j, r in enumerate(rows):
        for f in TreeBatch._FIELDS:
            got, want = getattr(back, f)[r], getattr(sel, f)[j]
            assert torch.equal(got[:M], want), (f, r)
            pad = float("-inf") if f == "logw" else -1
            assert (got[M:] == pad).all(), (f, r)
    for r in set(range(3)) - set(rows):
        assert (back.tokens[r] == -1).all() and (back.parent[r] == -1).all() and (back.logw[r] == float("-inf")).all()


def test_trees_in_place_that_do_not_fit_are_refused(region):
    tb = trees()
    with pytest.raises(ValueError, match="does not fit at offset 0 of the response region"):
        trees_in_place(tb, ["a", "b", "c"], 1, [0, 1, 2], 3, 65, RegionArena(region))  # 4680 bytes > 4096
    arena = RegionArena(region)
    arena.place(torch.zeros(4))
    with pytest.raises(ValueError, match="does not fit at offset 0"):  # the block's place is taken
        trees_in_place(tb, ["a", "b", "c"], 1, [0, 1, 2], 3, tb.tokens.shape[1], arena)


def test_trees_in_a_region_in_another_layout(region):
    """A peer may place the fields anywhere in the region (here one by one, in reverse order, and one inline):
    the decoder reads them where the message says, not where `trees_to_pb` would have put them."""
    tb = trees()
    arena = RegionArena(region)
    msg = trees_to_pb(tb, ["a", "b", "c"], 2)
    for f in reversed(TreeBatch._FIELDS[1:]):
        tensor_to_pb(getattr(tb, f), getattr(msg, f), arena)
    assert msg.logw.WhichOneof("storage") == "region" and msg.tokens.WhichOneof("storage") == "data"
    ids, back = trees_from_pb(msg, {7: region})
    for f in TreeBatch._FIELDS:
        assert torch.equal(getattr(back, f), getattr(tb, f)), f


@pytest.mark.parametrize("mutate, words", [
    (lambda m: m.ClearField("logw"), "logw is missing"),
    (lambda m: tensor_to_pb(torch.zeros(3, 17, dtype=torch.int64), m.tokens), "dtype"),
    (lambda m: tensor_to_pb(torch.zeros(2, 17, dtype=torch.int32), m.parent), "shape"),
    (lambda m: tensor_to_pb(torch.zeros(3, 16, dtype=torch.int32), m.depth), "M = 17"),
    (lambda m: m.n_nodes.append(1), "n_nodes"),
    (lambda m: m.session_ids.__setitem__(2, "a"), "duplicate"),
    (lambda m: setattr(m.logw, "data", m.logw.data[:-4]), "bytes for shape"),
])
@pytest.mark.parametrize("packed", [False, True])
def test_malformed_tree_batches_are_refused(mutate, words, packed):
    """Also from one packed buffer (the graphed drafter's, and a GPU drafter's host copy): the fast decoder
    declines what does not add up and the general one names the problem."""
    tb = trees()
    msg = trees_to_pb(TreeBatch.from_packed(tb.pack().clone(), tb.n_nodes) if packed else tb, ["a", "b", "c"], 1)
    mutate(msg)
    with pytest.raises(WireError, match=words):
        trees_from_pb(msg)
    if words in ("n_nodes", "duplicate"):  # the ids: the numpy decoder refuses them itself
        with pytest.raises(WireError, match=words):
            inline_trees(msg)
    else:  # any other fault: declined, for the general decoder to name
        assert inline_trees(msg) is None


@pytest.mark.parametrize("through_region", [False, True])
def test_trees_encode_into_the_response_they_travel_in(region, through_region):
    """`out`: the response's own (empty) trees are filled, the same message as encoding apart and wrapping a copy."""
    tb = trees()
    packed = TreeBatch.from_packed(tb.pack().clone(), tb.n_nodes)
    resp = drafter_pb2.DraftStreamResponse()
    got = trees_to_pb(packed, ["a", "b", "c"], 5, RegionArena(region) if through_region else None, out=resp.trees)
    assert got is resp.trees and resp.WhichOneof("kind") == "trees"
    apart = trees_to_pb(packed, ["a", "b", "c"], 5, RegionArena(region) if through_region else None)
    assert resp == drafter_pb2.DraftStreamResponse(trees=apart)
    into = drafter_pb2.DraftStreamResponse()
    trees_in_place(packed, ["a", "b", "c"], 6, [0, 1, 2], 3, packed.tokens.shape[1], RegionArena(region),
                   out=into.trees)
    assert into.trees.in_place and list(into.trees.session_ids) == ["a", "b", "c"] and into.trees.step_id == 6


@pytest.mark.parametrize("packed", [False, True])
def test_inline_trees_decode_the_bytes_answer_with_numpy(region, packed):
    """The gRPC landing's decoder: the same [6, R, M] block as trees_from_pb's, from six separate tensors or one
    packed buffer; a region answer is left to trees_from_pb."""
    tb = trees()
    msg = trees_to_pb(TreeBatch.from_packed(tb.pack().clone(), tb.n_nodes) if packed else tb, ["a", "b", "c"], 1)
    ids, n_nodes, block = inline_trees(msg)
    assert ids == ["a", "b", "c"] and n_nodes == tb.n_nodes and block.dtype == np.int32
    assert (block == tb.pack().numpy()).all() and block.shape == (6, 3, tb.tokens.shape[1])
    assert inline_trees(trees_to_pb(tb, ["a", "b", "c"], 1, RegionArena(region))) is None


def test_decode_params_unset_vs_zero():
    d = params_from_pb(verifier_pb2.DecodeParams(), default_eos=(7,))
    assert d == DecodeParams(eos_ids=(7,))  # unset -> the engine's defaults (budget 16, greedy)
    d = params_from_pb(verifier_pb2.DecodeParams(budget=0, temperature=0.0, eos_token_ids=[3]), default_eos=(7,))
    assert d.budget == 0 and d.sampling.greedy and d.eos_ids == (3,)
    p = DecodeParams(max_new_tokens=5, budget=3, topk=2, eos_ids=(1, 2), ignore_eos=True,
                     sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=11))
    assert params_from_pb(params_to_pb(p), default_eos=()) == p
    with pytest.raises(ValueError, match="budget"):
        params_from_pb(verifier_pb2.DecodeParams(budget=65), default_eos=())
    with pytest.raises(ValueError, match="top_p"):
        params_from_pb(verifier_pb2.DecodeParams(top_p=0.0), default_eos=())
