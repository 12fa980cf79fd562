"""Absorbed MLA attention kernel (kernels/mla_attention.py) against `mla_attention_ref`, on the CPU.

The Triton kernels under TRITON_INTERPRET=1 at small shapes (4 heads, latent 32 + rope 8) in fp32/fp16 (bf16 too when
a GPU runs them): prefix 0, ragged and multi-chunk prefixes, trees of 1 and 65 nodes, causal prefill, pages shuffled
in the pool and every unused slot NaN; both chunk rules with small chunk knobs at prefixes on and off chunk
multiples; partials in the output's dtype (fragment order); the fold (one program per query tile) bitwise equal to
the split launch + combine; the launcher's routing to the Gluon kernels (recorded, not run). Position alignment
(exact equality): every tree node's row equals the causal decode, the 1-node-tree AR step and the causal prefill row
at its position in a cache holding the AR layout (prefix + its ancestors + itself).
Elsewhere: the chunk rules in test_mla_chunk_rules.py, Kimi shapes on the GPU in test_mla_attention_gpu.py, the Gluon
kernels' compiled code in test_mla_gluon_compile.py, the persistent kernel's scheduling and the seesaw kernel's
arithmetic replayed on the CPU in test_mla_persistent_schedule.py and test_mla_seesaw_math.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels.mla_attention import _C_MIN, CHUNK_RULES, max_chunks, mla_attention
from tests.kernels.compare import assert_close
from tests.kernels.mla_cases import (
    CUDA,
    DEV,
    TOL,
    assert_bitwise,
    check_alignment,
    make_batch,
    reference,
    rows_by_chunks,
    run_kernel,
)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
SCALE_CPU = 0.05


CASES = [  # prefix lens, new tokens per session, tree?
    ([5], [1], False),  # decode
    ([0], [1], True),  # tree of 1 node, empty prefix
    ([0, 37, 3 * _C_MIN - 100], [3, 1, 5], True),  # prefix 0, ragged, 3 KV chunks
    ([530, 0, 64], [65, 2, 0], True),  # 65-node tree (two bit words, one chunk), a session with no query
    ([0], [70], False),  # causal prefill
    ([129, 3], [33, 4], False),  # chunked prefill after a prefix
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix,ns,tree", CASES)
def test_mla_kernel_vs_reference(prefix, ns, tree, dtype):
    args = make_batch(prefix, ns, 4, 32, 8, 16, dtype, tree, seed=sum(prefix) + len(ns))
    out = run_kernel(args, 0.3)
    assert_close(out, reference(args, 0.3), TOL[dtype], f"prefix={prefix} ns={ns} tree={tree} {dtype}")


RULES = sorted(CHUNK_RULES)


@pytest.mark.parametrize("chunk_rule", RULES)
@pytest.mark.parametrize("nch,c_min,block_n", [(16, 32, 32), (4, 64, 16)])
def test_mla_chunking_knobs(nch, c_min, block_n, chunk_rule):
    """Many small chunks (16 of 32 rows), block table wider than the prefix, BLOCK_N 16."""
    args = make_batch([512, 300, 0], [2, 9, 4], 4, 32, 8, 16, torch.float32, True, seed=nch)
    out = run_kernel(args, 0.3, nch=nch, c_min=c_min, block_n=block_n, chunk_rule=chunk_rule)
    assert_close(out, reference(args, 0.3), TOL[torch.float32], f"nch={nch} c_min={c_min} {chunk_rule}")


@pytest.mark.parametrize("chunk_rule", RULES)
@pytest.mark.parametrize("tree", [True, False])
def test_mla_chunk_rules_awkward_prefixes(chunk_rule, tree):
    """Chunk base 32, at most 4 chunks, 16-key tiles: prefixes on multiples of the base and of the
    capped length (legacy's one-key last chunks), between them and past the cap, fp16."""
    kw = dict(nch=4, c_min=32, block_n=16, chunk_rule=chunk_rule)
    prefix, ns = [64, 95, 128, 161, 7], [6, 3, 9, 1, 2]
    args = make_batch(prefix, ns, 4, 32, 8, 8, torch.float16, tree, seed=5 + tree)
    assert_close(run_kernel(args, 0.3, **kw), reference(args, 0.3), TOL[torch.float16], f"{kw} tree={tree}")



def test_fragment_order_is_the_gluon_stores_reshape():
    """`_fragment_col` (where the Triton kernel stores a 16-bit partial's column and the combine reads it) is the
    reshape [16 g + 8 jb + 2 q + e] -> [g, jb, q, e] -> [g, q, jb, e] that `_mla_gluon._store_partial` applies to
    the tensor before storing it in order, and a permutation of every 16-column group."""
    from kernels._mla_kernels import _fragment_col

    for cols in (16, 256, 512):
        c = torch.arange(cols)
        stored = c.view(cols // 16, 2, 4, 2).permute(0, 2, 1, 3).reshape(cols)  # what sits at each stored position
        where = torch.tensor([_fragment_col.fn(int(i)) for i in c])
        assert torch.equal(stored[where], c), cols
        assert torch.equal(where // 16, c // 16)


@pytest.mark.parametrize("tree", [True, False])
def test_mla_partials_in_the_output_dtype(tree):
    """partials="out" (fp16 here; bf16 on the GPU): each chunk's partial O rounded to the output's dtype. Rows of
    one chunk never write partials, so they keep their bits; rows of several chunks change bits but stay within the
    output dtype's tolerance of the reference, and within ~2x the error the fp32 partials make; with an fp32
    output the option is the fp32 path, bit for bit."""
    kw = dict(nch=8, c_min=32, block_n=16)
    prefix, ns = [3, 200, 41, 500], [5, 9, 1, 17]
    args = make_batch(prefix, ns, 4, 32, 8, 16, torch.float16, tree, seed=21 + tree)
    want = reference(args, 0.3)
    fp32 = run_kernel(args, 0.3, partials="fp32", **kw)
    half = run_kernel(args, 0.3, partials="out", **kw)
    many = rows_by_chunks(prefix, ns, args[7], **kw).to(DEV)
    assert bool(many.any()) and not bool(many.all())
    assert_bitwise(half[~many], fp32[~many], "one-chunk rows")
    assert not torch.equal(half[many], fp32[many]), "the partials did not go through fp16"
    assert_close(half, want, TOL[torch.float16], f"tree={tree}")
    err = lambda out: float((out.double() - want.double()).norm() / want.double().norm())  # noqa: E731
    assert err(half) <= 2.0 * err(fp32) + 2e-4, (err(half), err(fp32))
    args32 = make_batch(prefix, ns, 4, 32, 8, 16, torch.float32, tree, seed=21 + tree)
    assert_bitwise(run_kernel(args32, 0.3, partials="out", **kw), run_kernel(args32, 0.3, **kw), "fp32 output")
    with pytest.raises(ValueError, match="partials"):
        run_kernel(args, 0.3, partials="bf16")


@pytest.mark.parametrize("dtype,partials", [(torch.float32, "fp32"), (torch.float16, "fp32"), (torch.float16, "out")])
@pytest.mark.parametrize("chunk_rule", RULES)
@pytest.mark.parametrize("tree", [True, False])
def test_mla_fold_gives_the_split_bits(tree, chunk_rule, dtype, partials):
    """fold=True (one program per query tile folding its chunks' partials in order, as the combine kernel does)
    equals the split launch (one program per chunk, partials through memory, the combine kernel) bit for bit:
    rows of 1 to 8 chunks, ragged chunk ends, trees reaching across chunk edges, both partial dtypes."""
    kw = dict(nch=8, c_min=32, block_n=16, chunk_rule=chunk_rule, partials=partials)
    prefix, ns = [0, 37, 200, 95, 500], [3, 9, 1, 17, 5]
    args = make_batch(prefix, ns, 4, 32, 8, 16, dtype, tree, seed=31 + tree)
    many = rows_by_chunks(prefix, ns, args[7], **{k: kw[k] for k in ("nch", "c_min", "block_n", "chunk_rule")})
    assert bool(many.any()) and not bool(many.all())
    folded = run_kernel(args, 0.3, fold=True, **kw)
    assert_bitwise(folded, run_kernel(args, 0.3, fold=False, **kw), f"tree={tree} {chunk_rule} {dtype} {partials}")
    assert_close(folded, reference(args, 0.3), TOL[dtype], "fold vs reference")


def test_mla_odd_heads_and_pages():
    """3 heads (tiles span tokens unevenly), latent 48 + rope 16 (padded to 64 / 16), page size 1."""
    args = make_batch([40, 9], [7, 20], 3, 48, 16, 1, torch.float32, True, seed=11)
    assert_close(run_kernel(args, 0.2), reference(args, 0.2), TOL[torch.float32], "odd shapes")


def test_mla_launcher_dispatch():
    args = make_batch([20], [3], 4, 32, 8, 16, torch.float32, True)
    assert_close(mla_attention(*args, 0.3), reference(args, 0.3), TOL[torch.float32], "launcher")
    with pytest.raises(ValueError):
        mla_attention(args[0][:, :2], *args[1:], 0.3)


@pytest.mark.skipif(CUDA, reason="the CPU side of the dispatch")
def test_mla_impl_choice_off_hopper():
    """impl="gluon" where it cannot run is refused with the reason; "auto" falls back to the Triton
    kernel (same bits); an unknown impl is refused."""
    args = make_batch([70], [5], 4, 32, 8, 16, torch.float32, True)
    for impl in ("gluon", "gluon_ws", "gluon_seesaw"):
        with pytest.raises(ValueError, match=f"{impl}.*(sm_90|Gluon)"):
            run_kernel(args, 0.3, impl=impl)
    with pytest.raises(ValueError, match="impl"):
        run_kernel(args, 0.3, impl="cuda")
    assert torch.equal(run_kernel(args, 0.3, impl="auto"), run_kernel(args, 0.3, impl="triton"))


def test_mla_launcher_routes_the_gluon_kernels(monkeypatch):
    """Which Gluon kernel a launch runs, on which grid, with which TMA constexprs (the kernels themselves need an
    sm_90 GPU; here they are replaced by recorders and the launcher is told Gluon can run): for impl="gluon" the grid
    kernel by default, the persistent one on min(items, SMs) programs when asked for and the query tile goes by TMA
    (the grid kernel otherwise), the seesaw one for impl="gluon_seesaw" and for "auto" (the default; the grid kernel
    when the launch asks for the fold, which only it has), its persistent form on min(items, SMs) programs when asked
    for with the query tile by TMA; the combine after each."""
    from kernels import mla_attention as mla

    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((self.name, grid, len(a), kw))

    monkeypatch.setattr(mla, "gluon_unsupported", lambda *a: None)
    monkeypatch.setattr(mla, "_sm_count", lambda index: 7)
    monkeypatch.setattr(mla._mla_gluon, "_mla_fwd_gluon_kernel", Recorder("grid"))
    monkeypatch.setattr(mla._mla_gluon_persistent, "_mla_fwd_gluon_persistent_kernel", Recorder("persistent"))
    monkeypatch.setattr(mla._mla_gluon_seesaw, "_mla_fwd_gluon_seesaw_kernel", Recorder("seesaw"))
    monkeypatch.setattr(mla._mla_gluon_seesaw_persistent, "_mla_fwd_gluon_seesaw_persistent_kernel",
                        Recorder("seesaw_persistent"))
    monkeypatch.setattr(mla, "_mla_combine_kernel", Recorder("combine"))
    # Kimi head shapes (the descriptors are host objects), page 16: TMA boxes of one page; 2 sessions, 3 tokens
    args = make_batch([1500, 40], [2, 1], 64, 512, 64, 16, torch.float16, True, device="cpu")
    tiles, grid_c = 3, max_chunks(args[3].shape[1] * 16)

    def launch(*a, **kw):
        calls.clear()
        mla.mla_attention_triton(*a, SCALE_CPU, out=torch.empty_like(a[0]), **kw)
        return [(n, g, kw_.get("QTMA"), kw_.get("BOX"), kw_.get("STAGES"), kw_.get("num_warps")) for n, g, _, kw_
                in calls if n != "combine"], [n for n, *_ in calls]

    assert launch(*args, impl="gluon") == ([("grid", (tiles, grid_c), True, 16, 2, 8)], ["grid", "combine"])
    assert launch(*args, impl="gluon", tma=False)[0] == [("grid", (tiles, grid_c), False, 0, 2, 8)]
    assert launch(*args, impl="gluon", persistent=True)[0] == [("persistent", (7,), None, 16, 2, 8)]
    assert calls[0][2] == 11 + 4 + 5 + 9 + 2  # pointers, descriptors, scalars, strides, then TILES and NPROG
    # no query TMA (tma off): the persistent kernel cannot run, the grid kernel does
    assert launch(*args, impl="gluon", persistent=True, tma=False)[0] == [("grid", (tiles, grid_c), False, 0, 2, 8)]
    assert launch(*args, impl="gluon_seesaw") == ([("seesaw", (tiles, grid_c), True, 16, 2, 4)], ["seesaw", "combine"])
    assert launch(*args, impl="gluon_seesaw", tma=False)[0] == [("seesaw", (tiles, grid_c), False, 0, 2, 4)]
    assert launch(*args, impl="gluon_seesaw", persistent=True) == ([("seesaw_persistent", (7,), None, 16, 2, 4)],
                                                                   ["seesaw_persistent", "combine"])
    assert calls[0][2] == 11 + 4 + 5 + 9 + 2  # as the one-warpgroup persistent kernel's
    assert launch(*args, impl="gluon_seesaw", persistent=True, tma=False)[0] == [("seesaw", (tiles, grid_c), False, 0,
                                                                                  2, 4)]
    # the fold: the grid kernel on one program per query tile (FOLD, ROUND as the partials say), no combine; the
    # persistent form does not fold (the grid kernel runs), the seesaw kernel refuses
    assert launch(*args, impl="gluon", fold=True, partials="fp32") == ([("grid", (tiles, 1), True, 16, 2, 8)], ["grid"])
    assert (calls[0][3]["FOLD"], calls[0][3]["ROUND"]) == (True, False)
    launch(*args, impl="gluon", fold=True, partials="out")
    assert calls[0][3]["ROUND"] is True
    assert launch(*args, impl="gluon", fold=True, persistent=True)[0] == [("grid", (tiles, 1), True, 16, 2, 8)]
    with pytest.raises(ValueError, match="fold runs in the Triton and gluon tile kernels"):
        launch(*args, impl="gluon_seesaw", fold=True)
    # "auto": folds from FOLD_MIN_TILES_PER_SM query tiles per SM on (a CUDA tensor only; here the CPU: never)
    assert launch(*args, impl="gluon", fold="auto")[1] == ["grid", "combine"]
    assert launch(*args, impl="gluon_seesaw", fold="auto")[1] == ["seesaw", "combine"]
    with pytest.raises(ValueError, match="fold must be"):
        launch(*args, impl="gluon", fold="yes")
    # "auto" (and the module default, impl=None): the seesaw kernel; the grid kernel for what only it has
    assert mla.DEFAULT_IMPL == "auto"
    for impl in ("auto", None):
        assert launch(*args, impl=impl) == ([("seesaw", (tiles, grid_c), True, 16, 2, 4)], ["seesaw", "combine"])
        assert launch(*args, impl=impl, fold="auto")[1] == ["seesaw", "combine"]
        assert launch(*args, impl=impl, fold=True)[1] == ["grid"]
        assert launch(*args, impl=impl, persistent=True)[0] == [("seesaw_persistent", (7,), None, 16, 2, 4)]
        # without both TMA paths (tma off; a query tile that is not rows of one 2D view): the grid kernel
        assert launch(*args, impl=impl, tma=False)[0] == [("grid", (tiles, grid_c), False, 0, 2, 8)]
        views = (args[0].transpose(0, 1).contiguous().transpose(0, 1), *args[1:])
        assert launch(*views, impl=impl)[0] == [("grid", (tiles, grid_c), False, 16, 2, 8)]
        assert launch(*views, impl="gluon_seesaw")[0] == [("seesaw", (tiles, grid_c), False, 16, 2, 4)]
    page8 = make_batch([1500, 40], [2, 1], 64, 512, 64, 8, torch.float16, True, device="cpu")  # no TMA boxes
    assert launch(*page8)[0] == [("grid", (tiles, max_chunks(page8[3].shape[1] * 8)), True, 0, 2, 8)]
    monkeypatch.setattr(mla._mla_gluon_persistent, "GLUON_PERSISTENT", True)  # the one-warpgroup kernel's default
    assert launch(*args, impl="gluon")[0] == [("persistent", (7,), None, 16, 2, 8)]
    assert launch(*args, impl="auto")[0] == [("seesaw", (tiles, grid_c), True, 16, 2, 4)]
    monkeypatch.setattr(mla._mla_gluon_seesaw_persistent, "SEESAW_PERSISTENT", True)
    assert launch(*args, impl="auto")[0] == [("seesaw_persistent", (7,), None, 16, 2, 4)]
    assert launch(*page8)[0] == [("persistent", (7,), None, 0, 2, 8)]  # (no TMA boxes: the one-warpgroup kernel's)


def test_mla_launcher_splits_the_seesaw_kernels_value_columns_when_asked(monkeypatch):
    """`vsplit`: the seesaw grid kernel on a third grid axis of 2 or 4 programs (VSPLIT), "auto" the largest of 4 and
    2 whose grid fits one program per SM, else 1 (a 2D grid, as without the knob); refused with the reason for a
    value it does not know and where the seesaw grid kernel does not run (another impl, its persistent form, or
    "auto"'s fallback without both TMA paths)."""
    from kernels import mla_attention as mla

    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((self.name, grid, kw.get("VSPLIT")))

    sms = [7]
    monkeypatch.setattr(mla, "gluon_unsupported", lambda *a: None)
    monkeypatch.setattr(mla, "_sm_count", lambda index: sms[0])
    monkeypatch.setattr(mla._mla_gluon_seesaw, "_mla_fwd_gluon_seesaw_kernel", Recorder("seesaw"))
    monkeypatch.setattr(mla._mla_gluon, "_mla_fwd_gluon_kernel", Recorder("grid"))
    monkeypatch.setattr(mla, "_mla_combine_kernel", Recorder("combine"))
    args = make_batch([1500, 40], [2, 1], 64, 512, 64, 16, torch.float16, True, device="cpu")
    tiles, grid_c = 3, max_chunks(args[3].shape[1] * 16)
    items = tiles * grid_c

    def launch(*a, **kw):
        calls.clear()
        mla.mla_attention_triton(*a, SCALE_CPU, out=torch.empty_like(a[0]), **kw)
        return [c for c in calls if c[0] != "combine"]

    assert launch(*args, impl="gluon_seesaw", vsplit=1) == [("seesaw", (tiles, grid_c), 1)]
    assert mla.DEFAULT_VSPLIT == "auto" and launch(*args, impl="gluon_seesaw") == [("seesaw", (tiles, grid_c), 1)]
    for v in (2, 4):
        assert launch(*args, impl="gluon_seesaw", vsplit=v) == [("seesaw", (tiles, grid_c, v), v)]
    for n_sms, v in ((4 * items, 4), (4 * items - 1, 2), (2 * items, 2), (2 * items - 1, 1)):
        sms[0] = n_sms
        want = (tiles, grid_c) + ((v,) if v > 1 else ())
        assert launch(*args, impl="gluon_seesaw", vsplit="auto") == [("seesaw", want, v)], n_sms
        assert launch(*args, vsplit="auto") == [("seesaw", want, v)], n_sms  # impl "auto" (the default)
    sms[0] = 4 * items
    assert launch(*args, vsplit="auto", tma=False) == [("grid", (tiles, grid_c), None)]  # auto's fallback: 1
    with pytest.raises(ValueError, match="vsplit 3 is not one of"):
        launch(*args, impl="gluon_seesaw", vsplit=3)
    for kw in (dict(impl="triton"), dict(impl="gluon"), dict(impl="gluon_seesaw", persistent=True),
               dict(tma=False)):
        with pytest.raises(ValueError, match="vsplit 2 runs in the seesaw grid kernel only"):
            launch(*args, vsplit=2, **kw)
        assert calls == []  # refused before any launch


def test_mla_launcher_passes_skip_phantom_to_the_seesaw_grid_kernel(monkeypatch):
    """`skip_phantom`: the seesaw grid kernel's SKIP_PHANTOM, the module's DEFAULT_SKIP_PHANTOM when None (read at
    each call), with or without a value split."""
    from kernels import mla_attention as mla

    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, kw.get("SKIP_PHANTOM")))

    monkeypatch.setattr(mla, "gluon_unsupported", lambda *a: None)
    monkeypatch.setattr(mla, "_sm_count", lambda index: 1000)
    monkeypatch.setattr(mla._mla_gluon_seesaw, "_mla_fwd_gluon_seesaw_kernel", Recorder())
    monkeypatch.setattr(mla, "_mla_combine_kernel", {})  # (no call expected: `[grid]` would raise)
    args = make_batch([40], [2], 64, 512, 64, 16, torch.float16, True, device="cpu")  # one chunk a row: no combine

    def launch(**kw):
        calls.clear()
        mla.mla_attention_triton(*args, SCALE_CPU, out=torch.empty_like(args[0]), impl="gluon_seesaw", **kw)
        return [flag for _, flag in calls]

    assert launch() == [mla.DEFAULT_SKIP_PHANTOM]
    assert launch(skip_phantom=False) == [False] and launch(skip_phantom=True, vsplit=2) == [True]
    for default in (False, True):
        monkeypatch.setattr(mla, "DEFAULT_SKIP_PHANTOM", default)
        assert launch() == [default]


def test_mla_configure_fixes_the_deployment_kernel(monkeypatch):
    """`configure` sets DEFAULT_IMPL (read by every later launch) and says what runs: off CUDA the
    reference; "gluon" where it cannot run is refused with the reason; an unknown name is refused."""
    from kernels import mla_attention as mla

    monkeypatch.setattr(mla, "DEFAULT_IMPL", mla.DEFAULT_IMPL)  # restored after the test
    assert mla.configure("triton", "cpu", 64, 512, 64, torch.bfloat16) == "reference"
    assert mla.DEFAULT_IMPL == "triton"
    assert mla.configure("auto", "cpu", 8, 512, 64, torch.float32) == "reference" and mla.DEFAULT_IMPL == "auto"
    for impl in ("gluon", "gluon_ws"):
        with pytest.raises(ValueError, match=f"{impl}.*sm_90"):
            mla.configure(impl, "cpu", 64, 512, 64, torch.bfloat16)
        assert mla.DEFAULT_IMPL == "auto"  # unchanged by the refusal
    with pytest.raises(ValueError, match="one of"):
        mla.configure("flash", "cpu", 64, 512, 64, torch.bfloat16)
    # where Gluon runs (told so here): "auto" runs the seesaw kernel, a named one itself
    monkeypatch.setattr(mla, "_gluon_unsupported_shape", lambda *a: None)
    assert mla.configure("auto", "cuda", 64, 512, 64, torch.bfloat16) == "gluon_seesaw"
    assert mla.configure("gluon", "cuda", 64, 512, 64, torch.bfloat16) == "gluon"
    assert mla.resolved_impl("auto", "cuda", 64, 512, 64, torch.bfloat16, 16) == "gluon_seesaw"
    assert mla.resolved_impl("auto", "cuda", 64, 512, 64, torch.bfloat16, 8) == "gluon"  # no TMA boxes
    assert mla.resolved_impl("gluon_seesaw", "cuda", 64, 512, 64, torch.bfloat16, 8) == "gluon_seesaw"
    if CUDA:
        return
    args = make_batch([70], [5], 4, 32, 8, 16, torch.float32, True)
    mla.configure("triton", "cpu", 4, 32, 8, torch.float32)
    assert torch.equal(run_kernel(args, 0.3), run_kernel(args, 0.3, impl="triton"))  # impl=None reads it


SMALL = dict(nch=4, c_min=32, block_n=16)
ALIGN_CASES = [  # prefix lens, tree sizes, sessions checked, H, Dl, Dr, page, bit words, knobs
    # default knobs; balanced: 1 -> 2 chunks (combine) at p = 767 inside session 0's tree, a one-chunk session
    ([764, 40], [10, 5], [0, 1], 4, 32, 8, 16, 1, {}),
    # p = 120..129; balanced: 4 chunks of 2 tiles, the last one 3 tiles from p = 128; legacy: C 32 -> 48 there
    ([120, 3], [16, 5], [0], 4, 32, 8, 16, 2, SMALL),
    ([0, 45], [14, 9], [0, 1], 3, 48, 16, 3, 1, dict(nch=4, c_min=16, block_n=16)),  # tree at position 0
]


@pytest.mark.parametrize("prefix,ns,checked,H,Dl,Dr,page,words,kw,chunk_rule", [
    (*case, rule) for case in ALIGN_CASES for rule in RULES if case[-1] or rule == "balanced"])  # legacy: small knobs
def test_mla_tree_node_equals_ar_step_bitwise(prefix, ns, checked, H, Dl, Dr, page, words, kw, chunk_rule):
    """fp32 under the interpreter: exact equality (the GPU test below does the same in bf16)."""
    check_alignment(prefix, ns, checked, H, Dl, Dr, page, torch.float32, words, 0.3, chunk_rule=chunk_rule, **kw)


@pytest.mark.parametrize("chunk_rule,partials", [(rule, "fp32") for rule in RULES] + [("balanced", "out")])
def test_mla_alignment_fp16_and_second_bit_word(chunk_rule, partials):
    """fp16; nodes 64.. of a 66-node tree (their paths read the second bit word); paths up to p = 66:
    balanced 1 -> 2 chunks at p = 47, legacy 1 -> 2 -> 3 at p = 32, 64; fp16 partials too."""
    check_alignment([29], [66], [0], 4, 32, 8, 16, torch.float16, 2, 0.3, nodes=[5, 40, 63, 64, 65],
                    chunk_rule=chunk_rule, partials=partials, **SMALL)
