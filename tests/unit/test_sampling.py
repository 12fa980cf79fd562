"""Seeded sampling ops (kernels/gumbel_noise.py, kernels/sampling.py) and SamplingParams validation.

- the Philox stream against the Random123 known-answer vectors; the own log2/exp2 accuracy;
- the Triton kernels (TRITON_INTERPRET=1 on CPU, fp32) against the torch references, bitwise:
  noise bits and chosen tokens, on awkward shapes, including rows that need several rounds;
- hand-built cases with exact answers (greedy ties, top-k/top-p boundaries, -inf logits);
- statistics with computed false-failure rates: the noise is Gumbel (DKW bound) and the AR
  sampler's next-token distribution is the warped softmax (chi-square + Hoeffding);
- bad parameters fail with errors naming the field; a GPU test (bitwise CPU == CUDA, no sync).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kernels.gumbel_noise import gumbel_noise, log2_f32_ref, philox4x32_10_ref
from kernels.sampling import fixed_mass_ref, sample_tokens
from tests.sampling_stats import chi2_threshold, pearson, warped_probs
from verifier_service.sampler import sampling_tensors
from verifier_service.sampling_params import MAX_SEED, SamplingParams
from verifier_service.session import DecodeParams

M32 = 0xFFFFFFFF


def rows(params: list[SamplingParams], positions: list[int] | torch.Tensor, seeds: list[int] | None = None):
    """Per-row kernel arguments (inv_temp, top_p, top_k, seed, position) from SamplingParams."""
    seeds = seeds if seeds is not None else [p.seed if p.seed is not None else 0 for p in params]
    return (*sampling_tensors(params, seeds), torch.as_tensor(positions, dtype=torch.int64))


# --- the noise ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctr,key,want", [  # Random123 kat_vectors, philox4x32 10
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(ctr, key, want):
    out = philox4x32_10_ref(*(torch.tensor([v]) for v in ctr + key))
    assert [int(w) for w in out] == list(want)


def test_own_log2_and_exp2_are_accurate():
    x = torch.cat((torch.logspace(-7.3, 1.3, 20001), torch.tensor([1.0, 0.5, 2.0, 16.6, 5.96e-8])))
    exact = torch.log2(x.double())
    err = (log2_f32_ref(x).double() - exact).abs() / (exact.abs() + 1)  # fp32 result rounding: ~6e-8 relative
    assert err.max() < 2e-7, f"worst log2 error {err.max():.3g} at x={x[err.argmax()]:.6g}"
    d = -torch.linspace(0, 30, 30001)
    q, exact = fixed_mass_ref(d).double(), 2.0**40 * torch.exp(d.double())
    err = (q - exact).abs() - 2e-6 * exact  # 2e-6 relative, plus one unit (2^-40) of truncation
    assert err.max() <= 1, f"worst mass error {err.max():.3g} at d={d[err.argmax()]:.6g}"
    assert fixed_mass_ref(torch.tensor([0.0, -40.0, float("-inf")])).tolist() == [2**40, 0, 0]


SEEDS = [0, 1, M32, M32 + 1, 2**62 + 12345, MAX_SEED, 7, 7]
POSITIONS = [0, 1, 2**31, 2**32 + 5, 17, 123456789012, 41, 42]


def test_noise_triton_matches_reference_bitwise():
    seed, pos = torch.tensor(SEEDS), torch.tensor(POSITIONS)
    ref = gumbel_noise(seed, pos, 203, impl="torch")
    tri = torch.full_like(ref, float("nan"))
    tri = gumbel_noise(seed, pos, 203, impl="triton", block=64)  # 4 blocks, ragged tail, vocab % 4 != 0
    bad = (ref.view(torch.int32) != tri.view(torch.int32)).nonzero()
    assert bad.numel() == 0, f"{len(bad)} noise values differ, first at {bad[0].tolist()}: " \
        f"{ref[tuple(bad[0])]} vs {tri[tuple(bad[0])]}"
    assert torch.isfinite(ref).all()
    assert not torch.equal(ref[6], ref[7])  # same seed, next position: fresh noise
    assert torch.equal(ref, gumbel_noise(seed.flip(0), pos.flip(0), 203).flip(0))  # a row's noise ignores the batch


def test_noise_is_standard_gumbel():
    """DKW: P(sup_g |F_n(g) - F(g)| > eps) <= 2 exp(-2 n eps^2); eps below gives a false-failure
    rate of 1e-9 for n = 2^17 independent draws (Philox streams of distinct (seed, position, v))."""
    n_rows, V = 512, 256
    g = gumbel_noise(torch.arange(n_rows) * 1_000_003, torch.arange(n_rows) % 37, V).flatten().double()
    n = g.numel()
    eps = math.sqrt(math.log(2 / 1e-9) / (2 * n))
    gs = g.sort().values
    cdf = torch.exp(-torch.exp(-gs))
    ecdf_hi = torch.arange(1, n + 1, dtype=torch.float64) / n
    dks = torch.maximum(ecdf_hi - cdf, cdf - (ecdf_hi - 1 / n)).max().item()
    assert dks < eps, f"KS distance {dks:.4g} >= {eps:.4g}"
    assert gs[0] > -2.82 and gs[-1] < 16.7  # the 23-bit uniform's range: (2^-24, 1 - 2^-24)


# --- the sampler: Triton == reference ----------------------------------------------------------------------
def test_sampler_triton_matches_reference_bitwise():
    g = torch.Generator().manual_seed(3)
    R, V = 14, 301
    logits = torch.randn(R, V, generator=g) * 3
    logits[3, 10:20] = logits[3].max()  # tied maxima
    logits[4, ::3] = float("-inf")
    logits[5] = torch.randn(V, generator=g).round()  # many exact ties in z
    # pass-1 noise skipping (a block whose max z + 17 < best key is skipped): one dominant early token;
    # a falling row; high blocks first and last with hopeless blocks between (block = 64)
    logits[6, 3] = 60.0
    logits[9] = torch.linspace(60, -60, V)
    logits[12, 64:256] = -30.0
    logits[12, 256:] += 2.0
    ps = [SamplingParams(), SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(1.5, top_k=20),
          SamplingParams(0.3, top_p=0.9, top_k=20), SamplingParams(2.0, top_p=0.5, top_k=7),
          SamplingParams(1.0, top_k=V - 1), SamplingParams(1.0, top_k=V), SamplingParams(1.0, top_p=1e-6),
          SamplingParams(4.0, top_p=0.3), SamplingParams(5.0, top_k=2), SamplingParams(1.2, top_p=0.95, top_k=50),
          SamplingParams(0.9, top_p=0.6), SamplingParams(3.0, top_p=0.2, top_k=100)]
    args = rows(ps, [5 + 3 * i for i in range(R)], seeds=[101 * i + 7 for i in range(R)])
    ref = sample_tokens(logits, *args, impl="torch")
    tri = sample_tokens(logits, *args, impl="triton", block=64)
    assert tri.tolist() == ref.tolist()
    # not vacuous: some rows needed more than one round (the unrestricted Gumbel-max was filtered out)
    free = sample_tokens(logits, args[0], torch.ones(R), torch.zeros(R, dtype=torch.int32), *args[3:])
    assert (free != ref).sum() >= 3, "no row exercised the restricted rounds"
    assert ref[0] == logits[0].argmax()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_exact_cases(impl):
    """The allowed set is exact; the reference (48 seeds) must also hit every allowed token, the
    interpreter (slow: 6 seeds) must stay inside it."""
    n_seeds = 48 if impl == "torch" else 6

    def draw(logits, p: SamplingParams):
        x = torch.tensor(logits, dtype=torch.float32)[None].expand(n_seeds, -1).contiguous()
        got = set(sample_tokens(x, *rows([p] * n_seeds, [9] * n_seeds, list(range(n_seeds))), impl=impl,
                                block=16).tolist())
        return got if impl == "torch" else _Within(got)

    assert draw([1.0, 3.0, 3.0, 0.0], SamplingParams()) == {1}  # greedy: first of tied maxima
    assert draw([1.0, 3.0, 3.5, 0.0], SamplingParams(2.0, top_k=1)) == {2}
    assert draw([1.0, 3.0, 3.5, 0.0], SamplingParams(2.0, top_p=1e-3)) == {2}
    assert draw([0.0] * 20, SamplingParams(1.0, top_k=3)) == {0, 1, 2}  # ties rank by index
    half = [math.log(v) for v in (0.5, 0.25, 0.125, 0.125)]
    assert draw(half, SamplingParams(1.0, top_p=0.49)) == {0}
    assert draw(half, SamplingParams(1.0, top_p=0.51)) == {0, 1}  # mass before token 1 = 0.5 < 0.51
    assert draw(half, SamplingParams(1.0, top_p=0.76)) == {0, 1, 2}  # token 3 ties with 2, ranks after it
    assert draw(half, SamplingParams(1.0, top_p=0.9, top_k=2)) == {0, 1}  # the shorter prefix wins
    ninf = float("-inf")
    assert draw([ninf, 0.0, ninf, 1.0, ninf], SamplingParams(1.5)) == {1, 3}


class _Within(set):
    """A sample set that compares equal to any allowed set containing it (for few draws)."""

    def __eq__(self, allowed):
        return set(self) <= set(allowed) and len(self) > 0

    __hash__ = None


_PTX_CHECK = """
import json
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kernels.gumbel_noise import KERNEL_OPTIONS, _gumbel_noise_kernel
from kernels.sampling import _sample_kernel
sigs = [(_sample_kernel, {"x_ptr": "*fp32", "stride_xm": "i32", "inv_temp_ptr": "*fp32", "top_p_ptr": "*fp32",
                          "top_k_ptr": "*i32", "seed_ptr": "*i64", "pos_ptr": "*i64", "out_ptr": "*i64",
                          "V": "i32", "BLOCK": "constexpr"}),
        (_gumbel_noise_kernel, {"seed_ptr": "*i64", "pos_ptr": "*i64", "out_ptr": "*fp32", "V": "i32",
                                "stride_om": "i32", "BLOCK": "constexpr"})]
out = {}
for fn, sig in sigs:
    k = compile(ASTSource(fn=fn, signature=sig, constexprs={"BLOCK": 1024}), target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 4, **KERNEL_OPTIONS})
    out[fn.__name__] = {p: k.asm["ptx"].count(p) for p in ("mul.rn.f32", "add.rn.f32", "fma.rn.f32", ".ftz", ".approx")}
print(json.dumps(out))
"""


def test_compiled_kernels_use_only_ieee_mul_add():
    """Bit-identity with the CPU reference needs correctly rounded fp32 ops on the GPU: compile both
    kernels for sm_90 with the launchers' options (PTX only: no GPU needed; in a subprocess, since
    this process runs Triton in interpreter mode) and look for contraction (fma), flush-to-zero
    (.ftz) and approximate instructions (lg2/ex2/rcp/div .approx)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _PTX_CHECK], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if res.returncode != 0:
        if "backend" in res.stderr.lower() or "ptxas" in res.stderr.lower():
            pytest.skip(f"this triton build cannot compile for sm_90: {res.stderr[-200:]}")
        raise AssertionError(res.stderr[-2000:])
    for name, n in json.loads(res.stdout.strip().splitlines()[-1]).items():
        assert n["mul.rn.f32"] > 0 and n["add.rn.f32"] > 0, name
        assert n["fma.rn.f32"] == n[".ftz"] == n[".approx"] == 0, f"{name}: {n}"


# --- distribution ---------------------------------------------------------------------------------------
CONFIGS = [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(1.5, top_k=5),
           SamplingParams(1.3, top_p=0.8, top_k=12)]


def test_ar_next_token_distribution_is_the_warped_softmax():
    """n = 2^14 AR draws per config (distinct seeds and positions) on a 16-token vocabulary.

    False-failure budget (all 4 configs together): chi-square at 1e-8 each (Pearson's statistic is
    chi2(kept-1) in the limit; every expected count here is >= 50, asserted) plus Hoeffding with a
    union bound, P(|p_hat - p| >= t) <= 2 exp(-2 n t^2) over 16 tokens x 4 configs at 1e-7 total
    (rigorous): total < 2e-7 < 1e-6. Tokens outside the kept set must never appear (exact).
    Power: the same statistic against the kept set reweighted at a 25% wrong temperature must
    exceed the threshold (its expectation is 2.4x-8x the threshold for these configs).
    """
    n, V = 1 << 14, 16
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 1.5
    t = math.sqrt(math.log(2 * V * len(CONFIGS) / 1e-7) / (2 * n))
    for c, p in enumerate(CONFIGS):
        probs = warped_probs(logits, p)
        kept = probs > 0
        assert (probs[kept] * n).min() >= 50, "test design: expected counts too small for chi-square"
        seeds = (torch.arange(n) * 7919 + c * n).tolist()
        pos = (torch.arange(n) * 104729) % 1_000_003
        y = sample_tokens(logits.float()[None].expand(n, V).contiguous(), *rows([p] * n, pos, seeds))
        counts = torch.bincount(y, minlength=V)
        assert counts[~kept].sum() == 0, f"{p}: drew a filtered-out token"
        thr = chi2_threshold(int(kept.sum()) - 1, 1e-8)
        stat = pearson(counts, probs, n)
        assert stat < thr, f"{p}: chi-square {stat:.1f} >= {thr:.1f}"
        worst = (counts.double() / n - probs).abs().max().item()
        assert worst < t, f"{p}: |p_hat - p| = {worst:.4f} >= {t:.4f}"
        wrong = torch.where(kept, torch.softmax(logits / (1.25 * p.temperature), 0), 0.0)
        assert pearson(counts, wrong / wrong.sum(), n) > thr, f"{p}: the test cannot tell a 25% temperature error"


# --- parameters -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": 1e-9}, "temperature"),
    ({"temperature": "1"}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.2}, "top_p"), ({"top_p": float("nan")}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"), ({"seed": -1}, "seed"), ({"seed": 2**63}, "seed"),
    ({"seed": "7"}, "seed"),
])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_params_defaults_and_decode_params_field():
    assert DecodeParams().sampling == SamplingParams() and SamplingParams().greedy
    assert SamplingParams(0.5, top_p=1, top_k=0, seed=MAX_SEED).to_dict()["seed"] == MAX_SEED
    with pytest.raises(TypeError, match="sampling"):
        DecodeParams(sampling={"temperature": 1.0})


def test_launcher_rejects_bad_tensors():
    x = torch.randn(3, 10)
    good = list(rows([SamplingParams(1.0)] * 3, [1, 2, 3]))
    for i, name in enumerate(["inv_temp", "top_p", "top_k", "seed", "position"]):
        bad = list(good)
        bad[i] = bad[i][:2]
        with pytest.raises(ValueError, match=name):
            sample_tokens(x, *bad)
    bad = list(good)
    bad[2] = bad[2].long()
    with pytest.raises(ValueError, match="top_k"):
        sample_tokens(x, *bad)
    with pytest.raises(ValueError, match="logits"):
        sample_tokens(x[:, None], *good)
    with pytest.raises(ValueError, match="impl"):
        sample_tokens(x, *good, impl="cuda")


# --- GPU --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_is_bitwise_the_cpu_reference_and_sync_free():
    V, R = 163840, 48
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(R, V, generator=g) * 4
    ps = [CONFIGS[i % 4] if i % 5 else SamplingParams() for i in range(R)]
    args = rows(ps, [1000 + 7 * i for i in range(R)], seeds=[2**40 + 13 * i for i in range(R)])
    ref = sample_tokens(logits, *args, impl="torch")
    dev = [a.cuda() for a in args]
    xd = logits.cuda()
    out = sample_tokens(xd, *dev)  # warm-up (compiles)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample_tokens(xd, *dev)
        noise = gumbel_noise(dev[3][:4], dev[4][:4], V)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.cpu().tolist() == ref.tolist()
    ref_noise = gumbel_noise(args[3][:4], args[4][:4], V)
    assert torch.equal(noise.cpu().view(torch.int32), ref_noise.view(torch.int32))
    bf = logits.to(torch.bfloat16)  # bf16 logits are read as fp32 by both paths
    assert sample_tokens(bf.cuda(), *dev).cpu().tolist() == sample_tokens(bf, *args).tolist()
