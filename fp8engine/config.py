"""EngineConfig: every engine option in one validated dataclass."""

import os
from dataclasses import dataclass

import torch

DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_KV_FRACTION = 0.85
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(slots=True)
class EngineConfig:
    """Engine options.

    model: "default" (bundled SmolLM2-135M-Instruct) or a Hugging Face model directory.
    dtype: model dtype, "bfloat16" or "float32".
    quantization: None (model dtype) or "fp8" (W8A8, 128x128 weight blocks, 1x128 activation groups).
    kv_cache_dtype: "auto" (model dtype) or "fp8_e4m3".
    kv_scale_mode: "recompute" | "external" | "static" (see ARCHITECTURE.md).
    kv_scale_margin: recompute mode multiplies the measured k/v amax by this before dividing by 448.
    block_size: tokens per KV block.
    kv_cache_memory_bytes / num_kv_blocks: KV budget; default 1 GiB on CPU, 85% of free memory on CUDA.
    """

    model: str = "default"
    dtype: str = "bfloat16"
    quantization: str | None = None
    fp8_scale_fmt: str | None = None
    kv_cache_dtype: str = "auto"
    kv_scale_mode: str = "recompute"
    kv_scale_margin: float = 1.2
    fp8_attention: bool = False
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self):
        _check_choice("dtype", self.dtype, _DTYPES)
        _check_choice("quantization", self.quantization, (None, "fp8"))
        _check_choice("fp8_scale_fmt", self.fp8_scale_fmt, (None, "ue8m0"))
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", "fp8_e4m3"))
        _check_choice("kv_scale_mode", self.kv_scale_mode, ("recompute", "external", "static"))
        _check_choice("device", self.device, ("auto", "cpu", "cuda"))
        if self.fp8_attention and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError("fp8_attention=True needs kv_cache_dtype='fp8_e4m3'")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive(name, getattr(self, name))
        for name in ("kv_cache_memory_bytes", "num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.kv_cache_memory_bytes is not None and self.num_kv_blocks is not None:
            raise ValueError("set at most one of kv_cache_memory_bytes and num_kv_blocks")
        if not self.kv_scale_margin >= 1.0:
            raise ValueError(f"kv_scale_margin must be >= 1.0, got {self.kv_scale_margin}")
        if self.model != "default" and not os.path.isdir(self.model):
            raise ValueError(f"model must be 'default' or a Hugging Face model directory; "
                             f"{self.model!r} is not a directory")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8_e4m3"


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
