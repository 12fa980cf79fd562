"""Shared inputs and checks of the MLA kernel tests (test_mla_attention.py on the CPU, test_mla_attention_gpu.py at
Kimi shapes): a paged batch with shuffled pages and NaN in every slot no session owns, the poisoned-output launch,
the fp32 reference, which rows span several KV chunks, and the position-alignment check (a tree node's row equals
the AR step's row at its position, bit for bit)."""

from __future__ import annotations

import torch

from kernels.mla_attention import chunk_spans, mla_attention_ref, mla_attention_triton, session_slots
from kernels.tree_mask import ancestor_mask, pack_mask_bits

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # ||out - ref|| / ||ref||

def random_tree_bits(n: int, g: torch.Generator) -> torch.Tensor:
    """[n, W] int64 ancestor bits of a random tree (parents precede children), W = 1 or 2."""
    parent = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    bits = pack_mask_bits(ancestor_mask(parent[None])[0])
    return bits if bits.shape[1] == 2 else torch.cat([bits, torch.zeros_like(bits)], 1)


def make_batch(prefix, ns, H, Dl, Dr, page, dtype, tree, seed=0, device=DEV, table_len=0):
    """Paged pool with shuffled pages; every slot no session owns is NaN. `table_len`: the block table at least that
    many keys wide (a serving pool's rows, whose width sizes a launch's chunk grid)."""
    g = torch.Generator().manual_seed(seed)
    S = len(prefix)
    lens = [p + n for p, n in zip(prefix, ns)]
    P = max(1, max(-(-ln // page) for ln in lens)) + 1  # one spare page per row of the table
    P = max(P, -(-table_len // page))
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


def rows_by_chunks(prefix, ns, tree_bits, **knobs) -> torch.Tensor:
    """bool [T]: which query rows have more than one KV chunk (their partials go through memory)."""
    many = []
    for L, n in zip(prefix, ns):
        for j in range(n):
            row = len(many)
            depth = j if tree_bits is None else sum(bin(int(w) % 2**64).count("1") for w in tree_bits[row]) - 1
            many.append(len(chunk_spans(L + depth, **knobs)) > 1)
    return torch.tensor(many, dtype=torch.bool)

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
