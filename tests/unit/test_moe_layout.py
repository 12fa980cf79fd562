"""The MoE block gives the same output before and after the one-time repack into the GPU kernel layout
(on CPU the launcher unrepacks for the reference, so this checks the round trip through the model)."""

from __future__ import annotations

import pytest
import torch

from verifier_service.moe import MoE


@pytest.mark.parametrize("layout", ["gpu", "gluon", "wgmma"])
def test_repack_for_gpu_keeps_outputs(tiny_target64, layout):
    moe = next(m for m in tiny_target64.modules() if isinstance(m, MoE))
    x = torch.randn(7, tiny_target64.cfg.hidden_size, dtype=torch.float64)
    before = moe(x)
    saved = [t.clone() for t in (moe.w13_packed, moe.w13_scale, moe.w2_packed, moe.w2_scale)]
    try:
        moe.repack_for_gpu(layout)
        assert moe.layout == layout and moe.w13_packed.shape != saved[0].shape
        assert torch.equal(moe(x), before)
        with pytest.raises(RuntimeError, match="layout already"):
            moe.repack_for_gpu("gluon" if layout == "gpu" else "gpu")
    finally:  # the fixture is shared: restore the checkpoint layout
        moe.w13_packed, moe.w13_scale, moe.w2_packed, moe.w2_scale = saved
        moe.layout = "checkpoint"


def test_gpu_layout_resolution(monkeypatch):
    """"auto" is the wgmma layout on an sm_90 GPU with Gluon and the Triton one elsewhere (CPU included); an unknown
    layout, or "wgmma" on a CUDA device without wgmma, is refused at load with a message naming the choices."""
    from verifier_service import moe as moe_mod

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert moe_mod.resolve_gpu_layout("auto", cpu) == "gpu"
    assert moe_mod.resolve_gpu_layout("wgmma", cpu) == "wgmma"  # the CPU decodes every layout
    with pytest.raises(ValueError, match="'auto' or one of"):
        moe_mod.resolve_gpu_layout("marlin", cpu)
    for cap, want in (((9, 0), "wgmma"), ((8, 0), "gpu"), ((10, 0), "gpu")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert moe_mod.resolve_gpu_layout("auto", cuda) == (want if moe_mod.HAVE_GLUON else "gpu"), cap
        if want == "gpu":
            with pytest.raises(ValueError, match="needs an sm_90 GPU"):
                moe_mod.resolve_gpu_layout("wgmma", cuda)
