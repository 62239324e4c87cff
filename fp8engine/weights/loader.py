"""Hugging Face tensor names -> the engine's parameters, and writing tensors into them in place.

The same path serves the initial load and `update_weights`: `resolve` finds where a tensor lands
(a fused shard, an FP8 weight or its scales, or a plain parameter), `check` validates it without
writing, `write` quantizes or copies it into the existing storage. A module that maps HF names itself
(the MoE experts) has `hf_target(name, rest)` and `hf_names()`; its tensors may land in several places
at once (a stacked [E, ...] tensor quantized per expert: a 'split' target).
"""

import glob
import json
import logging
import math
import os
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from fp8engine.weights import layout
from fp8engine.weights.quant import BLOCK, FP8_DTYPE, cdiv, dequantize_weight_blockwise, quantize_weight_into

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
KV_SCALE_NAME = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.self_attn\.(k|v|q)_scale$")
logger = logging.getLogger(__name__)
QuantizeInto = Callable[..., None]
BlockScales = Callable[[torch.Tensor, str | None], tuple[torch.Tensor, bool] | None]  # (scales, all finite)


@dataclass(slots=True, frozen=True)
class TPSlice:
    """Tensor parallelism: the part of a full HF tensor (shape `full`) that this rank holds, rows then columns (None:
    all of them)."""

    full: tuple[int, ...]
    rows: slice | None = None
    cols: slice | None = None

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            tensor = tensor[self.rows]
        return tensor if self.cols is None else tensor[:, self.cols]

    def block_rows(self) -> slice:
        """The rows of the whole 128-row blocks that hold this rank's rows (the full tensor's last block may be
        short)."""
        rows = self.rows or slice(0, self.full[0])
        return slice(rows.start - rows.start % BLOCK, min(self.full[0], cdiv(rows.stop, BLOCK) * BLOCK))


SKIPPED_KINDS = ("ignored", "elsewhere")  # what this model does not run, what another tensor-parallel rank holds


@dataclass(slots=True)
class Target:
    """Where one HF tensor lands. kind: 'dense', 'fp8_weight', 'fp8_scale', 'ignored' (a text engine skips it),
    'elsewhere' (another expert-parallel rank holds it, and validates and writes it), or 'split': parts holds
    (index into the incoming tensor, the target of that piece) and view the whole storage. mirror: a second
    target that every write also fills from the same tensor (a tied embedding's FP8 LM head). matrix, row0: for an
    FP8 weight or a whole 2-D parameter, the [N, K] matrix a linear reads that holds `view`, and the view's first
    row in it (layout.py: where the matrix is in the nt16 layout, writes and reads go through it)."""

    name: str
    kind: str
    view: torch.Tensor
    scale_view: torch.Tensor | None = None
    scale_fmt: str | None = None
    parts: list[tuple[tuple, "Target"]] | None = None
    mirror: "Target | None" = None
    matrix: torch.Tensor | None = None
    row0: int = 0
    tp: TPSlice | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the HF tensor (the full one under tensor parallelism, of which `view` holds a slice)."""
        return tuple(self.view.shape) if self.tp is None else self.tp.full


def iter_safetensors(model_dir: str, select: Callable[[str], bool] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in a directory's *.safetensors files (those `select` keeps)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir!r}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if select is None or select(name):
                    yield name, f.get_tensor(name)


def is_skipped(name: str) -> bool:
    return name.endswith(SKIPPED_SUFFIXES)


def is_kv_scale(name: str) -> bool:
    return KV_SCALE_NAME.match(name) is not None


def read_kv_scales(model_dir: str) -> dict[int, dict[str, float]]:
    """The KV scales a checkpoint holds: {layer index: {"k" | "v" | "q": scale}}."""
    scales: dict[int, dict[str, float]] = {}
    for name, tensor in iter_safetensors(model_dir, is_kv_scale):
        m = KV_SCALE_NAME.match(name)
        scales.setdefault(int(m[1]), {})[m[2]] = float(tensor.float().reshape(()))
    return scales


# Targets per model and name: parameters are never re-allocated, so a target's views stay valid, and
# finding one walks the module tree (a few microseconds per tensor, every weight update).
_TARGETS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Target]]" = weakref.WeakKeyDictionary()


def resolve(model: torch.nn.Module, name: str) -> Target:
    """The target of HF tensor `name`; ValueError if the model has no such tensor."""
    targets = _TARGETS.setdefault(model, {})
    target = targets.get(name)
    if target is None:
        target = targets[name] = _resolve(model, name)
    return target


def _resolve(model: torch.nn.Module, name: str) -> Target:
    if name.startswith(getattr(model, "ignored_prefixes", ())):  # what a text engine does not run (a VLM's vision)
        return Target(name, "ignored", torch.empty(0))
    alias = getattr(model, "hf_alias", None)
    if alias is not None:
        name = alias(name)
    tied = getattr(model, "tie_word_embeddings", False)
    if name == "lm_head.weight" and tied:
        name = "model.embed_tokens.weight"
    if name == "model.embed_tokens.weight" and tied and getattr(model.lm_head, "is_fp8", False):
        embedding = model.get_submodule("model.embed_tokens").weight
        head = _linear_target("lm_head.weight", model.lm_head, 0, "weight")
        return Target(name, "dense", embedding.data, mirror=head, matrix=embedding)
    for path, owner in _name_owners(model).items():
        if name.startswith(path + "."):
            return owner.hf_target(name, name[len(path) + 1:])
    module_path, _, attr = name.rpartition(".")
    shard = 0
    head, _, leaf = module_path.rpartition(".")
    if leaf in model.packed_modules:
        fused, shard = model.packed_modules[leaf]
        module_path = f"{head}.{fused}"
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        raise ValueError(f"unknown weight name {name!r}: the model has no module {module_path!r}") from None
    if hasattr(module, "shard_views"):  # a (fused) linear layer, layers/linear.py
        return _linear_target(name, module, shard, attr)
    param = getattr(module, attr, None)
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"unknown weight name {name!r}: {module_path!r} has no tensor {attr!r}")
    rows = getattr(module, "row_slices", {}).get(attr)  # a tensor-parallel rank's rows (an untied LM head's)
    tp = None if rows is None else TPSlice((rows[2], *param.shape[1:]), slice(rows[0], rows[1]))
    return Target(name, "dense", param.data, matrix=param if param.dim() == 2 else None, tp=tp)


_OWNERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]]" = weakref.WeakKeyDictionary()


def _name_owners(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules that map the HF names under their path themselves (`hf_target`), by path."""
    owners = _OWNERS.get(model)
    if owners is None:
        owners = _OWNERS[model] = {path: m for path, m in model.named_modules() if hasattr(m, "hf_target")}
    return owners


def _linear_target(name: str, layer, shard: int, attr: str) -> Target:
    weight, scale = layer.shard_views(shard)
    rows, cols = _tp_ranges(layer, shard)
    if attr == "bias" and layer.bias is not None:
        start, size = layer.shard_offsets[shard], layer.shard_sizes[shard]
        tp = None if rows is None else TPSlice((rows[2],), slice(rows[0], rows[1]))
        return Target(name, "dense", layer.bias.data[start:start + size], tp=tp)
    tp = None if rows is None and cols is None else TPSlice(
        ((rows or (0, 0, weight.shape[0]))[2], (cols or (0, 0, weight.shape[1]))[2]),
        None if rows is None else slice(rows[0], rows[1]), None if cols is None else slice(cols[0], cols[1]))
    if attr == "weight":
        if layer.is_fp8:
            return Target(name, "fp8_weight", weight.data, scale.data, layer.scale_fmt, matrix=layer.weight,
                          row0=layer.shard_offsets[shard], tp=tp)
        return Target(name, "dense", weight.data, matrix=layer.weight, row0=layer.shard_offsets[shard], tp=tp)
    if attr == "weight_scale_inv" and layer.is_fp8:
        if tp is not None:  # in 128 x 128 blocks: those the rank's rows and columns touch
            tp = TPSlice((cdiv(tp.full[0], BLOCK), cdiv(tp.full[1], BLOCK)),
                         None if rows is None else slice(tp.block_rows().start // BLOCK, cdiv(rows[1], BLOCK)),
                         None if cols is None else slice(cols[0] // BLOCK, cdiv(cols[1], BLOCK)))
        return Target(name, "fp8_scale", scale.data, tp=tp)
    raise ValueError(f"unknown weight name {name!r}: this linear layer has no {attr!r}"
                     + ("" if layer.is_fp8 else " (the engine runs it unquantized)"))


def _tp_ranges(layer, shard: int) -> tuple[tuple[int, int, int] | None, tuple[int, int, int] | None]:
    """(start, stop, full) of the rows and of the columns of the full weight that a tensor-parallel linear's shard
    holds (None: all of them, as at one rank)."""
    rows = cols = None
    if layer.tp_rows is not None:
        start, full = layer.tp_rows[shard]
        rows = (start, start + layer.shard_sizes[shard], full)
    if layer.tp_cols is not None:
        start, full = layer.tp_cols
        cols = (start, start + layer.in_features, full)
    return rows, cols


def check(target: Target, tensor: torch.Tensor, block_scales: BlockScales | None = None):
    """Validate a tensor for its target without writing anything.

    With `block_scales` (the quantizer's scale pass), a float tensor bound for an FP8 weight is checked
    through its block scales, which are returned for `write` to reuse (a list of them, one per part, for
    a split target); otherwise returns None."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"weight {target.name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if target.kind in SKIPPED_KINDS:
        return None
    if tuple(tensor.shape) != target.shape:
        raise ValueError(f"weight {target.name!r}: shape {tuple(tensor.shape)} does not match the "
                         f"model's {target.shape}")
    if target.kind == "split":
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"weight {target.name!r}: dtype {tensor.dtype} not accepted here (expected one of "
                             f"{[str(d) for d in FLOAT_DTYPES]}; pre-quantized experts come per expert, as "
                             f"experts.{{e}}.<proj>.weight with its weight_scale_inv)")
        return [check(part, tensor[index], block_scales) for index, part in target.parts]
    allowed = _allowed_dtypes(target)
    if tensor.dtype == FP8_DTYPE and target.kind == "dense":
        raise ValueError(f"weight {target.name!r} is pre-quantized (float8_e4m3fn) but the engine runs "
                         f"this layer unquantized; use EngineConfig(quantization='fp8')")
    if tensor.dtype not in allowed:
        raise ValueError(f"weight {target.name!r}: dtype {tensor.dtype} not accepted here "
                         f"(expected one of {[str(d) for d in allowed]})")
    if block_scales is not None and target.kind == "fp8_weight" and tensor.dtype != FP8_DTYPE and target.tp is None:
        result = block_scales(tensor, target.scale_fmt)
        if result is not None:
            scales, finite = result
            if not finite:
                raise ValueError(f"weight {target.name!r}: contains NaN or Inf values")
            return scales
    low, high = _min_max(tensor)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"weight {target.name!r}: contains NaN or Inf values")
    if target.kind == "fp8_scale" and not low > 0:
        raise ValueError(f"weight {target.name!r}: scales must be positive")
    return None


def _min_max(tensor: torch.Tensor) -> tuple[float, float]:
    """One pass, no temporaries; NaN and +-Inf propagate into the result."""
    if tensor.numel() == 0:
        return 0.0, 0.0
    tensor = tensor.detach()  # a trainer's parameter may require grad
    low, high = torch.aminmax(tensor.float() if tensor.dtype == FP8_DTYPE else tensor)
    return float(low), float(high)


def _allowed_dtypes(target: Target) -> tuple[torch.dtype, ...]:
    if target.kind == "fp8_weight":
        return FLOAT_DTYPES + (FP8_DTYPE,)
    if target.kind == "fp8_scale":
        return (torch.float32,)
    return FLOAT_DTYPES


def write(target: Target, tensor: torch.Tensor, quantize_into: QuantizeInto = quantize_weight_into,
          scales: torch.Tensor | None = None) -> bool:
    """Write into the target's storage in place; True when the tensor was quantized. scales: what
    `check` returned (block scales computed while validating), passed on to the quantizer."""
    if target.kind in SKIPPED_KINDS:
        return False
    tensor = tensor.to(target.view.device)
    if target.kind == "split":
        for (index, part), part_scales in zip(target.parts, scales or [None] * len(target.parts)):
            write(part, tensor[index], quantize_into, part_scales)
        return True
    if target.tp is not None:
        return _write_slice(target, tensor, quantize_into)
    if target.kind == "fp8_weight" and tensor.dtype != FP8_DTYPE:
        extra = {} if scales is None else {"scales": scales}
        with layout.as_rows(target.matrix, target.row0, target.view.shape[0]):
            quantize_into(tensor, target.view, target.scale_view, scale_fmt=target.scale_fmt, **extra)
        return True
    with layout.as_rows(target.matrix, target.row0, target.view.shape[0]):
        target.view.copy_(tensor)
    return target.mirror is not None and write(target.mirror, tensor, quantize_into)


def _write_slice(target: Target, tensor: torch.Tensor, quantize_into: QuantizeInto) -> bool:
    """A tensor-parallel rank's write: its slice of the full tensor. A float weight bound for FP8 is quantized over
    the whole 128-row blocks its rows sit in (the unsharded layer's blocks, so the same scales), then cut."""
    tp, rows = target.tp, target.view.shape[0]
    if target.kind == "fp8_weight" and tensor.dtype != FP8_DTYPE:
        blocks = tp.block_rows()
        part = (tensor[blocks] if tp.cols is None else tensor[blocks, tp.cols]).contiguous()
        codes = torch.empty(part.shape, dtype=FP8_DTYPE, device=target.view.device)
        quantize_into(part, codes, target.scale_view, scale_fmt=target.scale_fmt)
        first = (tp.rows.start if tp.rows is not None else 0) - blocks.start
        with layout.as_rows(target.matrix, target.row0, rows):
            target.view.copy_(codes[first:first + rows])
        return True
    with layout.as_rows(target.matrix, target.row0, rows):
        target.view.copy_(tp.take(tensor))
    return False


def load_checkpoint(model: torch.nn.Module, model_dir: str, quantize_into: QuantizeInto = quantize_weight_into,
                    block_scales: BlockScales | None = None) -> None:
    """Load every tensor of a Hugging Face directory; each model tensor must be covered. Pre-quantized FP8
    tensors (`weight` E4M3 + `weight_scale_inv`) are copied as they are."""
    check_quantization_config(model, model_dir)
    seen, ignored = set(), set()
    for name, tensor in iter_safetensors(model_dir, lambda n: not (is_skipped(n) or is_kv_scale(n))):
        target = resolve(model, name)
        if target.kind == "ignored":
            ignored.add(next(p for p in model.ignored_prefixes if name.startswith(p)))
            continue
        if target.kind == "elsewhere":
            continue
        write(target, tensor, quantize_into, check(target, tensor, block_scales))
        seen.update(covered(target))
    if ignored:
        logger.info("skipped the checkpoint's %s tensors: a text engine does not use them",
                    ", ".join(p + "*" for p in sorted(ignored)))
    missing = [n for n in expected_names(model) if n not in seen and n != "lm_head.weight"]
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_dummy(model: torch.nn.Module, quantize_into: QuantizeInto = quantize_weight_into, seed: int = 0) -> None:
    """Random weights for every tensor the model needs (normal * 0.02, norms 1, biases 0), drawn on the weights'
    device after torch.manual_seed(seed) and written through the same targets as a checkpoint (FP8 layers quantize
    them): a model of a config's shape without its weights, for benchmarks (an 8B model's in seconds on a GPU)."""
    torch.manual_seed(seed)
    for name in expected_names(model):
        target = resolve(model, name)
        dtype = target.view.dtype if target.view.dtype in FLOAT_DTYPES else torch.bfloat16
        tensor = torch.empty(target.shape, dtype=dtype, device=target.view.device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith("bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, 0.02)
        write(target, tensor, quantize_into)


def check_quantization_config(model: torch.nn.Module, model_dir: str) -> None:
    """A checkpoint quantized by its config.json loads only as 128 x 128 block FP8 with dynamic activation
    scales (the Hugging Face / DeepSeek-V3 layout) into a model built FP8; ValueError otherwise."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return
    method, block = qc.get("quant_method"), qc.get("weight_block_size")
    if method != "fp8" or block is None or list(block) != [128, 128]:
        raise ValueError(f"unsupported checkpoint quantization in {model_dir!r}: quant_method={method!r}, "
                         f"weight_block_size={block!r}; only FP8 with 128 x 128 weight blocks loads")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"unsupported checkpoint quantization in {model_dir!r}: activation_scheme="
                         f"{qc['activation_scheme']!r} (the engine quantizes activations per token, 'dynamic')")
    if not any(p.dtype == FP8_DTYPE for p in model.parameters()):
        raise ValueError(f"checkpoint {model_dir!r} is FP8-quantized (quantization_config); "
                         f"use EngineConfig(quantization='fp8')")


def covered(target: Target) -> list[str]:
    """The names (as expected_names gives them) of the weights that a write of target fills."""
    if target.kind in SKIPPED_KINDS:
        return []
    if target.kind == "split":
        return [part.name for _, part in target.parts]
    return [target.name.removesuffix("_scale_inv") if target.kind == "fp8_scale" else target.name]


def expected_names(model: torch.nn.Module) -> list[str]:
    """The HF names of every weight the model needs (fused layers expanded into their shards)."""
    inverse = {}
    for hf, (fused, shard) in model.packed_modules.items():
        inverse.setdefault(fused, {})[shard] = hf
    names, owners = [], []
    for module_name, module in model.named_modules():
        if any(module_name.startswith(owner + ".") for owner in owners):
            continue  # named by the module above it that maps its names (hf_names)
        if hasattr(module, "hf_names"):
            names += [f"{module_name}.{n}" for n in module.hf_names()]
            owners.append(module_name)
            continue
        params = [n for n, _ in module.named_parameters(recurse=False) if n != "weight_scale_inv"]
        head, _, leaf = module_name.rpartition(".")
        for attr in params:
            if leaf in inverse:
                names += [f"{head}.{hf}.{attr}" for _, hf in sorted(inverse[leaf].items())]
            else:
                names.append(f"{module_name}.{attr}")
    if getattr(model, "tie_word_embeddings", False):
        names = [n for n in names if n != "lm_head.weight"]
    return names


def read(target: Target, dtype: torch.dtype) -> torch.Tensor:
    """The target's weight as the model uses it, in the HF shape: FP8 dequantized to `dtype`, else a copy."""
    if target.kind == "ignored":
        raise ValueError(f"weight {target.name!r}: the engine does not hold it (a text engine skips it)")
    if target.kind == "elsewhere":
        raise ValueError(f"weight {target.name!r}: another expert-parallel rank holds it")
    if target.kind == "split":
        out = torch.empty(target.shape, dtype=dtype, device=target.view.device)
        for index, part in target.parts:
            out[index] = read(part, dtype)
        return out if target.tp is None or target.tp.rows is None else out[target.tp.rows]  # an expert-parallel rank's
    rows = target.view.shape[0] if target.view.dim() else 0
    if target.kind == "fp8_weight":
        codes = target.view if target.matrix is None else layout.rows_of(target.matrix, target.row0, rows)
        phase = 0 if target.tp is None or target.tp.rows is None else target.tp.rows.start % BLOCK
        return dequantize_weight_blockwise(codes, target.scale_view, dtype, row_phase=phase)
    if target.matrix is not None:
        return layout.rows_of(target.matrix, target.row0, rows).clone()
    return target.view.clone()
