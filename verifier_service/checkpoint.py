"""Load a Kimi K2.x / DeepSeek-V3 target from a Hugging Face folder into `KimiForCausalLM`.

Three steps, so that every user error surfaces before the device is touched:
1. plan (`plan_target`): derive the expected tensors from config.json (`checkpoint_layout`), read only
   the safetensors headers, and check names, shapes, dtypes, the quantization of every module
   present in the files and the INT4 `weight_shape` values. Any problem raises `CheckpointError`
   naming the file and tensor.
2. build: `KimiForCausalLM` on the meta device, weights cast to the compute dtype (INT4 words stay
   int32, scales bf16, the router bias fp32), routed experts cut to this rank's range
   (`expert_parallel`), then allocated once on the device.
3. stream (`weight_stream`): tensors are copied in file order from the memory map straight into their
   final place (an expert's gate rows into `w13_packed[e, :I]` ...), with a progress bar on stderr.
With `ep_size > 1` a rank reads only the experts it holds (contiguous range, see expert_parallel).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verifier_service.checkpoint_layout import LayoutTensor, target_layout
from verifier_service.config import KimiConfig
from verifier_service.expert_parallel import expert_range, shard_experts
from verifier_service.model import KimiForCausalLM
from verifier_service.moe import MoE
from verifier_service.safetensors_io import INDEX, CheckpointError, ShardedReader, TensorInfo
from verifier_service.weight_stream import Copy, Progress, stream_copies

FLOATS = ("BF16", "F16", "F32", "F64")
ALLOWED = {"packed": ("I32",), "scale": ("BF16",), "shape": ("I32", "I64"), "router_bias": FLOATS}
QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")


def expert_name(cfg: KimiConfig, layer: int, e: int, proj: str, part: str) -> str:
    return f"{cfg.tensor_prefix}model.layers.{layer}.mlp.experts.{e}.{proj}.{part}"


@dataclass(frozen=True)
class LoadPlan:
    cfg: KimiConfig
    experts: range  # this rank's routed experts (global ids)
    items: list[tuple[LayoutTensor, TensorInfo]]  # tensors to copy, with their place in the files
    skipped: int  # text-model tensors in the files that this rank does not need (other ranks' experts)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for _, i in self.items)


@dataclass(frozen=True)
class LoadReport:
    tensors: int
    bytes: int
    seconds: float
    files: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def _where(reader: ShardedReader, name: str) -> str:
    return str(reader.file_of(name)) if name in reader else str(reader.index_path)


def _check_quantized_modules(cfg: KimiConfig, reader: ShardedReader, layout: list[LayoutTensor]) -> None:
    """A module stored quantized in the files must be a routed expert that the config quantizes."""
    known = {t.name for t in layout}
    modules = {t.module: t for t in layout}
    for name in reader.keys():
        if name in known or not name.endswith(QUANT_SUFFIXES):
            continue
        mod, part = name.rsplit(".", 1)
        t = modules.get(mod)
        if t is None:
            continue  # not part of this text model (vision tower, MTP layer, layers beyond num_hidden_layers)
        if part in ("weight_zero_point", "weight_g_idx"):
            why = "asymmetric or act-order INT4 is not supported"
        elif t.kind == "expert":
            why = "config.json has no quantization_config for the routed experts (or ignores them)"
        else:
            why = ("only routed experts may be INT4 (quantized attention, dense, shared-expert or lm_head weights "
                   "are not supported)")
        raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r}: module {mod} is quantized in the files, "
                              f"but {why}")


def plan_target(cfg: KimiConfig, reader: ShardedReader, ep_rank: int = 0, ep_size: int = 1,
                check_values: bool = True) -> LoadPlan:
    """Validate the files against the config (headers only, plus the tiny weight_shape tensors)."""
    try:
        layout = target_layout(cfg)
        experts = expert_range(cfg.n_routed_experts, ep_rank, ep_size)
    except ValueError as e:
        raise CheckpointError(f"{reader.folder / 'config.json'}: {e}") from None
    _check_quantized_modules(cfg, reader, layout)
    items: list[tuple[LayoutTensor, TensorInfo]] = []
    shape_checks: list[tuple[LayoutTensor, TensorInfo]] = []
    skipped = 0
    for t in layout:
        if t.expert is not None and t.expert not in experts:
            skipped += 1
            continue
        if t.name not in reader:
            hint = ""
            alt = t.name.removeprefix(cfg.tensor_prefix) if cfg.tensor_prefix else "language_model." + t.name
            if alt in reader:
                hint = f" (the files hold {alt!r}: is config.json from another layout?)"
            elif t.name.endswith(".weight") and t.name + "_packed" in reader:
                hint = f" (the files hold {t.name + '_packed'!r}: quantized, but the config says bf16)"
            elif t.kind == "packed" and t.module + ".weight" in reader:
                hint = " (the files hold a bf16 .weight: not quantized, but the config says INT4)"
            raise CheckpointError(f"{reader.index_path}: tensor {t.name!r} is missing{hint}")
        info = reader.info(t.name)
        if info.shape != t.shape:
            raise CheckpointError(f"{info.file}: tensor {t.name!r} has shape {list(info.shape)}, expected "
                                  f"{list(t.shape)} from config.json")
        allowed = ALLOWED.get(t.kind, FLOATS)
        if info.dtype not in allowed:
            raise CheckpointError(f"{info.file}: tensor {t.name!r} has dtype {info.dtype}, expected "
                                  f"{' or '.join(allowed)}")
        (shape_checks if t.kind == "shape" else items).append((t, info))
    if check_values:
        for t, info in sorted(shape_checks, key=lambda x: (str(x[1].file), x[1].start)):
            got = [int(v) for v in reader.view(t.name)]
            if got != list(t.logical):
                raise CheckpointError(f"{info.file}: tensor {t.name!r} = {got}, but config.json implies "
                                      f"{list(t.logical)} (out, in)")
    return LoadPlan(cfg, experts, items, skipped)


def build_empty_target(cfg: KimiConfig, dtype: torch.dtype, device: str | torch.device,
                       ep_rank: int = 0, ep_size: int = 1) -> KimiForCausalLM:
    """The model allocated on `device` in its final dtypes, uninitialised, with this rank's experts."""
    with torch.device("meta"):
        model = KimiForCausalLM(cfg)
    for p in model.parameters():  # compute dtype for weights; INT4 buffers and the router bias keep theirs
        p.data = p.data.to(dtype)
    shard_experts(model, ep_rank, ep_size)
    return model.to_empty(device=device)


def _bind(plan: LoadPlan, model: KimiForCausalLM) -> list[Copy]:
    """Each planned tensor -> its destination view; every model tensor must be written."""
    cfg = plan.cfg
    dsts = dict(model.named_parameters()) | dict(model.named_buffers())
    copies, written = [], set()
    for t, info in plan.items:
        dst = dsts[t.dst]
        if t.expert is not None:
            dst = dst[t.expert - plan.experts.start, t.rows[0] : t.rows[1]]
        copies.append(Copy(t.name, info, dst))
        written.add(t.dst)
    if cfg.tie_word_embeddings:
        emb = next(i for t, i in plan.items if t.kind == "embed")
        copies.append(Copy(f"{cfg.tensor_prefix}model.embed_tokens.weight", emb, dsts["lm_head.weight"]))
        written.add("lm_head.weight")
    missing = sorted(set(dsts) - written)
    if missing:
        raise RuntimeError(f"internal: model tensors {missing[:5]} have no checkpoint source (layout out of date)")
    return copies


@torch.no_grad()
def load_target(folder: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                cfg: KimiConfig | None = None, *, ep_rank: int = 0, ep_size: int = 1, progress: bool | None = None,
                workers: int = 4) -> KimiForCausalLM:
    """Validate, then stream the checkpoint into a model on `device`. `progress` None = when stderr is a tty.

    The returned model carries `load_report` (tensors, bytes, seconds) and, per MoE, `expert_ids`.
    """
    folder = Path(folder)
    cfg = cfg or KimiConfig.from_file(folder)
    t0 = time.perf_counter()
    with ShardedReader(folder) as reader:
        plan = plan_target(cfg, reader, ep_rank, ep_size)
        model = build_empty_target(cfg, dtype, device, ep_rank, ep_size)
        copies = _bind(plan, model)
        label = f"loading {folder.name}" + (f" (experts {plan.experts.start}-{plan.experts.stop - 1})"
                                            if ep_size > 1 else "")
        stream_copies(reader, copies, Progress(sum(c.src.nbytes for c in copies), label, progress), workers)
        stats = reader.stats
    model.build_rope()  # rope tables were created on the meta device
    if torch.device(device).type == "cuda":
        for m in model.modules():
            if isinstance(m, MoE):
                m.repack_for_gpu(dtype=dtype)  # one-time repack into the INT4 kernel's layout
    model.load_report = LoadReport(stats.tensors, stats.bytes, time.perf_counter() - t0, len(stats.files))
    return model.eval()


def check_target_files(folder: str | Path, cfg: KimiConfig | None = None) -> LoadPlan:
    """Validate a target folder without loading it (what `ddtree inspect` runs when weights exist)."""
    folder = Path(folder)
    cfg = cfg or KimiConfig.from_file(folder)
    if not ((folder / INDEX).exists() or (folder / "model.safetensors").exists()):
        raise CheckpointError(f"{folder}: no weights ({INDEX} or model.safetensors)")
    with ShardedReader(folder) as reader:
        return plan_target(cfg, reader, check_values=False)
