"""In-place weight updates: stage (validate everything), then commit (write into existing storage).

Staging keeps references to the incoming tensors and writes nothing, so an unknown name, a wrong
shape or dtype, a NaN, or an iterable that raises halfway leaves the engine exactly as it was.
The commit quantizes or copies each tensor into the parameter storage the engine already has:
no parameter is re-allocated and no second copy of the model is made.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from fp8engine.weights.loader import (FLOAT_DTYPES, KV_SCALE_NAME, BlockScales, Target, check, covered, is_skipped,
                                      resolve, write)
from fp8engine.weights.quant import FP8_DTYPE


@dataclass(slots=True)
class Staged:
    items: list[tuple[Target, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # + block scales
    num_bytes: int = 0
    kv_scales: dict[int, dict[str, float]] = field(default_factory=dict)


def stage(model: torch.nn.Module, weights, kv_scales, block_scales: BlockScales | None = None) -> Staged:
    """Validate every (hf_name, tensor) of `weights` against the model; nothing is written.

    kv_scales: what takes the KV scales (model.layers.{i}.self_attn.{k,v,q}_scale): its
    attention_index(name, decoder layer) and check_scale_tensor(name, layer, tensor) map and check it or raise
    ValueError (kvcache's KVScaleManager).

    block_scales: the quantizer's scale pass; FP8-bound tensors are then validated through their block
    scales, which the commit reuses instead of computing them again."""
    staged = Staged()
    for entry in entries(weights):
        name, tensor = unpack(entry)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        staged.num_bytes += tensor.numel() * tensor.element_size()
        kv_scale = KV_SCALE_NAME.match(name)
        if kv_scale is not None:
            layer, which = kv_scales.attention_index(name, int(kv_scale[1])), kv_scale[2]
            staged.kv_scales.setdefault(layer, {})[which] = kv_scales.check_scale_tensor(name, layer, tensor)
        elif not is_skipped(name):
            target = resolve(model, name)
            staged.items.append((target, tensor, check(target, tensor, block_scales)))
    _check_prequantized_pairs(staged.items)
    return staged


def commit(staged: Staged, quantize_into) -> int:
    """Write staged tensors into place; returns how many were quantized."""
    return sum(write(target, tensor, quantize_into, scales) for target, tensor, scales in staged.items)


def covered_names(staged: Staged) -> set[str]:
    """The model's weights (expected_names' names) that committing staged writes."""
    return {name for target, _, _ in staged.items for name in covered(target)}


def entries(weights, what: str = "weights") -> Iterable:
    """A mapping's items, or the iterable of (name, tensor) pairs as it is; ValueError naming `what` otherwise."""
    if isinstance(weights, Mapping):
        return weights.items()
    if isinstance(weights, (str, bytes, torch.Tensor)) or not isinstance(weights, Iterable):
        raise ValueError(f"{what} must be a mapping or an iterable of (name, tensor) pairs, "
                         f"got {type(weights).__name__}")
    return weights


def unpack(entry) -> tuple[str, torch.Tensor]:
    if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
        raise ValueError(f"each weight must be a (name, tensor) pair, got {entry!r:.80}")
    return entry


def _check_prequantized_pairs(items: list[tuple[Target, torch.Tensor, torch.Tensor | None]]) -> None:
    fp8_weights = {t.name for t, x, _ in items if t.kind == "fp8_weight" and x.dtype == FP8_DTYPE}
    scales = {t.name.removesuffix("_scale_inv") for t, _, _ in items if t.kind == "fp8_scale"}
    for name in sorted(fp8_weights - scales):
        raise ValueError(f"weight {name!r} is pre-quantized (float8_e4m3fn) but "
                         f"{name}_scale_inv is missing from the update")
    for name in sorted(scales - fp8_weights):
        raise ValueError(f"{name}_scale_inv given without its float8_e4m3fn weight {name!r}")


class Prequantizer:
    """For a receive path that holds everything it received until the update commits (the weight-update group):
    each float tensor bound for an FP8 weight is validated (loader.check, as staging does) and quantized as it
    arrives, into new E4M3 codes and block scales (what the commit would write: the engine's own quantizer, with
    the scales check computed), and handed on as a pre-quantized pair, so about half the bytes wait for the commit
    instead of the BF16 model. Anything else passes as it is, and so does a tensor check refuses, which staging
    then refuses by its name. `count`: tensors quantized; `bytes_in`: bytes received."""

    def __init__(self, model: torch.nn.Module, quantize_into, block_scales: BlockScales | None = None):
        self.model, self.quantize_into, self.block_scales = model, quantize_into, block_scales
        self.count = self.bytes_in = 0

    def __call__(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        self.bytes_in += tensor.numel() * tensor.element_size()
        if is_skipped(name) or KV_SCALE_NAME.match(name) or tensor.dtype not in FLOAT_DTYPES:
            return [(name, tensor)]
        try:
            target = resolve(self.model, name)
            if target.kind != "fp8_weight":
                return [(name, tensor)]
            block_scales = check(target, tensor, self.block_scales)
        except ValueError:  # staging names it
            return [(name, tensor)]
        codes, scales = torch.empty_like(target.view), torch.empty_like(target.scale_view)
        extra = {} if block_scales is None else {"scales": block_scales}
        self.quantize_into(tensor.to(target.view.device), codes, scales, scale_fmt=target.scale_fmt, **extra)
        self.count += 1
        return [(name, codes), (f"{name}_scale_inv", scales)]
