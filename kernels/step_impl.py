"""Which implementation a verify step's small kernels run (`kernels.tree_inputs`, `kernels.tree_accept.accept_tree`,
`kernels.kv_compact.commit_moves`): each is one Triton launch with its torch reference beside it, chosen by the same
`impl` ("auto": the kernel on CUDA, the reference elsewhere; "triton": the kernel everywhere, on CPU under
TRITON_INTERPRET=1; "torch": the reference). `EngineConfig` checks its options against `STEP_IMPLS`."""

from __future__ import annotations

STEP_IMPLS = ("auto", "triton", "torch")


def use_kernel(impl: str, on_cuda: bool) -> bool:
    """Whether `impl` runs the Triton kernel for inputs on CUDA (`on_cuda`) or not; ValueError for an unknown one."""
    if impl not in STEP_IMPLS:
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    return impl == "triton" or (impl == "auto" and on_cuda)
