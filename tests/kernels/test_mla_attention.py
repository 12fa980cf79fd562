"""Absorbed MLA attention kernel (kernels/mla_attention.py) against `mla_attention_ref`.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small shapes (4 heads, latent 32 + rope 8) in
fp32/fp16: prefix 0, ragged and multi-chunk prefixes, trees of 1 and 65 nodes, causal prefill,
pages shuffled in the pool and every unused slot NaN; both chunk rules with small chunk knobs at
prefixes on and off chunk multiples; partials in the output's dtype (fragment order); the fold (one program per
query tile) bitwise equal to the split launch + combine. Position alignment (exact equality): every tree node's row
equals the causal decode, the 1-node-tree AR step and the causal prefill row at its position in a
cache holding the AR layout (prefix + its ancestors + itself). The chunk rules themselves (pure
Python, the kernel's own `chunk_span` on host ints): no empty or short chunk, grid bound.
GPU (marked `gpu`): 64 heads, 512 + 64, bf16, prefixes up to 33k, partials in fp32 and bf16, batch invariance (a
session alone vs inside a batch of 64: bitwise equal) and the same position alignment in bf16, for every tile
kernel (`impl` "triton" and the sm_90 Gluon kernels "gluon", "gluon_ws" and "gluon_seesaw"), the persistent
form of "gluon" bitwise against its grid, and the fold (Triton and gluon) bitwise against the split launch. The
Gluon kernels' compiled code (PTX, ptxas) is checked on the CPU in test_mla_gluon_compile.py; the persistent
kernel's scheduling and the seesaw kernel's arithmetic are replayed on the CPU in test_mla_persistent_schedule.py and
test_mla_seesaw_math.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels.mla_attention import (
    _C_MIN,
    _NCH,
    CHUNK_RULES,
    DEFAULT_BLOCK_N,
    chunk_spans,
    max_chunks,
    mla_attention,
    mla_attention_ref,
    mla_attention_triton,
    session_slots,
)
from kernels.tree_mask import ancestor_mask, pack_mask_bits
from tests.kernels.compare import assert_close

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # ||out - ref|| / ||ref||
SCALE_CPU = 0.05
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def random_tree_bits(n: int, g: torch.Generator) -> torch.Tensor:
    """[n, W] int64 ancestor bits of a random tree (parents precede children), W = 1 or 2."""
    parent = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    bits = pack_mask_bits(ancestor_mask(parent[None])[0])
    return bits if bits.shape[1] == 2 else torch.cat([bits, torch.zeros_like(bits)], 1)


def make_batch(prefix, ns, H, Dl, Dr, page, dtype, tree, seed=0, device=DEV):
    """Paged pool with shuffled pages; every slot no session owns is NaN."""
    g = torch.Generator().manual_seed(seed)
    S = len(prefix)
    lens = [p + n for p, n in zip(prefix, ns)]
    P = max(1, max(-(-ln // page) for ln in lens)) + 1  # one spare page per row of the table
    pages = S * P + 2
    bt = torch.randperm(pages, generator=g)[: S * P].view(S, P).int()
    kv = torch.full((pages * page, Dl + Dr), float("nan"))
    for s in range(S):
        idx = torch.arange(lens[s])
        kv[bt[s, idx // page].long() * page + idx % page] = torch.randn(lens[s], Dl + Dr, generator=g)
    T = sum(ns)
    cu = torch.tensor([0] + torch.tensor(ns).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(T, H, Dl, generator=g)
    qpe = torch.randn(T, H, Dr, generator=g)
    bits = None
    if tree:
        bits = torch.cat([random_tree_bits(n, g) for n in ns if n > 0]) if T else torch.zeros(0, 2, dtype=torch.int64)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), qpe.to(dtype=dtype, **to), kv.to(dtype=dtype, **to), bt.to(**to), page,
            cu.to(**to), torch.tensor(prefix, dtype=torch.int32, device=device),
            None if bits is None else bits.to(**to))


def run_kernel(args, scale, **kw):
    out = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
    mla_attention_triton(*args, scale, out=out, **kw)
    return out


def reference(args, scale):
    q, qpe, kv, *rest = args
    return mla_attention_ref(q.float(), qpe.float(), kv.float(), *rest, scale)


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


def rows_by_chunks(prefix, ns, tree_bits, **knobs) -> torch.Tensor:
    """bool [T]: which query rows have more than one KV chunk (their partials go through memory)."""
    many = []
    for L, n in zip(prefix, ns):
        for j in range(n):
            row = len(many)
            depth = j if tree_bits is None else sum(bin(int(w) % 2**64).count("1") for w in tree_bits[row]) - 1
            many.append(len(chunk_spans(L + depth, **knobs)) > 1)
    return torch.tensor(many, dtype=torch.bool)


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
    sm_90 GPU; here they are replaced by recorders and the launcher is told Gluon can run): the grid kernel by
    default, the persistent one on min(items, SMs) programs when asked for and the query tile goes by TMA (the grid
    kernel otherwise), the seesaw one for impl="gluon_seesaw"; the combine after each."""
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
    if CUDA:
        return
    args = make_batch([70], [5], 4, 32, 8, 16, torch.float32, True)
    mla.configure("triton", "cpu", 4, 32, 8, torch.float32)
    assert torch.equal(run_kernel(args, 0.3), run_kernel(args, 0.3, impl="triton"))  # impl=None reads it


# ------------------------------------------- position alignment: tree node == AR step at its position


def deep_tree_bits(n: int, words: int, g: torch.Generator) -> torch.Tensor:
    """[n, words] int64 ancestor bits of a random tree with long chains (parent among the 3 latest nodes)."""
    parent = torch.tensor([-1] + [max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=g))) for i in range(1, n)])
    bits = pack_mask_bits(ancestor_mask(parent[None])[0])
    return torch.cat([bits, torch.zeros(n, words - bits.shape[1], dtype=torch.int64)], 1)


def ancestors(bits_row: list[int]) -> list[int]:
    """Node indices whose bit is set, in index order = depth order (parents precede children)."""
    return [k for k in range(64 * len(bits_row)) if (bits_row[k // 64] >> (k % 64)) & 1]


def paged(rows: torch.Tensor, page: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [R, D] -> (pool holding them at shuffled pages, NaN elsewhere; block table [1, P] int32)."""
    P = -(-rows.shape[0] // page) + 1
    bt = torch.randperm(P + 1, generator=g)[:P]
    kv = torch.full(((P + 1) * page, rows.shape[1]), float("nan"), dtype=rows.dtype, device=rows.device)
    idx = torch.arange(rows.shape[0])
    kv[(bt[idx // page] * page + idx % page).to(rows.device)] = rows
    return kv, bt[None].int().to(rows.device)


def assert_bitwise(out: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(out, want):
        diff = (out.double() - want.double()).abs().nan_to_num(float("inf"))
        i = tuple(int(v) for v in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{what}: not bitwise equal ({int((diff > 0).sum())} elements differ); worst at {i}: "
                             f"{float(out[i]):.9g} vs {float(want[i]):.9g}")


def check_alignment(prefix, ns, checked, H, Dl, Dr, page, dtype, words, scale, nodes=None, **kw):
    """Tree verify of several sessions; each node of the sessions in `checked` (optionally only
    `nodes`) must give, bit for bit, the row computed in a cache holding the AR layout (committed
    rows, the node's ancestors at L..L+d-1, itself at L+d; on other pages) by a causal decode at
    L+d and by the 1-node tree the engine's AR step sends; and each leaf's whole path the rows of a
    causal chain prefill from L (the prefill rows of the AR layout)."""
    g = torch.Generator().manual_seed(sum(prefix) + words)
    args = make_batch(prefix, ns, H, Dl, Dr, page, dtype, True, seed=len(ns) + words)
    bits = torch.cat([deep_tree_bits(n, words, g) for n in ns]).to(DEV)
    args = (*args[:7], bits)
    q, qpe, kv, bt, _, cu, _, _ = args
    out = run_kernel(args, scale, **kw)
    host_bits = bits.tolist()
    i32 = dict(dtype=torch.int32, device=DEV)
    root = torch.zeros(1, words, dtype=torch.int64, device=DEV)
    root[0, 0] = 1
    for s in checked:
        L, t0, n = prefix[s], int(cu[s]), ns[s]
        rows = kv[session_slots(bt, page, s, L + n)]  # [L + n, Dl + Dr] session s in logical order
        paths = {i: ancestors(host_bits[t0 + i]) for i in (nodes or range(n))}
        inner = {a for path in paths.values() for a in path[:-1]}
        for i, path in paths.items():
            d, t = len(path) - 1, t0 + i
            kv_ar, bt_ar = paged(torch.cat([rows[:L], rows[L + torch.tensor(path, device=DEV)]]), page, g)
            for name, tb in (("causal decode", None), ("AR step (1-node tree)", root)):
                one = (q[t : t + 1], qpe[t : t + 1], kv_ar, bt_ar, page, torch.tensor([0, 1], **i32),
                       torch.tensor([L + d], **i32), tb)
                assert_bitwise(run_kernel(one, scale, **kw)[0], out[t], f"session {s} node {i} depth {d}: {name}")
            if i not in inner:  # a leaf of the checked set: its chain covers its ancestors
                idx = t0 + torch.tensor(path, device=DEV)
                chain = (q[idx], qpe[idx], kv_ar, bt_ar, page, torch.tensor([0, d + 1], **i32),
                         torch.tensor([L], **i32), None)
                assert_bitwise(run_kernel(chain, scale, **kw), out[idx], f"session {s} path to {i}: causal prefill")


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


# ------------------------------------------- the chunk rules (pure Python: the kernel's chunk_span on ints)

KNOBS = [  # block_n, nch, c_min
    (DEFAULT_BLOCK_N, _NCH, _C_MIN), (16, 4, 32), (16, 4, 16), (16, 8, 64), (64, 16, 64), (32, 3, 96)]


def chunk_lengths(p: int, rule: str, block_n: int, nch: int, c_min: int) -> list[int]:
    """Key counts of the chunks of position p; checks they tile 0..p in order at tile boundaries."""
    spans = chunk_spans(p, rule, block_n, nch, c_min)
    assert 1 <= len(spans) <= nch, (p, spans)
    assert spans[0][0] == 0 and spans[-1][1] == p + 1, (p, spans)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (p, spans)
    assert all(s % block_n == 0 and e > s for s, e in spans), f"p={p}: unaligned or empty chunk in {spans}"
    return [e - s for s, e in spans]


@pytest.mark.parametrize("chunk_rule", RULES)
@pytest.mark.parametrize("block_n,nch,c_min", KNOBS)
def test_chunk_rule_properties(block_n, nch, c_min, chunk_rule):
    """For every position up to past the cap (and a sample far beyond): chunks cover 0..p in order,
    start at tile boundaries, none is empty, at most NCH of them, and `max_chunks(cap)` (the
    launcher's grid) covers every position < cap. Balanced: the chunk count is round(K / C_MIN)
    clamped to [1, NCH] and never decreases; chunks are floor or ceil of tiles / nc tiles with the
    ceil last, so the last chunk is never short; a row with several chunks has none below C_MIN / 2.
    The spans depend on p and the fixed knobs alone: `chunk_spans` gets nothing else."""
    top = 2 * nch * c_min + 3 * block_n
    positions = list(range(top)) + list(range(top, 64 * nch * c_min, 997)) + [2**20 - 1, 2**24 + 7]
    seen = 0  # largest chunk count so far
    for p in positions:
        K = p + 1
        lens = chunk_lengths(p, chunk_rule, block_n, nch, c_min)
        nc = len(lens)
        seen = max(seen, nc)
        assert max_chunks(K, chunk_rule, block_n, nch, c_min) >= seen, f"grid of cap {K} misses a chunk"
        if chunk_rule != "balanced":
            continue
        assert nc == max(1, min(nch, (2 * K + c_min) // (2 * c_min))), (p, nc)  # round half up
        assert nc == seen, f"p={p}: chunk count went down"
        assert max_chunks(K, chunk_rule, block_n, nch, c_min) == nc
        tiles = -(-K // block_n)
        counts = [-(-n // block_n) for n in lens]
        assert set(counts) <= {tiles // nc, -(-tiles // nc)} and counts[-1] == -(-tiles // nc), (p, lens)
        assert lens[-1] > max(lens) - block_n, f"p={p}: short last chunk {lens}"
        assert nc == 1 or min(lens) >= c_min // 2, f"p={p}: short chunk {lens}"


def test_chunk_rule_examples():
    """The default knobs at the benchmark's prefixes: legacy's one-key last chunks are gone, and with
    32-key tiles the chunk count never exceeds legacy's (never more partials). With 64-key tiles (the
    default) legacy rounds its chunk size up to 576 keys above 8192 keys and can have one chunk fewer."""
    b32 = dict(block_n=32)
    assert chunk_spans(1024, "legacy", **b32) == [(0, 512), (512, 1024), (1024, 1025)]
    assert chunk_spans(1024, **b32) == [(0, 512), (512, 1025)]
    assert [e - s for s, e in chunk_spans(4096 + 10, **b32)] == [512] * 7 + [523]
    assert len(chunk_spans(4096 + 10, "legacy", **b32)) == 9
    assert chunk_spans(8192, "legacy", **b32)[-1] == (8160, 8193)  # C = 544: a 33-key 16th chunk
    assert chunk_spans(8192, **b32)[-1] == (7680, 8193)
    assert [e - s for s, e in chunk_spans(32768 + 20, **b32)] == [2048] * 15 + [2069]
    assert len(chunk_spans(766, **b32)) == 1 and len(chunk_spans(767, **b32)) == 2  # 1.5 C_MIN: rounds up
    for p in range(0, 40000, 7):
        assert len(chunk_spans(p, **b32)) <= len(chunk_spans(p, "legacy", **b32)), p
    assert DEFAULT_BLOCK_N == 64
    assert chunk_spans(1024) == [(0, 512), (512, 1025)]
    assert [e - s for s, e in chunk_spans(4096 + 10)] == [512] * 7 + [523]
    assert chunk_spans(8192, "legacy")[-1] == (8064, 8193) and len(chunk_spans(8192, "legacy")) == 15
    assert chunk_spans(8192)[-1] == (7680, 8193) and len(chunk_spans(8192)) == 16
    assert [e - s for s, e in chunk_spans(32768 + 20)] == [2048] * 15 + [2069]
    assert len(chunk_spans(766)) == 1 and len(chunk_spans(767)) == 2
    with pytest.raises(ValueError):
        chunk_spans(5, "new")


# ---------------------------------------------------------------- GPU: Kimi K2.6 shapes

def assert_graph_replay(args, want: torch.Tensor, **kw) -> None:
    """The launch, compiled outside the capture, captured in a CUDA graph and replayed: `want`, bit for bit."""
    out = torch.full_like(want, float("nan"))
    mla_attention_triton(*args, SCALE, out=out, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_attention_triton(*args, SCALE, out=out, **kw)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, want, f"graph replay {kw}")


KIMI = dict(H=64, Dl=512, Dr=64, page=64)
IMPLS_GPU = ["triton", "gluon", "gluon_ws", "gluon_seesaw"]
SCALE = 192**-0.5 * (0.1 * torch.log(torch.tensor(64.0)).item() + 1) ** 2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS_GPU)
@pytest.mark.parametrize("prefix,ns,tree,page", [
    ([1024, 0, 4097, 33000], [9, 65, 1, 33], True, 64),
    ([0, 300], [257, 64], False, 64),
    ([70, 2047, 5000], [2, 65, 17], True, 16),  # the serving page size: a 64-key tile spans 4 pages
    ([13, 1500], [90, 31], False, 16),
])
def test_mla_kimi_shapes_bf16(prefix, ns, tree, page, impl):
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree)
    assert_close(run_kernel(args, SCALE, impl=impl), reference(args, SCALE), TOL[torch.bfloat16],
                 f"Kimi {prefix} {ns} {impl}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("tree,prefix,ns", [
    # prefixes on, just below and just past tile and page edges; a tree whose first ancestor tile is ragged; 16
    # chunks past 8192 keys; prefix 0 (no whole committed tile: every tile by cp.async)
    (True, [0, 63, 64, 65, 1000, 4097, 33000], [9, 65, 1, 33, 17, 5, 40]),
    (False, [0, 127, 2048, 9001], [70, 3, 64, 1]),
])
def test_mla_gluon_tma_loads_give_the_cp_async_bits(tree, prefix, ns, page):
    """The Gluon kernel with whole committed tiles loaded by TMA (pages of 16 and 32 rows: a tile is 4 or 2 boxes,
    one per page; 64 and 128: a tile is a page or half of one) equals, bit for bit, the same kernel gathering every
    tile with cp.async, and the reference within tolerance; the pool is a layer of a stacked cache (an offset
    view), unused slots NaN."""
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=7)
    q, qpe, kv, *rest = args
    stack = torch.full((3, *kv.shape), float("nan"), dtype=kv.dtype, device=kv.device)
    stack[1] = kv
    layer = (q, qpe, stack[1], *rest)
    with_tma = run_kernel(layer, SCALE, impl="gluon", tma=True)
    assert_bitwise(with_tma, run_kernel(layer, SCALE, impl="gluon", tma=False), f"tma page {page} tree={tree}")
    assert_close(with_tma, reference(args, SCALE), TOL[torch.bfloat16], f"tma page {page} {prefix} {ns}")
    # queries as views: rows of 1024 (the query tile still by TMA), every other token of a larger batch (a token's
    # heads are not rows of one 2D view: plain loads)
    T, H = q.shape[:2]
    wide = torch.full((T, H, 1024), float("nan"), dtype=q.dtype, device=q.device)
    wide[..., :KIMI["Dl"]] = q
    spread = torch.full((2 * T, H, KIMI["Dr"]), float("nan"), dtype=q.dtype, device=q.device)
    spread[::2] = qpe
    views = (wide[..., :KIMI["Dl"]], spread[::2], stack[1], *rest)
    assert_bitwise(run_kernel(views, SCALE, impl="gluon", tma=True), with_tma, f"query views, page {page}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 1, 5])
@pytest.mark.parametrize("page", [8, 16, 64])
@pytest.mark.parametrize("tree,prefix,ns", [
    # one-tile items next to 16-chunk rows, a session without queries, a row with nothing committed
    (True, [0, 63, 64, 65, 1000, 0, 4097, 9001], [9, 65, 1, 33, 17, 0, 5, 40]),
    (False, [0, 127, 2048, 5], [70, 3, 64, 1]),
    (True, [0], [1]),  # one item in all
])
def test_mla_gluon_persistent_gives_the_grid_kernels_bits(tree, prefix, ns, page, programs, monkeypatch):
    """The persistent kernel (one program per SM walking its items as one stream of tiles; here also 1 and 5
    programs, so a program runs hundreds of items and crosses every kind of item boundary) equals, bit for bit, the
    grid kernel (one program per item) with the same loads, and the reference within tolerance. Page 8: every
    tile by cp.async (only the query tiles by TMA); 16 / 64: the TMA tiles too."""
    import kernels.mla_attention as mla

    if programs is not None:
        monkeypatch.setattr(mla, "_sm_count", lambda index: programs)
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=11)
    out = run_kernel(args, SCALE, impl="gluon", persistent=True)
    assert_bitwise(out, run_kernel(args, SCALE, impl="gluon", persistent=False), f"page {page} tree={tree}")
    assert_close(out, reference(args, SCALE), TOL[torch.bfloat16], f"persistent page {page} {prefix} {ns}")
    # launched twice in a row (the stream leaves no state behind) and from a CUDA graph
    assert_bitwise(run_kernel(args, SCALE, impl="gluon", persistent=True), out, "second launch")
    assert_graph_replay(args, out, impl="gluon", persistent=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS_GPU)
def test_mla_fp16_and_two_head_tiles(impl):
    """fp16 cache and 128 heads (two 64-head tiles per token), tree and causal, against the reference."""
    for tree, prefix, ns in ((True, [700, 9000], [33, 9]), (False, [5, 1200], [40, 3])):
        args = make_batch(prefix, ns, 128, KIMI["Dl"], KIMI["Dr"], 16, torch.float16, tree, seed=3)
        assert_close(run_kernel(args, SCALE, impl=impl), reference(args, SCALE), TOL[torch.float16],
                     f"fp16 128 heads tree={tree} {impl}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS_GPU)
@pytest.mark.parametrize("tree", [True, False])
def test_mla_bf16_partials(tree, impl):
    """partials="out" (bf16 partial O) at Kimi shapes: one-chunk rows keep the fp32-partials bits, the others stay
    within bf16 tolerance of the reference and within 2x the fp32 partials' error (batch invariance and alignment
    with it: the tests below)."""
    prefix, ns = ([5, 700, 4097, 33000], [9, 65, 17, 5]) if tree else ([0, 300, 9001], [257, 64, 3])
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], 16, torch.bfloat16, tree, seed=9)
    want = reference(args, SCALE)
    fp32 = run_kernel(args, SCALE, impl=impl, partials="fp32")
    half = run_kernel(args, SCALE, impl=impl, partials="out")
    many = rows_by_chunks(prefix, ns, None if args[7] is None else args[7].cpu()).to(DEV)
    assert bool(many.any()) and not bool(many.all())
    assert_bitwise(half[~many], fp32[~many], f"one-chunk rows, {impl}")
    assert_close(half, want, TOL[torch.bfloat16], f"bf16 partials {impl} tree={tree}")
    err = lambda out: float((out.double() - want.double()).norm() / want.double().norm())  # noqa: E731
    assert err(half) <= 2.0 * err(fp32), (err(half), err(fp32))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("partials", ["fp32", "out"])
@pytest.mark.parametrize("tree", [True, False])
@pytest.mark.parametrize("impl,page", [("triton", 16), ("gluon", 16), ("gluon", 64), ("gluon", 8)])
def test_mla_fold_gives_the_split_bits_bf16(tree, partials, impl, page):
    """fold=True at Kimi shapes in bf16: bitwise the split launch with its combine kernel (the same exp2 / fma on
    the GPU), 1 to 16 chunks a row (the gluon kernel's stage barriers made anew for each chunk; page 8: every tile
    by cp.async), within tolerance of the reference; a second launch and a CUDA-graph replay give the same."""
    prefix, ns = ([5, 700, 4097, 33000], [9, 65, 17, 5]) if tree else ([0, 300, 9001], [257, 64, 3])
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=13)
    folded = run_kernel(args, SCALE, impl=impl, fold=True, partials=partials)
    assert_bitwise(folded, run_kernel(args, SCALE, impl=impl, fold=False, partials=partials), f"tree={tree}")
    assert_close(folded, reference(args, SCALE), TOL[torch.bfloat16], f"fold tree={tree} {partials}")
    assert_bitwise(run_kernel(args, SCALE, impl=impl, fold=True, partials=partials), folded, "second launch")
    assert_bitwise(run_kernel(args, SCALE, impl=impl, fold="auto", partials=partials), folded, "auto")
    assert_graph_replay(args, folded, impl=impl, fold=True, partials=partials)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS_GPU)
@pytest.mark.parametrize("partials", ["fp32", "out"])
@pytest.mark.parametrize("n_probe", [1, 9, 65])
def test_mla_batch_invariance(n_probe, partials, impl):
    """A session alone and as session 23 of 64 others (mixed lengths): bitwise equal rows (partials in fp32 and
    in bf16)."""
    g = torch.Generator().manual_seed(n_probe)
    prefix = torch.randint(0, 3000, (64,), generator=g).tolist()
    ns = torch.randint(1, 66, (64,), generator=g).tolist()
    prefix[23], ns[23] = 2900, n_probe  # 6 KV chunks
    big = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], KIMI["page"], torch.bfloat16, True)
    q, qpe, kv, bt, page, cu, pre, bits = big
    t0, t1 = int(cu[23]), int(cu[24])
    alone = (q[t0:t1], qpe[t0:t1], kv, bt[23:24], page, torch.tensor([0, t1 - t0], dtype=torch.int32, device=DEV),
             pre[23:24], bits[t0:t1])
    out_big = run_kernel(big, SCALE, impl=impl, partials=partials)
    out_alone = run_kernel(alone, SCALE, impl=impl, partials=partials)
    assert torch.equal(out_alone, out_big[t0:t1])
    # the tree's root alone (= the AR step at the same prefix) gives the root row bit for bit
    root = (q[t0:t0 + 1], qpe[t0:t0 + 1], kv, bt[23:24], page, torch.tensor([0, 1], dtype=torch.int32, device=DEV),
            pre[23:24], bits[t0:t0 + 1])
    assert torch.equal(run_kernel(root, SCALE, impl=impl, partials=partials)[0], out_big[t0])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prefix,ns,checked,words", [
    # 5 -> 6 chunks at p = 2815 inside session 0's tree; session 1: the 16th chunk gains a tile at p = 8192
    ([2810, 8185, 700], [65, 17, 9], [0, 1], 2),
    # one bit word (budgets <= 63); session 0 crosses p = 8192; session 1: 16 chunks of 64-65 tiles; prefix 0
    ([8180, 33000, 0], [40, 9, 20], [0, 1, 2], 1),
])
@pytest.mark.parametrize("impl,partials", [(impl, "fp32") for impl in IMPLS_GPU] + [("gluon", "out")])
def test_mla_tree_node_equals_ar_step_bitwise_bf16(prefix, ns, checked, words, impl, partials):
    """The position-alignment invariant at Kimi shapes in bf16: every node of the checked sessions
    equals the causal decode / AR step / prefill row at its position in the AR layout, bitwise."""
    check_alignment(prefix, ns, checked, KIMI["H"], KIMI["Dl"], KIMI["Dr"], KIMI["page"], torch.bfloat16, words,
                    SCALE, impl=impl, partials=partials)
