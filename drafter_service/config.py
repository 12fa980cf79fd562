"""DFlash drafter configuration (a Qwen3-style layer stack conditioned on target taps; DESIGN 2.2).

`dflash_config.{target_layer_ids, mask_token_id, block_size}` win over the same keys at the top level;
`num_target_layers` is read at the top level, then inside dflash_config. Without target_layer_ids the
DFlash rule picks n layers spread over the target: round(1 + i*(N-4)/(n-1)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from verifier_service.config import parse_config_file


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's rule when the config has none: round(1 + i * (N - 4) / (n - 1)), i = 0..n-1."""
    if num_draft_layers == 1:
        return (1,)
    return tuple(int(round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)))
                 for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"drafter config: block_size must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("drafter config: num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            raise ValueError("drafter config: target_layer_ids is empty")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids) or min(self.target_layer_ids) < 0:
            raise ValueError(f"drafter config: target_layer_ids {list(self.target_layer_ids)} must be distinct and "
                             ">= 0")
        if self.num_target_layers and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(f"drafter config: target_layer_ids {list(self.target_layer_ids)} reach beyond "
                             f"num_target_layers {self.num_target_layers}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"drafter config: mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"(vocab_size {self.vocab_size})")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        dc = d.get("dflash_config") or {}

        def pick(name, default=None):
            if name in dc:
                return dc[name]
            return d.get(name, default)

        try:
            n_target = int(d.get("num_target_layers") or dc.get("num_target_layers") or 0)
            ids = pick("target_layer_ids")
            if ids is None:
                if not n_target:
                    raise ValueError("drafter config: neither target_layer_ids nor num_target_layers is set")
                ids = default_target_layer_ids(n_target, int(d["num_hidden_layers"]))
            if pick("mask_token_id") is None:
                raise ValueError("drafter config: mask_token_id is missing (dflash_config.mask_token_id or top level)")
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            return cls(hidden_size=hidden, num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=heads,
                       num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                       head_dim=int(d.get("head_dim") or hidden // heads),
                       intermediate_size=int(d["intermediate_size"]), vocab_size=int(d["vocab_size"]),
                       target_layer_ids=tuple(int(i) for i in ids), mask_token_id=int(pick("mask_token_id")),
                       block_size=int(pick("block_size", 16)), num_target_layers=n_target or max(ids) + 1,
                       rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(d.get("rope_theta", 10000.0)), rope_scaling=d.get("rope_scaling"), raw=d)
        except KeyError as e:
            raise ValueError(f"drafter config: missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"drafter config: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> DFlashConfig:
        return parse_config_file(path, cls.from_dict, "the drafter folder")
