"""LoRA adapters in PEFT's names -> the engine's LoRA buffers (model_executor/layers/lora.py), staged then committed.

An update replaces the whole adapter: the modules it names get their A and B (scaling folded into B), every
other module's adapter is cleared. Staging validates every tensor (name, shape, rank, dtype, finite values, both
halves present) and writes nothing; the commit writes into the existing buffers.
"""

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fp8engine.weights.loader import FLOAT_DTYPES
from fp8engine.weights.updater import entries, unpack

# get_peft_model_state_dict names: base_model.model.<hf module>.lora_A.weight (an in-memory state dict has the
# adapter's name before .weight: lora_A.default.weight)
_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight$")
Scaling = float | Mapping[str, float]


@dataclass(slots=True)
class StagedAdapter:
    """Per LoRA layer (by the engine's module path), per shard: (A [r, K], B [N_s, r], scaling)."""

    shards: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = field(default_factory=dict)
    num_tensors: int = 0
    num_bytes: int = 0


def stage_adapter(model: torch.nn.Module, loras: Mapping[str, torch.nn.Module], adapter, scaling: Scaling
                  ) -> StagedAdapter:
    """Validate a PEFT adapter (a mapping or an iterable of (name, tensor)) against the model's LoRA layers
    `loras` (module path -> LoRA); ValueError naming the tensor or module that is wrong, nothing written."""
    halves: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    staged = StagedAdapter()
    for entry in entries(adapter, "adapter"):
        name, tensor = unpack(entry)
        match = _NAME.match(name)
        if match is None:
            raise ValueError(f"LoRA tensor {name!r}: not a PEFT LoRA name (<module>.lora_A.weight or "
                             f"<module>.lora_B.weight)")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"LoRA tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        module, half = match["module"], match["half"]
        if half in halves.setdefault(module, {}):
            raise ValueError(f"LoRA tensor {name!r}: lora_{half} of {module!r} given twice")
        halves[module][half] = (name, tensor)
        staged.num_tensors += 1
        staged.num_bytes += tensor.numel() * tensor.element_size()
    for module, pair in halves.items():
        path, shard = _layer_path(model, loras, module)
        a, b = _check_pair(module, pair, loras[path], shard)
        for part in loras[path].module_shards(shard):
            staged.shards.setdefault(path, {})[part] = (a, b, _scaling(scaling, module))
    _check_finite([named for pair in halves.values() for named in pair.values()])
    return staged


def commit_adapter(loras: Mapping[str, torch.nn.Module], staged: StagedAdapter) -> None:
    """Write a staged adapter into the LoRA buffers (every layer it does not name is cleared). Only what changes
    is written: each shard's new A and B, and zeros where a larger rank or a dropped module had been."""
    for path, lora in loras.items():
        shards = staged.shards.get(path, {})
        for shard, old in enumerate(lora.ranks):
            a_rows, b_cols = lora.shard_views(shard)
            rank = 0
            if shard in shards:
                a, b, scale = shards[shard]
                a, b = lora.local(shard, a, b)
                rank = a.shape[0]
                a_rows[:rank].copy_(a)
                b_cols[:, :rank].copy_(b.float() * scale if scale != 1.0 else b)
            if old > rank:
                a_rows[rank:old].zero_()
                b_cols[:, rank:old].zero_()
            lora.set_rank(shard, rank)


def _layer_path(model: torch.nn.Module, loras: Mapping[str, torch.nn.Module], module: str) -> tuple[str, int]:
    alias = getattr(model, "hf_alias", None)  # a vision-language class's prefix (models/qwen3_5.py)
    head, _, leaf = (alias(module + ".") if alias is not None else module + ".")[:-1].rpartition(".")
    fused, shard = model.packed_modules.get(leaf, (leaf, 0))
    path = f"{head}.{fused}" if head else fused
    if path not in loras:
        raise ValueError(f"LoRA module {module!r}: the model has no linear there that takes an adapter (q/k/v/o "
                         f"and gate/up/down projections of the decoder layers, a GDN layer's in_proj_qkv, in_proj_z "
                         f"and out_proj; MoE experts take none)")
    return path, shard


def _check_pair(module: str, pair: dict[str, tuple[str, torch.Tensor]], lora, shard: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    for half in "AB":
        if half not in pair:
            raise ValueError(f"LoRA module {module!r}: lora_{half}.weight is missing (both halves come together)")
    (a_name, a), (b_name, b) = pair["A"], pair["B"]
    out_features, in_features = lora.full_shape(shard)
    if a.dim() != 2 or a.shape[1] != in_features:
        raise ValueError(f"LoRA tensor {a_name!r}: shape {tuple(a.shape)}, expected (rank, {in_features})")
    rank = a.shape[0]
    if not 1 <= rank <= lora.max_rank:
        raise ValueError(f"LoRA tensor {a_name!r}: rank {rank} is over the engine's max_lora_rank={lora.max_rank}"
                         if rank else f"LoRA tensor {a_name!r}: rank 0")
    if tuple(b.shape) != (out_features, rank):
        raise ValueError(f"LoRA tensor {b_name!r}: shape {tuple(b.shape)}, expected ({out_features}, {rank}) "
                         f"(its lora_A has rank {rank})")
    for name, tensor in ((a_name, a), (b_name, b)):
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"LoRA tensor {name!r}: dtype {tensor.dtype} not accepted here (expected one of "
                             f"{[str(d) for d in FLOAT_DTYPES]})")
    return a, b


def _check_finite(named: list[tuple[str, torch.Tensor]]) -> None:
    """NaN or Inf anywhere (max |x| of each tensor: NaN propagates; 4x faster here than isfinite(x).all()), the
    first bad tensor named."""
    if not named:
        return
    bad = (~torch.isfinite(torch.stack([t.abs().amax().float() for _, t in named]))).nonzero()
    if len(bad):
        raise ValueError(f"LoRA tensor {named[int(bad[0])][0]!r}: contains NaN or Inf values")


def _scaling(scaling: Scaling, module: str) -> float:
    value = scaling.get(module) if isinstance(scaling, Mapping) else scaling
    if value is None:
        raise ValueError(f"scaling: no value for LoRA module {module!r} (a mapping must name every module)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"scaling for LoRA module {module!r} must be a finite number, got {value!r}")
    return float(value)
