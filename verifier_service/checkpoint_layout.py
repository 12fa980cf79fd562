"""The tensor layout of a Kimi K2.x / DeepSeek-V3 text-model checkpoint, derived from its config alone.

`target_layout(cfg)` lists every tensor the checkpoint must hold (DESIGN 2.1 names, with the
`language_model.` prefix for K2.5/K2.6), its stored shape and dtype, and where it goes in
`KimiForCausalLM` (routed experts are stacked per layer: gate rows then up rows into `w13*`, down
into `w2*`). Three consumers share it, so they cannot drift apart: the loader (expectations and
destinations), the random-checkpoint writer (what to generate), and `ddtree inspect` (parameter and
byte counts). Vision-tower tensors and multi-token-prediction layers are not part of the text model
and are not listed (the loader ignores them).

Which modules are INT4 is decided by the compressed-tensors `quantization_config` (`QuantConfig.
is_quantized`); only routed experts may be quantized, and then all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verifier_service.config import KimiConfig

# class names (MRO) a compressed-tensors `targets`/`ignore` entry may name, per module kind
LINEAR = ("Linear", "Module")
CLASSES = {"embed": ("Embedding", "Module"), "norm": ("DeepseekV3RMSNorm", "Module"), "router": ("MoEGate", "Module")}
PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LayoutTensor:
    name: str  # checkpoint tensor name (with the layout's prefix)
    shape: tuple[int, ...]  # as stored
    dtype: torch.dtype  # as stored by the reference checkpoints
    kind: str  # embed | lm_head | norm | linear | router | router_bias | expert | packed | scale | shape
    params: int  # logical parameters (out*in for a packed projection; 0 for scales and weight_shape)
    dst: str | None = None  # model parameter/buffer name; None = validation only (weight_shape)
    layer: int | None = None
    expert: int | None = None
    rows: tuple[int, int] | None = None  # row range inside the stacked [E, rows, ...] destination
    logical: tuple[int, int] | None = None  # (out, in) of an expert projection

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    @property
    def module(self) -> str:
        """Module path: the name without its last component (`.weight`, `.weight_packed`, ...)."""
        return self.name.rsplit(".", 1)[0]

    @property
    def category(self) -> str:
        if self.kind in ("packed", "scale", "shape"):
            return "int4_experts"
        if self.kind == "expert":
            return "bf16_experts"
        if self.kind in ("embed", "lm_head"):
            return "embeddings"
        return "bf16_rest"


def experts_quantized(cfg: KimiConfig) -> bool:
    """Apply the quantization_config to every module; True when the routed experts are INT4.

    Raises ValueError naming the first module whose quantization DDTree cannot serve: a quantized
    non-expert (attention, dense MLP, shared expert, router, lm_head, ...) or experts only partly
    quantized.
    """
    q = cfg.quant
    if q is None:
        return False
    p = cfg.tensor_prefix
    non_expert = [(f"{p}model.embed_tokens", CLASSES["embed"]), (f"{p}model.norm", CLASSES["norm"])]
    if not cfg.tie_word_embeddings:
        non_expert.append((f"{p}lm_head", LINEAR))
    expert_flags: dict[bool, str] = {}
    for i in range(cfg.num_hidden_layers):
        L = f"{p}model.layers.{i}."
        norms = ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")
        non_expert += [(L + n, CLASSES["norm"]) for n in norms]
        attn = ["q_a_proj", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
        non_expert += [(f"{L}self_attn.{n}", LINEAR) for n in (*attn, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")]
        if not cfg.is_moe_layer(i):
            non_expert += [(f"{L}mlp.{n}", LINEAR) for n in PROJS]
            continue
        non_expert.append((f"{L}mlp.gate", CLASSES["router"]))
        if cfg.n_shared_experts:
            non_expert += [(f"{L}mlp.shared_experts.{n}", LINEAR) for n in PROJS]
        for e in range(cfg.n_routed_experts):
            for n in PROJS:
                mod = f"{L}mlp.experts.{e}.{n}"
                expert_flags.setdefault(q.is_quantized(mod, LINEAR), mod)
    for mod, cls in non_expert:
        if q.is_quantized(mod, cls):
            raise ValueError(f"quantization_config quantizes {mod} (a target matches it and no `ignore` entry "
                             "does), but only routed experts may be INT4: quantized attention, dense, shared-expert, "
                             "router or lm_head weights are not supported")
    if len(expert_flags) == 2:
        raise ValueError(f"quantization_config quantizes some routed experts but not {expert_flags[False]}: "
                         "all routed experts must share one format")
    if False in expert_flags:
        raise ValueError(f"quantization_config is present but quantizes no routed expert (e.g. {expert_flags[False]}"
                         " is ignored); remove it for a bf16 checkpoint")
    return True


def target_layout(cfg: KimiConfig) -> list[LayoutTensor]:
    """Every tensor of the text model, in the order the reference writer emits them."""
    int4 = experts_quantized(cfg)
    p, D, H = cfg.tensor_prefix, cfg.hidden_size, cfg.num_attention_heads
    out: list[LayoutTensor] = []

    def w(mod: str, o: int, i: int, kind: str = "linear"):  # mod without prefix, e.g. "model.norm"
        out.append(LayoutTensor(f"{p}{mod}.weight", (o, i), torch.bfloat16, kind, o * i, dst=f"{mod}.weight"))

    def vec(mod: str, n: int):
        out.append(LayoutTensor(f"{p}{mod}.weight", (n,), torch.bfloat16, "norm", n, dst=f"{mod}.weight"))

    w("model.embed_tokens", cfg.vocab_size, D, "embed")
    inter = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}."
        vec(L + "input_layernorm", D)
        vec(L + "post_attention_layernorm", D)
        a = L + "self_attn."
        if cfg.q_lora_rank:
            w(a + "q_a_proj", cfg.q_lora_rank, D)
            vec(a + "q_a_layernorm", cfg.q_lora_rank)
            w(a + "q_b_proj", H * cfg.qk_head_dim, cfg.q_lora_rank)
        else:
            w(a + "q_proj", H * cfg.qk_head_dim, D)
        w(a + "kv_a_proj_with_mqa", cfg.kv_row_dim, D)
        vec(a + "kv_a_layernorm", cfg.kv_lora_rank)
        w(a + "kv_b_proj", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        w(a + "o_proj", D, H * cfg.v_head_dim)
        m = L + "mlp."
        if not cfg.is_moe_layer(i):
            w(m + "gate_proj", cfg.intermediate_size, D)
            w(m + "up_proj", cfg.intermediate_size, D)
            w(m + "down_proj", D, cfg.intermediate_size)
            continue
        w(m + "gate", cfg.n_routed_experts, D, "router")
        E = cfg.n_routed_experts
        out.append(LayoutTensor(f"{p}{m}gate.e_score_correction_bias", (E,), torch.float32, "router_bias", E,
                                dst=f"{m}gate.e_score_correction_bias"))
        if cfg.n_shared_experts:
            si = inter * cfg.n_shared_experts
            w(m + "shared_experts.gate_proj", si, D)
            w(m + "shared_experts.up_proj", si, D)
            w(m + "shared_experts.down_proj", D, si)
        for e in range(E):
            for proj, (o, n) in zip(PROJS, ((inter, D), (inter, D), (D, inter))):
                base = f"{p}{m}experts.{e}.{proj}."
                stack, rows = ("w2", (0, D)) if proj == "down_proj" else ("w13", (0, inter) if proj == "gate_proj"
                                                                            else (inter, 2 * inter))
                kw = dict(layer=i, expert=e, rows=rows, logical=(o, n))
                if not int4:
                    out.append(LayoutTensor(base + "weight", (o, n), torch.bfloat16, "expert", o * n,
                                            dst=f"{m}{stack}", **kw))
                    continue
                g = cfg.quant.group_size
                if n % g:
                    raise ValueError(f"quantization group_size {g} does not divide {proj} input size {n}")
                out.append(LayoutTensor(base + "weight_packed", (o, n // 8), torch.int32, "packed", o * n,
                                        dst=f"{m}{stack}_packed", **kw))
                out.append(LayoutTensor(base + "weight_scale", (o, n // g), torch.bfloat16, "scale", 0,
                                        dst=f"{m}{stack}_scale", **kw))
                out.append(LayoutTensor(base + "weight_shape", (2,), torch.int32, "shape", 0, **kw))
    vec("model.norm", D)
    if not cfg.tie_word_embeddings:
        w("lm_head", cfg.vocab_size, D, "lm_head")
    return out
