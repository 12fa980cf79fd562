"""Draft-tree checks on the device (DESIGN 3.1): one Triton launch, no host synchronisation.

Owns `CHECKS`, the launcher `check_trees`, its kernel `_tree_check_kernel` and the torch reference
`check_trees_reference`. The rules are those of `verifier_service.tree_validation` (the numpy host path,
whose `check_codes` numbers rows the same way): a verifier can check trees stream-ordered, read the codes
later, and meanwhile verify the sanitized trees, in which a failing row keeps only its root.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# per-node rules in reporting order; a failing row's code is 1 + the index of the first rule any node breaks
CHECKS = ("root_token", "root_node", "root_logw", "parent_order", "depth_step", "max_depth", "vocab",
          "logw_finite", "logw_rises", "dup_sibling", "first_child", "next_sibling", "padding")
MAX_NODES = 256  # the kernel holds [M, M] comparisons of one row in registers
_TREE_FIELDS = ("tokens", "parent", "depth", "first_child", "next_sibling")


def _check_args(tokens: Tensor, parent: Tensor, depth: Tensor, first_child: Tensor, next_sibling: Tensor,
                logw: Tensor, n_nodes: Tensor, roots: Tensor) -> None:
    """Shapes, dtypes and devices only (no device reads)."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [R, M], got {tuple(tokens.shape)}")
    R, M = tokens.shape
    for name, t in zip(_TREE_FIELDS, (tokens, parent, depth, first_child, next_sibling)):
        if t.shape != (R, M) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be [{R}, {M}] int32, got {tuple(t.shape)} {t.dtype}")
    if logw.shape != (R, M) or logw.dtype != torch.float32:
        raise ValueError(f"logw must be [{R}, {M}] float32, got {tuple(logw.shape)} {logw.dtype}")
    for name, t in (("n_nodes", n_nodes), ("roots", roots)):
        if t.shape != (R,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be [{R}] int32 or int64, got {tuple(t.shape)} {t.dtype}")
    devs = {t.device for t in (tokens, parent, depth, first_child, next_sibling, logw, n_nodes, roots)}
    if len(devs) != 1:
        raise ValueError(f"tree tensors are on different devices: {sorted(map(str, devs))}")


def check_trees_reference(tokens: Tensor, parent: Tensor, depth: Tensor, first_child: Tensor,
                          next_sibling: Tensor, logw: Tensor, n_nodes: Tensor, roots: Tensor, vocab_size: int,
                          max_depth: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Plain torch ops, the reference the kernel is tested against; same arguments and results as check_trees."""
    _check_args(tokens, parent, depth, first_child, next_sibling, logw, n_nodes, roots)
    R, M = tokens.shape
    dev = tokens.device
    if M == 0:
        return torch.zeros(R, dtype=torch.int32, device=dev), tokens.clone(), parent.clone(), depth.clone()
    tok, par, dep, fc, ns = (t.long() for t in (tokens, parent, depth, first_child, next_sibling))
    lw = logw  # float32: compared as numpy compares (NaN > x False, NaN != x True)
    idx = torch.arange(M, device=dev)  # [M]
    valid = idx < n_nodes.long().clamp(0, M)[:, None]  # [R, M]
    nonroot = valid & (idx >= 1)
    par_ok = nonroot & (par >= 0) & (par < idx)  # a real edge to an earlier node
    parc = par.clamp(0, M - 1)  # gather index, in bounds for any parent value
    dep_par, lw_par = dep.gather(1, parc), lw.gather(1, parc)
    p = torch.where(par_ok, par, -1)
    same_par = par_ok[:, :, None] & par_ok[:, None, :] & (p[:, :, None] == p[:, None, :])  # [R, i, j]
    child = par_ok[:, None, :] & (p[:, None, :] == idx[None, :, None])  # [R, p, c]: c is a child of p
    first = torch.where(child, idx, M).amin(-1)
    later = same_par & (idx[None, None, :] > idx[None, :, None])  # [R, i, j]: j is a later sibling of i
    nxt = torch.where(later, idx, M).amin(-1)
    exp_fc, exp_ns = torch.where(first == M, -1, first), torch.where(nxt == M, -1, nxt)
    dup_sib = (same_par & (tok[:, :, None] == tok[:, None, :]) & (idx[:, None] != idx[None, :])).any(-1)
    col0 = idx == 0
    bad = [
        col0 & (tok != roots.long()[:, None]),
        col0 & ((par != -1) | (dep != 0)),
        col0 & (lw != 0),
        nonroot & ~par_ok,
        par_ok & (dep != dep_par + 1),
        valid & (dep > max_depth),
        valid & ((tok < 0) | (tok >= vocab_size)),
        valid & ~torch.isfinite(lw),
        par_ok & (lw > lw_par),
        dup_sib & par_ok,
        valid & (fc != exp_fc),
        valid & (ns != exp_ns),
        ~valid & ((tok != -1) | (par != -1) | (dep != -1) | (fc != -1) | (ns != -1) | (lw != float("-inf"))),
    ]
    any_bad = torch.stack([b.any(-1) for b in bad], 1).to(torch.int32)  # [R, C]
    codes = torch.where(any_bad.any(-1), any_bad.argmax(-1) + 1, 0).to(torch.int32)  # argmax: first max
    ok = (codes == 0)[:, None]
    tok_out = torch.where(ok, tokens, torch.where(col0, roots.to(torch.int32)[:, None], -1))
    par_out = torch.where(ok, parent, torch.where(col0, -1, torch.where(valid, 0, -1))).to(torch.int32)
    dep_out = torch.where(ok, depth, torch.where(col0, 0, torch.where(valid, 1, -1))).to(torch.int32)
    return codes, tok_out, par_out, dep_out


@triton.jit(do_not_specialize=["R", "M", "vocab_size", "max_depth"])  # no recompiles as R and M vary
def _tree_check_kernel(trees_ptr, n_ptr, root_ptr, out_ptr, R, M, vocab_size, max_depth, BLOCK: tl.constexpr):
    """One program per tree row: every rule of CHECKS over the row's M <= BLOCK nodes, then the sanitized row.

    trees: [6, R, M] int32 contiguous (tokens, parent, depth, first_child, next_sibling, logw's bits); n, root:
    [R] int64; out: [R] codes then [3, R, M] (tokens, parent, depth), int32. Few arguments on purpose: this
    runs every draft step and Triton's launch cost grows with them. Node vectors are [BLOCK]; the sibling and
    first-child / next-sibling rules compare all node pairs as [BLOCK, BLOCK] (rows i loaded as [BLOCK, 1],
    columns j as [1, BLOCK]). Node values are widened to int64 like numpy's (depth 2^31 - 1 plus one must not
    wrap); the pairwise compares are equality and order only and stay int32. Float compares follow IEEE like
    numpy's (NaN > x is False, NaN != x is True)."""
    r = tl.program_id(0).to(tl.int64)
    neg_inf = float("-inf")
    i = tl.arange(0, BLOCK)  # [BLOCK] node index
    inb = i < M
    field = R * M  # elements per field
    row = trees_ptr + r * M
    tok_ptr, par_ptr, dep_ptr = row, row + field, row + 2 * field
    fc_ptr, ns_ptr, lw_ptr = row + 3 * field, row + 4 * field, row + 5 * field
    n = tl.load(n_ptr + r).to(tl.int64)
    n = tl.minimum(tl.maximum(n, 0), M)  # any count: the checks only look inside the row
    root = tl.load(root_ptr + r).to(tl.int64)
    tok = tl.load(tok_ptr + i, mask=inb, other=-1).to(tl.int64)
    par = tl.load(par_ptr + i, mask=inb, other=-1).to(tl.int64)
    dep = tl.load(dep_ptr + i, mask=inb, other=-1).to(tl.int64)
    fc = tl.load(fc_ptr + i, mask=inb, other=-1).to(tl.int64)
    ns = tl.load(ns_ptr + i, mask=inb, other=-1).to(tl.int64)
    lw = tl.load(lw_ptr + i, mask=inb, other=-8388608).to(tl.float32, bitcast=True)  # -inf's bits as padding
    valid = i < n
    nonroot = valid & (i >= 1)
    par_ok = nonroot & (par >= 0) & (par < i)
    parc = tl.minimum(tl.maximum(par, 0), M - 1)  # gather index, in bounds for any parent value
    dep_par = tl.load(dep_ptr + parc, mask=inb, other=-1).to(tl.int64)
    lw_par = tl.load(lw_ptr + parc, mask=inb, other=-8388608).to(tl.float32, bitcast=True)

    # pairwise rules: node i along axis 0, node j along axis 1 (the row loaded again as [1, BLOCK])
    ii = i[:, None]
    jj = i[None, :]
    # kept in int32 (only compared for equality and order): half the registers of the [BLOCK, BLOCK] work
    par_j = tl.load(par_ptr + jj, mask=jj < M, other=-1)
    tok_j = tl.load(tok_ptr + jj, mask=jj < M, other=-1)
    ok_j = (jj < n) & (jj >= 1) & (par_j >= 0) & (par_j < jj)
    p_j = tl.where(ok_j, par_j, -1)  # [1, BLOCK]
    par_i = tl.load(par_ptr + ii, mask=ii < M, other=-1)
    tok_i = tl.load(tok_ptr + ii, mask=ii < M, other=-1)
    ok_i = (ii < n) & (ii >= 1) & (par_i >= 0) & (par_i < ii)
    same_par = ok_i & ok_j & (par_i == p_j)  # [BLOCK, BLOCK]
    child = ok_j & (p_j == ii)  # [p, c]: c is a child of p
    first = tl.min(tl.where(child, jj, BLOCK), 1)
    exp_fc = tl.where(first == BLOCK, -1, first)
    nxt = tl.min(tl.where(same_par & (jj > ii), jj, BLOCK), 1)
    exp_ns = tl.where(nxt == BLOCK, -1, nxt)
    dup_sib = tl.max((same_par & (tok_i == tok_j) & (ii != jj)).to(tl.int32), 1) > 0

    col0 = i == 0
    # |lw| < inf is False for NaN and both infinities (numpy's isfinite)
    finite = tl.abs(lw) < float("inf")
    pad = (tok != -1) | (par != -1) | (dep != -1) | (fc != -1) | (ns != -1) | (lw != neg_inf)
    # the code of the first failing rule, found by walking CHECKS backwards
    code = tl.full((), 0, tl.int32)
    code = tl.where(tl.max((inb & ~valid & pad).to(tl.int32), 0) > 0, 13, code)
    code = tl.where(tl.max((valid & (ns != exp_ns)).to(tl.int32), 0) > 0, 12, code)
    code = tl.where(tl.max((valid & (fc != exp_fc)).to(tl.int32), 0) > 0, 11, code)
    code = tl.where(tl.max((dup_sib & par_ok).to(tl.int32), 0) > 0, 10, code)
    code = tl.where(tl.max((par_ok & (lw > lw_par)).to(tl.int32), 0) > 0, 9, code)
    code = tl.where(tl.max((valid & ~finite).to(tl.int32), 0) > 0, 8, code)
    code = tl.where(tl.max((valid & ((tok < 0) | (tok >= vocab_size))).to(tl.int32), 0) > 0, 7, code)
    code = tl.where(tl.max((valid & (dep > max_depth)).to(tl.int32), 0) > 0, 6, code)
    code = tl.where(tl.max((par_ok & (dep != dep_par + 1)).to(tl.int32), 0) > 0, 5, code)
    code = tl.where(tl.max((nonroot & ~par_ok).to(tl.int32), 0) > 0, 4, code)
    code = tl.where(tl.max((inb & col0 & (lw != 0.0)).to(tl.int32), 0) > 0, 3, code)
    code = tl.where(tl.max((inb & col0 & ((par != -1) | (dep != 0))).to(tl.int32), 0) > 0, 2, code)
    code = tl.where(tl.max((inb & col0 & (tok != root)).to(tl.int32), 0) > 0, 1, code)
    tl.store(out_ptr + r, code)

    # sanitized row: unchanged if valid; else the root alone, other nodes unacceptable (token -1 under it)
    ok = code == 0
    tok_out = tl.where(ok, tok, tl.where(col0, root, -1))
    par_out = tl.where(ok, par, tl.where(col0, -1, tl.where(valid, 0, -1)))
    dep_out = tl.where(ok, dep, tl.where(col0, 0, tl.where(valid, 1, -1)))
    out_row = out_ptr + R + r * M
    tl.store(out_row + i, tok_out.to(tl.int32), mask=inb)
    tl.store(out_row + field + i, par_out.to(tl.int32), mask=inb)
    tl.store(out_row + 2 * field + i, dep_out.to(tl.int32), mask=inb)


def check_trees(tokens: Tensor, parent: Tensor, depth: Tensor, first_child: Tensor, next_sibling: Tensor,
                logw: Tensor, n_nodes: Tensor, roots: Tensor, vocab_size: int, max_depth: int,
                impl: str = "auto") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launcher: check R draft trees on their device -> (codes [R], tokens, parent, depth [R, M]) int32.

    tokens/parent/depth/first_child/next_sibling [R, M] int32 and logw [R, M] float32 as in TreeBatch (any
    strides); n_nodes, roots [R] int32/int64 on the same device (n_nodes is clamped to [0, M]: its range is
    the caller's check). codes[r] = 0 if row r passes every rule, else 1 + the index in CHECKS of the first
    rule one of its nodes breaks. The outputs are new tensors: a row with code 0 as given; otherwise its
    root (roots[r], parent -1, depth 0), nodes 1..n-1 as (token -1, parent 0, depth 1), padding -1, so
    no draft node of a bad tree can be accepted. impl: auto (Triton on CUDA, the reference elsewhere),
    triton (on CPU needs TRITON_INTERPRET=1) or torch. No host reads: stream-ordered, graph-capturable.
    `check_packed` takes the six arrays as one [6, R, M] buffer (no stacking copy).
    """
    _check_args(tokens, parent, depth, first_child, next_sibling, logw, n_nodes, roots)
    impl = _impl(impl, tokens)
    if impl == "torch":
        _max_nodes(tokens.shape[1])
        return check_trees_reference(tokens, parent, depth, first_child, next_sibling, logw, n_nodes, roots,
                                     vocab_size, max_depth)
    # one [6, R, M] int32 input for the kernel (few arguments: its launch cost counts every draft step)
    packed = torch.stack([tokens, parent, depth, first_child, next_sibling, logw.view(torch.int32)])
    return _launch(packed, n_nodes, roots, vocab_size, max_depth)


def check_packed(packed: Tensor, n_nodes: Tensor, roots: Tensor, vocab_size: int, max_depth: int,
                 impl: str = "auto") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """check_trees over `TreeBatch.packed`: [6, R, M] int32 contiguous (TreeBatch._FIELDS order, logw's float32
    bits last), n_nodes and roots [R] on its device; same results."""
    if packed.dim() != 3 or packed.shape[0] != 6 or packed.dtype != torch.int32 or not packed.is_contiguous():
        raise ValueError(f"packed trees must be [6, R, M] int32 contiguous, got {tuple(packed.shape)} "
                         f"{packed.dtype}{'' if packed.is_contiguous() else ' (not contiguous)'}")
    R = packed.shape[1]
    for name, t in (("n_nodes", n_nodes), ("roots", roots)):
        if t.shape != (R,) or t.dtype not in (torch.int32, torch.int64) or t.device != packed.device:
            raise ValueError(f"{name} must be [{R}] int32 or int64 on {packed.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    if _impl(impl, packed) == "torch":
        _max_nodes(packed.shape[2])
        return check_trees_reference(*packed[:5], packed[5].view(torch.float32), n_nodes, roots, vocab_size,
                                     max_depth)
    return _launch(packed, n_nodes, roots, vocab_size, max_depth)


def _impl(impl: str, t: Tensor) -> str:
    if impl == "auto":
        return "triton" if t.is_cuda else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    return impl


def _max_nodes(M: int) -> None:
    if M > MAX_NODES:
        raise ValueError(f"check_trees: {M} nodes per tree, at most {MAX_NODES}")


def _launch(packed: Tensor, n_nodes: Tensor, roots: Tensor, vocab_size: int, max_depth: int
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernel over a [6, R, M] int32 contiguous input."""
    _, R, M = packed.shape
    _max_nodes(M)
    # one allocation for all four outputs (each launch's host cost counts: this runs every draft step)
    buf = torch.empty(R * (3 * M + 1), dtype=torch.int32, device=packed.device)
    codes, outs = buf[:R], buf[R:].view(3, R, M).unbind(0)
    if R == 0 or M == 0:
        return codes.zero_(), *outs
    block = triton.next_power_of_2(max(M, 2))
    _tree_check_kernel[(R,)](packed, n_nodes.to(torch.int64), roots.to(torch.int64), buf, R, M, vocab_size,
                             max_depth, BLOCK=block, num_warps=4 if block <= 64 else 8)
    return codes, *outs
