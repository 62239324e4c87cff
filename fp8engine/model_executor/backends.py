"""Kernel choice at start-up: C++ on CPU, Triton on CUDA, the torch reference everywhere else.

Triton and the optional GPU libraries are imported only here, only when the device is CUDA.
"""

import functools
import logging
from types import SimpleNamespace

from fp8engine.config import EngineConfig
from fp8engine.weights import quant

logger = logging.getLogger(__name__)

# Keys per split-KV partition under batch_invariant: fixed, so a context splits the same way whatever
# else is in the batch (the adaptive split follows the batch's total keys).
BATCH_INVARIANT_KV_PARTITION = 512


def fp8_linear(config: EngineConfig):
    """(backend name, block-FP8 linear fn); with quantization off, the name of the model-dtype GEMM and None."""
    if config.quantization != "fp8":
        return _dense_linear_backend(config), None
    if config.device == "cuda":
        from fp8engine.model_executor.kernels import fp8_triton
        if config.batch_invariant:  # DeepGEMM picks its kernel by shape
            return "triton", _linear_with_scale_fmt(
                functools.partial(fp8_triton.fp8_block_linear_triton, batch_invariant=True))
        return ("deepgemm" if fp8_triton.deepgemm_available() else "triton"), _linear_with_scale_fmt(
            fp8_triton.fp8_block_linear_triton)
    from fp8engine.model_executor.kernels import fp8_linear_cpu
    linear = fp8_linear_cpu.fp8_block_linear_cpu
    if config.batch_invariant:
        linear = functools.partial(linear, batch_invariant=True)
    return fp8_linear_cpu.cpu_fp8_backend(), linear


def _dense_linear_backend(config: EngineConfig) -> str:
    """BF16 on CPU: the C++ GEMV for decode-sized batches (M <= 4; with AMX tiles M = 1, then the C++ GEMM on
    the tiles up to M = 256) and torch's GEMM above; when batch invariant, the C++ GEMM for every M (on AMX
    tiles or AVX-512, by CPU), or torch's GEMM in fixed-shape chunks (bf16_linear_cpu.chunked_gemm); on CUDA
    when batch invariant the Triton GEMM; torch otherwise."""
    if config.device == "cuda" and config.batch_invariant:
        return "triton-bf16"
    from fp8engine.model_executor.kernels import bf16_linear_cpu
    if config.device == "cpu" and config.dtype == "bfloat16" and bf16_linear_cpu.kernel_ops() is not None:
        if config.batch_invariant:
            if bf16_linear_cpu.chunked_gemm():
                return "torch-bf16-fixed-chunks"
            return f"cpp-bf16-{bf16_linear_cpu.kernel_gemm()}"
        return "cpp-bf16-gemv+amx+torch" if bf16_linear_cpu.kernel_gemm() == "amx" else "cpp-bf16-gemv+torch"
    return "torch"


def _linear_with_scale_fmt(fn):
    def linear(x, w_q, w_scale_inv, bias=None, scale_fmt=None):
        return fn(x, w_q, w_scale_inv, bias, scale_fmt=scale_fmt)
    return linear


def quantize_into(config: EngineConfig):
    """In-place BF16 -> FP8 block quantizer for loads and weight updates."""
    if config.device == "cuda":
        from fp8engine.model_executor.kernels import fp8_triton

        def triton_into(w, out_q, out_scale, scale_fmt=None):
            fp8_triton.quantize_weight_blockwise_triton(w, out_q, out_scale, scale_fmt=scale_fmt)
        return triton_into
    if config.quantization == "fp8":
        from fp8engine.model_executor.kernels import fp8_linear_cpu
        return fp8_linear_cpu.quantize_weight_into_cpu
    return quant.quantize_weight_into


def block_scales(config: EngineConfig):
    """(w, scale_fmt) -> (w's FP8 block scales, all finite) or None, for the quantizer that
    quantize_into(config) returns when it accepts them back (`scales=`); None when it does not."""
    if config.device == "cpu" and config.quantization == "fp8":
        from fp8engine.model_executor.kernels import fp8_linear_cpu
        return fp8_linear_cpu.block_scales_cpu
    return None


def attention(config: EngineConfig) -> SimpleNamespace:
    """An object with write_kv_cache(...) and paged_attention(...) and a `name`."""
    if config.device == "cuda":
        try:
            from fp8engine.model_executor.kernels import attention_triton
            attend = attention_triton.paged_attention_triton
            if config.batch_invariant:
                attend = functools.partial(attend, batch_invariant=True)
            return SimpleNamespace(name="triton", write_kv_cache=attention_triton.write_kv_cache_triton,
                                   paged_attention=attend)
        except ImportError as exc:
            logger.warning("fp8engine: Triton paged attention unavailable (%s); using the torch reference", exc)
    from fp8engine.model_executor.kernels import attention_cpu, attention_ref
    if config.device == "cpu" and attention_cpu.kernel_ops() is not None:
        attend = attention_cpu.paged_attention_cpu
        if config.batch_invariant:
            attend = functools.partial(attend, fixed_partition=BATCH_INVARIANT_KV_PARTITION)
        return SimpleNamespace(name="cpp", write_kv_cache=attention_cpu.write_kv_cache_cpu, paged_attention=attend)
    return SimpleNamespace(name="torch", write_kv_cache=attention_ref.write_kv_cache_ref,
                           paged_attention=attention_ref.paged_attention_ref)
