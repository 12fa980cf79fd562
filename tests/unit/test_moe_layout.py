"""The MoE block gives the same output before and after the one-time repack into the GPU kernel layout
(on CPU the launcher unrepacks for the reference, so this checks the round trip through the model)."""

from __future__ import annotations

import pytest
import torch

from verifier_service.moe import MoE


@pytest.mark.parametrize("layout", ["gpu", "gluon", "wgmma", "wgmma_steps"])
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
    """"auto" is the step-major wgmma layout on an sm_90 GPU with Gluon and the Triton one elsewhere (CPU included);
    an unknown layout, or a wgmma one on a CUDA device without wgmma, is refused at load with a message naming the
    choices."""
    from verifier_service import moe as moe_mod

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert moe_mod.resolve_gpu_layout("auto", cpu) == "gpu"
    assert moe_mod.resolve_gpu_layout("wgmma", cpu) == "wgmma"  # the CPU decodes every layout
    with pytest.raises(ValueError, match="'auto' or one of"):
        moe_mod.resolve_gpu_layout("marlin", cpu)
    for cap, want in (((9, 0), "wgmma_steps"), ((8, 0), "gpu"), ((10, 0), "gpu")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert moe_mod.resolve_gpu_layout("auto", cuda) == (want if moe_mod.HAVE_GLUON else "gpu"), cap
        # the wgmma kernels take bf16 activations: a model in another dtype gets the Triton kernels, or an error
        for dtype in (torch.float32, torch.float16):
            assert moe_mod.resolve_gpu_layout("auto", cuda, dtype) == "gpu", (cap, dtype)
            if want != "gpu" and moe_mod.HAVE_GLUON:
                with pytest.raises(ValueError, match="take bf16 activations"):
                    moe_mod.resolve_gpu_layout("wgmma_steps", cuda, dtype)
        if want == "gpu":
            for layout in ("wgmma", "wgmma_steps"):
                with pytest.raises(ValueError, match="needs an sm_90 GPU"):
                    moe_mod.resolve_gpu_layout(layout, cuda)


def test_moe_schedule_from_the_environment():
    """DDTREE_MOE_SCHEDULE: a JSON object of wgmma schedule options, checked at import (the decode and the tiered
    schedule with them over it); anything the kernels cannot take is a ValueError naming the variable."""
    from verifier_service.moe import schedule_from_env

    assert schedule_from_env(None) == schedule_from_env("") == {}
    assert schedule_from_env('{"pdl": true, "direct": true}') == {"pdl": True, "direct": True}
    assert schedule_from_env('{"block_pairs": 8, "maxnreg": 128}') == {"block_pairs": 8, "maxnreg": 128}
    for bad in ('{"pdl": 1}', '{"stages": 5}', '{"small_pairs": 32}', '{"speed": "max"}', "[8]", "pdl=true",
                '{"maxnreg": 300}'):
        with pytest.raises(ValueError, match="DDTREE_MOE_SCHEDULE="):
            schedule_from_env(bad)


def test_a_bad_moe_schedule_stops_the_process_at_import():
    """The variable is read when the model's MoE module is imported: a bad value fails there with its reason."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DDTREE_MOE_SCHEDULE": '{"stages": 9}'}
    run = subprocess.run([sys.executable, "-c", "import verifier_service.moe"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "DDTREE_MOE_SCHEDULE" in run.stderr and "stages=9" in run.stderr, run.stderr
    env["DDTREE_MOE_SCHEDULE"] = '{"pdl": true}'
    run = subprocess.run([sys.executable, "-c", "import verifier_service.moe as m; "
                          "print(m.int4_moe_wgmma_module.DEFAULT_SCHEDULE)"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "{'pdl': True}", run.stderr
