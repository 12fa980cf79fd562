"""A verify step's tree-dependent forward inputs in one launch: the flat nodes' token ids, positions and
ancestor bits (DESIGN 3.1).

The engine lays the step's trees out as [S, M] (tokens, parent, depth; -1 padding) and verifies the flat nodes
`gather` (s * M + j for each session's first n_s nodes). Its forward needs, per flat node: the token id (a refused
tree's -1 clamped to 0: it is embedded, never accepted), the position (the session's committed length + depth) and
the node's ancestor bits (bit k of word w set for column 64 w + k on the node's root path, itself included:
`pack_mask_bits(ancestor_mask(parent))`). In torch that is ~40 launches at 17 nodes (the pointer jumping's six
rounds, the packing, three gathers); after a remote drafter's answer they sit on the step's critical path, where
each launch costs host time. Here: one launch, one program per block of flat nodes, each node walking its parent
chain (at most M steps; a pointer outside [0, M) ends it, as `ancestor_mask` treats it as none). The same
bits as the pointer jumping for any parent array, cycles included: both give every node reachable within M - 1
steps. `tree_inputs_reference` is that torch code, the CPU path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.step_impl import use_kernel
from kernels.tree_mask import ancestor_mask, pack_mask_bits

BLOCK = 64  # flat nodes per program


def tree_inputs_reference(tok: Tensor, parent: Tensor, depth: Tensor, committed: Tensor, gather: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """tok, parent, depth [S, M] int64, committed [S] int64, gather [N] int64 (flat indices s * M + j) ->
    (token ids [N] clamped to >= 0, positions [N], ancestor bits [N, ceil(M / 64)]) int64."""
    S, M = tok.shape
    tokens = tok.view(-1)[gather].clamp(min=0)
    positions = (committed[:, None] + depth).view(-1)[gather]
    bits = pack_mask_bits(ancestor_mask(parent)).view(S * M, -1)[gather]
    return tokens, positions, bits


@triton.jit(do_not_specialize=["N", "M"])  # no recompiles as the step's node counts vary
def _tree_inputs_kernel(tok_ptr, parent_ptr, depth_ptr, committed_ptr, gather_ptr, tokens_ptr, pos_ptr, bits_ptr,
                        N, M, W: tl.constexpr, WB: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < N
    g = tl.load(gather_ptr + offs, mask=live, other=0)  # flat index s * M + j
    s = g // M
    tl.store(tokens_ptr + offs, tl.maximum(tl.load(tok_ptr + g, mask=live, other=0), 0), mask=live)
    tl.store(pos_ptr + offs, tl.load(committed_ptr + s, mask=live, other=0) + tl.load(depth_ptr + g, mask=live,
                                                                                      other=0), mask=live)
    words = tl.arange(0, WB)
    one = tl.full([BLOCK, WB], 1, tl.int64)
    bits = tl.zeros([BLOCK, WB], dtype=tl.int64)
    cur = tl.where(live, g - s * M, -1)  # the node's column; -1 once its chain has ended
    for _ in range(0, M):
        on = cur >= 0
        hit = on[:, None] & (words[None, :] == (cur // 64)[:, None])
        bits = bits | tl.where(hit, one << tl.where(on, cur % 64, 0)[:, None], 0)
        up = tl.load(parent_ptr + s * M + cur, mask=on, other=-1)
        cur = tl.where(on & (up >= 0) & (up < M), up, -1)
    tl.store(bits_ptr + offs[:, None] * W + words[None, :], bits, mask=live[:, None] & (words[None, :] < W))


def tree_inputs(tok: Tensor, parent: Tensor, depth: Tensor, committed: Tensor, gather: Tensor,
                impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Launcher, same contract as `tree_inputs_reference` (int64 inputs on one device; tok, parent, depth
    contiguous [S, M]). impl: auto (Triton on CUDA, the reference elsewhere), triton (on CPU needs
    TRITON_INTERPRET=1) or torch. No host reads: stream-ordered, graph-capturable."""
    S, M = tok.shape
    for name, t in (("tok", tok), ("parent", parent), ("depth", depth), ("committed", committed),
                    ("gather", gather)):
        if t.dtype != torch.int64 or t.device != tok.device:
            raise ValueError(f"tree_inputs: {name} must be int64 on {tok.device}, got {t.dtype} on {t.device}")
    if parent.shape != (S, M) or depth.shape != (S, M) or committed.shape != (S,) or gather.dim() != 1:
        raise ValueError(f"tree_inputs: shapes tok {tuple(tok.shape)}, parent {tuple(parent.shape)}, depth "
                         f"{tuple(depth.shape)}, committed {tuple(committed.shape)}, gather {tuple(gather.shape)}")
    if not use_kernel(impl, tok.is_cuda):
        return tree_inputs_reference(tok, parent, depth, committed, gather)
    N, W = gather.shape[0], max(1, math.ceil(M / 64))
    tokens = torch.empty(N, dtype=torch.int64, device=tok.device)
    positions = torch.empty(N, dtype=torch.int64, device=tok.device)
    bits = torch.empty(N, W, dtype=torch.int64, device=tok.device)
    if N:
        _tree_inputs_kernel[(triton.cdiv(N, BLOCK),)](tok.contiguous(), parent.contiguous(), depth.contiguous(),
                                                     committed.contiguous(), gather.contiguous(), tokens, positions,
                                                     bits, N, M, W=W,
                                                     WB=triton.next_power_of_2(W), BLOCK=BLOCK)
    return tokens, positions, bits
