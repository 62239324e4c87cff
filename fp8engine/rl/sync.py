"""Trainer weights -> (hf_name, tensor) pairs in byte-bounded buckets, for a weight sync."""

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

DEFAULT_BUCKET_BYTES = 256 << 20
WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
TIED_PAIR = ("lm_head.weight", "model.embed_tokens.weight")
SCALE_SUFFIXES = ("_scale_inv", ".k_scale", ".v_scale", ".q_scale")  # kept in their dtype by a sync (cast_for_sync)

SyncDtype = torch.dtype | Literal["auto"] | None
Bucket = list[tuple[str, torch.Tensor]]


@dataclass(slots=True)
class SyncReport:
    """What one `sync_weights` did.

    seconds: wall time from reading the trainer's weights to the engine holding them (s).
    num_bytes: bytes sent, after the cast. num_tensors: tensors sent. num_buckets: buckets sent.
    """

    seconds: float
    num_bytes: int
    num_tensors: int
    num_buckets: int
    weight_version: int


def check_version(weight_version) -> int:
    if not isinstance(weight_version, int) or isinstance(weight_version, bool) or weight_version < 0:
        raise ValueError(f"weight_version must be an integer >= 0, got {weight_version!r}")
    return weight_version


def check_bucket_bytes(bucket_bytes) -> int:
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    return bucket_bytes


def named_tensors(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of a model or state dict: wrappers unwrapped, wrapper prefixes stripped.

    DDP / torch.compile wrappers are unwrapped. When torch.distributed is initialised (FSDP) the
    full state dict is gathered to rank 0's CPU: every rank must call this (the gather is
    collective) and ranks other than 0 get no tensors. A tied `lm_head.weight` that aliases
    `model.embed_tokens.weight` is skipped (the engine ties them itself).
    """
    state = _state_dict(model_or_state_dict)
    tensors = {_strip(name): t for name, t in state.items() if isinstance(t, torch.Tensor)}
    head, embed = (tensors.get(n) for n in TIED_PAIR)
    tied = head is not None and embed is not None and head.data_ptr() == embed.data_ptr()
    return ((name, t) for name, t in tensors.items() if not (tied and name == TIED_PAIR[0]))


def peft_adapter(model) -> tuple[dict[str, torch.Tensor], dict[str, float]] | None:
    """For a PEFT LoRA model: its active adapter's tensors in PEFT's saved names (get_peft_model_state_dict,
    detached, on the CPU) and each module's scaling (lora_alpha / r, rsLoRA's and per-module patterns included),
    keyed as the adapter names them; None for any other model."""
    if not (isinstance(model, nn.Module) and hasattr(model, "peft_config")):
        return None
    from peft import get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    tensors = {name: t.detach().to("cpu").contiguous()
               for name, t in get_peft_model_state_dict(model, adapter_name=adapter).items()}
    scaling = {_strip(name).removeprefix("base_model.model."): float(module.scaling[adapter])
               for name, module in model.named_modules() if isinstance(module, LoraLayer) and adapter in module.scaling}
    return tensors, scaling


def buckets(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
            dtype: torch.dtype | None, device: str | None = "cpu") -> Iterator[Bucket]:
    """Group tensors into buckets of about `bucket_bytes` (one tensor larger than that is its own).

    Each tensor is detached, cast to `dtype` where cast_for_sync casts (None keeps every dtype),
    moved to `device` (None: where it is) and made contiguous as its bucket fills, so a consumer
    that sends each bucket before taking the next holds one bucket of copies at a time.
    """
    bucket: Bucket = []
    size = 0
    for name, tensor in items:
        tensor = cast_for_sync(name, tensor.detach(), dtype)
        tensor = (tensor if device is None else tensor.to(device)).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def bucket_bytes_of(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def _state_dict(source: nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if isinstance(source, Mapping):
        return source
    if not isinstance(source, nn.Module):
        raise TypeError(f"model_or_state_dict must be an nn.Module or a mapping of name -> tensor, "
                        f"got {type(source).__name__}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(source, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    while isinstance(getattr(source, "module", None), nn.Module):
        source = source.module
    return getattr(source, "_orig_mod", source).state_dict()


def _strip(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def synced_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` travels in with sync dtype `dtype`: floating tensors cast to it, except what a cast would
    spoil: pre-quantized FP8 codes (1-byte floats: cast, they read as their unscaled E4M3 values) and the scales
    beside them and the KV cache's (`*_scale_inv`, `*.k_scale` / `v_scale` / `q_scale`: float32 values a bfloat16
    cast would round). Every sync path casts by it, and the broadcast paths announce it to the receiver."""
    if dtype is None or not tensor.is_floating_point() or tensor.element_size() == 1 or name.endswith(SCALE_SUFFIXES):
        return tensor.dtype
    return dtype


def cast_for_sync(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` in synced_dtype (itself where that is its dtype)."""
    return tensor.to(synced_dtype(name, tensor, dtype))
