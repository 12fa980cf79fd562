"""Kimi K2.x / DeepSeek-V3 text-model configuration, read from a Hugging Face `config.json`.

Kimi K2 / K2-Thinking and DeepSeek-V3 keep the fields at the top level and name tensors without a
prefix; Kimi K2.5 / K2.6 (`kimi_k25`) nest them under `text_config` and prefix tensor names with
`language_model.` (DESIGN 2.1). The compressed-tensors `quantization_config` may sit at either level.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("kimi_k25", "kimi_k2", "deepseek_v3")


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' rule: `re:PATTERN` is `re.match` (anchored at the start, not the end) against
    the module path; anything else must equal the module path exactly."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


@dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors pack-quantized INT4 settings (None on the target = everything bf16).

    Which modules are INT4 follows compressed-tensors: a module is quantized when a config group's
    `targets` match it (module path or class name, e.g. "Linear") and no `ignore` entry does. Module
    paths are the checkpoint's tensor names without the `.weight` suffix (with `language_model.` for
    K2.5/K2.6). The loader then requires exactly the routed experts to be quantized.
    """

    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)
    format: str = "pack-quantized"

    def __post_init__(self):
        if self.format != "pack-quantized":
            raise ValueError(f"quantization_config: unsupported format {self.format!r} (supported: pack-quantized)")
        if self.num_bits != 4 or not self.symmetric:
            raise ValueError(f"only symmetric INT4 is supported, got num_bits={self.num_bits} "
                             f"symmetric={self.symmetric}")
        if self.group_size <= 0 or self.group_size % 8:
            raise ValueError(f"quantization group_size must be a positive multiple of 8, got {self.group_size}")
        for pat in (*self.ignore, *self.targets):
            if pat.startswith("re:"):
                try:
                    re.compile(pat[3:])
                except re.error as e:
                    raise ValueError(f"quantization_config: bad regex {pat!r}: {e}") from None

    def is_quantized(self, module: str, classes: tuple[str, ...]) -> bool:
        """compressed-tensors matching for one module path with its class names (MRO)."""
        def hit(t: str) -> bool:
            return match_name(module, t) or t in classes

        return any(hit(t) for t in self.targets) and not any(hit(t) for t in self.ignore)

    @classmethod
    def from_hf(cls, qc: dict | None) -> QuantConfig | None:
        if not qc:
            return None
        method = qc.get("quant_method")
        if method != "compressed-tensors":
            raise ValueError(f"quantization_config: unsupported quant_method {method!r} (supported: compressed-tensors "
                             "pack-quantized INT4; FP8 checkpoints such as the original DeepSeek-V3 must be "
                             "converted to bf16 first)")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"quantization_config: expected one config group, found {len(groups)}")
        grp = groups[0]
        fmt = grp.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"quantization_config: unsupported format {fmt!r} (supported: pack-quantized)")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"quantization_config: quantization_status {status!r}: the weights are not packed "
                             "(expected 'compressed')")
        w = grp.get("weights") or {}
        if w.get("strategy", "group") != "group" or w.get("type", "int") != "int" or w.get("dynamic"):
            raise ValueError(f"quantization_config: unsupported weights scheme {w} (supported: static int group)")
        if w.get("actorder") not in (None, False, "static"):
            raise ValueError(f"quantization_config: actorder {w.get('actorder')!r} (g_idx) is not supported")
        for act in ("input_activations", "output_activations"):
            if grp.get(act):
                raise ValueError(f"quantization_config: {act} quantization is not supported (weight-only INT4)")
        if qc.get("kv_cache_scheme"):
            raise ValueError("quantization_config: kv_cache_scheme is not supported (the latent cache is bf16)")
        return cls(num_bits=int(w.get("num_bits", 4)), group_size=int(w.get("group_size", 32)),
                   symmetric=bool(w.get("symmetric", True)), ignore=tuple(qc.get("ignore") or ()),
                   targets=tuple(grp.get("targets") or ("Linear",)), format=fmt)


@dataclass(frozen=True)
class KimiConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    quant: QuantConfig | None = None
    tensor_prefix: str = ""  # "language_model." for K2.5/K2.6
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "qk_rope_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"config: num_experts_per_tok {self.num_experts_per_tok} > "
                             f"n_routed_experts {self.n_routed_experts}")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"config: n_group {self.n_group} / topk_group {self.topk_group} do not "
                             f"divide {self.n_routed_experts} experts")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"config: grouped routing scores a group by its top-2 experts; {self.n_routed_experts} "
                             f"experts in {self.n_group} groups leave fewer than 2 per group")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(f"config: num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of "
                             f"topk_group {self.topk_group} groups")
        if self.first_k_dense_replace < 0 or self.moe_layer_freq < 1:
            raise ValueError("config: first_k_dense_replace must be >= 0 and moe_layer_freq >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError("config: qk_rope_head_dim must be even")
        if self.scoring_func != "sigmoid" or self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"config: unsupported routing scoring_func={self.scoring_func!r} "
                             f"topk_method={self.topk_method!r} (supported: sigmoid + noaux_tc)")

    # --- derived -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Latent cache row per token per layer: [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling or {}
        if rs.get("mscale_all_dim"):
            factor = float(rs["factor"])
            m = 0.1 * float(rs["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= m * m
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)

    # --- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> KimiConfig:
        """Kimi K2.5/K2.6 (`text_config` + `language_model.` prefix), Kimi K2 / DeepSeek-V3 (top level)."""
        text = d.get("text_config")
        prefix = "language_model." if text is not None else ""
        src = dict(text) if text is not None else dict(d)
        for mt in {d.get("model_type"), src.get("model_type")} - {None}:
            if mt not in SUPPORTED_MODEL_TYPES:
                raise ValueError(f"model_type {mt!r} is not a Kimi K2.x / DeepSeek-V3 text model "
                                 f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); is this the drafter's folder?")
        qc = src.get("quantization_config") or d.get("quantization_config")
        kw = {}
        for f in cls.__dataclass_fields__:
            if f in ("quant", "tensor_prefix", "raw"):
                continue
            if f in src:
                kw[f] = src[f]
            elif f in ("bos_token_id", "eos_token_id", "tie_word_embeddings") and f in d:
                kw[f] = d[f]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])
        if kw.get("rope_scaling") is not None:
            kw["rope_scaling"] = dict(kw["rope_scaling"])
        missing = [f for f in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                               "num_hidden_layers", "num_attention_heads", "n_routed_experts",
                               "num_experts_per_tok") if f not in kw]
        if missing:
            raise ValueError(f"missing fields {missing}")
        try:
            return cls(**kw, quant=QuantConfig.from_hf(qc), tensor_prefix=prefix, raw=d)
        except TypeError as e:
            raise ValueError(f"bad field value: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> KimiConfig:
        return parse_config_file(path, cls.from_dict, "is this a Hugging Face model folder?")


def parse_config_file(path: str | Path, parse, hint: str):
    """Read `path` (a config.json or the folder holding one) and parse it; every error names the file."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"{p}: no config.json ({hint})")
    try:
        return parse(json.loads(p.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
