"""The kernels one engine runs, chosen once when it starts: C++ on CPU, Triton on CUDA, the torch reference where
neither is there; batch invariant or not; the FP8ENGINE_* overrides (fp8engine/envs.py) read here and nowhere
else. The layers are given this object and call its functions; `names` is what get_stats() and the start-up
line report, so they name what runs.

Triton and the optional GPU libraries are imported only when the device is CUDA.
"""

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from fp8engine import envs
from fp8engine.config import EngineConfig
from fp8engine.model_executor import host_memory
from fp8engine.model_executor.kernels import attention_ref, cpu_ops, layer_ops_ref
from fp8engine.model_executor.layers import sampler
from fp8engine.weights import quant

logger = logging.getLogger(__name__)

# Keys per split-KV partition under batch_invariant: fixed, so a context splits the same way whatever
# else is in the batch (the adaptive split follows the batch's total keys).
BATCH_INVARIANT_KV_PARTITION = 512


@dataclass(frozen=True, slots=True)
class KernelSet:
    """Functions, each with the signature of its reference:

    dense_linear(x, weight, bias) -> y                       linears in the model dtype
    fp8_linear(x, w_q, w_scale_inv, bias, scale_fmt, scale_rows=None) -> y   block-FP8 W8A8 (None: not FP8)
    lm_head(hidden, weight) -> logits                        model dtype, or float32 when lm_head_fp32 (an FP8 head,
                                                             lm_head_fp8, runs fp8_linear instead)
    rms_norm(x, residual, weight, eps) -> (out, x + residual)
    rotary(q, k, cos, sin, positions) -> (q, k)              may rotate in place
    silu_and_mul(x) -> y
    lora_add(y, x, a, bt, segments) -> y                     y += (x A^T) B in place, bt = B^T (a LoRA adapter)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale,
                    fp8_q_scale) -> out
    fused_moe(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, scale_rows, scale_fmt) -> y, or None:
                                                             experts grouped over the linears above
    sample_rows: the fused sampler (the C++ op on CPU, sampler.sample_rows_torch on CUDA), or None (the torch
                 sampler alone)
    quantize_into(w, out_q, out_scale, scale_fmt=None[, scales=]) and block_scales(w, scale_fmt) (or None):
                                                             BF16 -> FP8 block quantization for loads and updates
    """

    batch_invariant: bool
    lm_head_fp32: bool
    dense_linear: Callable
    fp8_linear: Callable | None
    lm_head: Callable
    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    lora_add: Callable
    write_kv_cache: Callable
    paged_attention: Callable
    fused_moe: Callable | None
    sample_rows: Callable | None
    quantize_into: Callable
    block_scales: Callable | None
    attention_partition: int  # fixed split-KV partition in keys (0: adaptive), for the decoder plan
    gemms: tuple[str, str]  # (FP8, BF16) GEMM of the CPU kernels: "avx512" | "amx" | "avx2"; ("", "") elsewhere
    decoder_plan: bool  # the decoder layers may run as one C++ call (csrc/decoder.cpp)
    fp8_scale_rows: bool  # fp8_linear maps output rows to stacked scale grids (scale_rows) in one call
    huge_pages: bool  # the weights may move onto transparent huge pages (model_executor/host_memory.py)
    fp8_nt16: bool  # FP8 weights are stored in the nt16 layout, which fp8_linear reads (weights/layout.py)
    head_nt16: bool  # the (BF16) LM head's weight is stored in the nt16 layout, which lm_head reads
    dense_nt16: Callable | None  # dense_linear for a Linear layer's weight in the nt16 layout (None: rows only)
    names: dict[str, str] = field(default_factory=dict)
    # gdn_recurrent(q, k, v, g, beta, states, slots, query_start_loc) -> o: the gated delta rule's recurrent form on
    # prepared inputs, in place on the state pool (csrc/gated_delta.cpp, dense_triton.py); None: the torch references
    gdn_recurrent: Callable | None = None
    # The fused decoder-layer kernels on CUDA (kernels/fused_triton.py; None elsewhere or with FP8ENGINE_CUDA_FUSION=0):
    # norm_quant(x, residual, weight, eps, quant, normed, scale_fmt) -> (x_q, x_scale, x + residual, normed),
    # qkv_epilogue(qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slots, k_scale, v_scale, Hq, Hkv, D) -> q,
    # silu_mul_quant(x, quant, scale_fmt) -> (x_q, x_scale) or (h, None); fp8_gemm(x_q, x_scale, w_q, w_scale_inv,
    # out_dtype, bias) -> y: fp8_linear's GEMM on activations quantized by one of them; attention_quant(q, ...as
    # paged_attention..., fp8_q_scale, scale_fmt) -> (x_q, x_scale): attention's output quantized for an FP8 o_proj
    # in the attention launch itself
    norm_quant: Callable | None = None
    qkv_epilogue: Callable | None = None
    silu_mul_quant: Callable | None = None
    fp8_gemm: Callable | None = None
    attention_quant: Callable | None = None

    @property
    def linear_name(self) -> str:
        """The name of the linears' kernel: the FP8 one in an FP8 engine, else the model dtype's."""
        return self.names["fp8_linear" if self.fp8_linear is not None else "dense_linear"]


def select(config: EngineConfig) -> KernelSet:
    """The kernel set for this config on this machine (ValueError for an override it cannot honour)."""
    kernels = _cuda(config) if config.device == "cuda" else _cpu(config, cpu_ops.load_cpu_ops())
    if config.lm_head_fp8 and kernels.fp8_linear is not None:  # the head is an FP8 linear (layers/embedding.py)
        kernels.names["lm_head"] = f"fp8:{kernels.names['fp8_linear']}"
    return kernels


# ------------------------------------------------------------------------------------------------ CPU
def _gemm(ops, var: str) -> str:
    """The GEMM FP8ENGINE_FP8_GEMM / FP8ENGINE_BF16_GEMM asks for, "auto" resolved by this CPU."""
    choice = envs.get(var)
    usable = ops is not None and hasattr(ops, "amx_usable") and bool(ops.amx_usable())
    if choice == "amx" and not usable:
        raise ValueError(f"{var}=amx, but this build, CPU or OS does not allow AMX tiles (amx_bf16, amx_tile)")
    if choice == "amx" or (choice == "auto" and usable):
        return "amx"
    # Without AVX512-BF16 the C++ linears are the AVX2 ones (csrc/linear_common.h): "avx512" asks for them too.
    return "avx2" if ops is not None and hasattr(ops, "fp8_linear_isa") and ops.fp8_linear_isa() == "avx2" else "avx512"


def _cpu(config: EngineConfig, ops) -> KernelSet:
    from fp8engine.model_executor.kernels import attention_cpu, bf16_linear_cpu, fp8_linear_cpu, layer_ops_cpu
    has = (lambda name: ops is not None and hasattr(ops, name))  # noqa: E731
    bi = config.batch_invariant
    fp8_gemm, bf16_gemm = _gemm(ops, "FP8ENGINE_FP8_GEMM"), _gemm(ops, "FP8ENGINE_BF16_GEMM")
    chunked = envs.get("FP8ENGINE_BI_GEMM") == "chunked"
    fp32_tiles = envs.get("FP8ENGINE_FP32_HEAD") == "tiles"
    fused = envs.flag("FP8ENGINE_FUSED_DECODER")
    names = {}
    # On the AVX-512 BF16 kernels (not AVX2) the weights are stored in the nt16 layout, which nt reads without
    # transposing them (weights/layout.py): nt at every M up to 64, the GEMM above, batch invariant or not (a plain
    # engine then gives up the gemv at 1-4 rows, which nt16 matches, for nt16's 5-35% at 4-8 rows:
    # docs/exact-rollouts.md). On AMX tiles a batch-invariant engine's weights are nt16 too: up to a few rows nt16
    # in the tiles' order gives their bits without them, at one row in 0.6x (FP8) and 0.85x (BF16) their time, and
    # the tiles read the groups above (csrc/fp8_linear.cpp, bf16_linear.cpp); a plain one keeps rows and the gemv.
    nt16_kernels = has("fp8_linear_isa") and ops.fp8_linear_isa() == "avx512bf16" and envs.flag("FP8ENGINE_NT16")
    nt16_for = (lambda gemm: nt16_kernels and (gemm == "avx512" or (gemm == "amx" and bi)))  # noqa: E731

    fp8_linear, nt16 = None, False
    if config.quantization == "fp8":
        if has("fp8_block_linear"):
            nt16 = nt16_for(fp8_gemm)
            fp8_linear = functools.partial(fp8_linear_cpu.fp8_block_linear_cpu, batch_invariant=bi, gemm=fp8_gemm,
                                           nt16=nt16)
            names["fp8_linear"] = "cpp-amx" if fp8_gemm == "amx" else f"cpp-{ops.fp8_linear_isa()}"
            names["fp8_weights"] = "nt16" if nt16 else "rows"
        else:
            fp8_linear, names["fp8_linear"] = fp8_linear_ref, "torch-reference"

    bf16 = config.torch_dtype == torch.bfloat16
    if bf16 and bi and (chunked or not has("bf16_linear")):
        dense, names["dense_linear"] = bf16_linear_cpu.chunked_linear, "torch-bf16-fixed-chunks"
    elif bf16 and has("bf16_linear"):
        dense = functools.partial(bf16_linear_cpu.bf16_linear, batch_invariant=bi, gemm=bf16_gemm)
        names["dense_linear"] = (f"cpp-bf16-{bf16_gemm}" if bi or bf16_gemm == "avx2" else
                                 "cpp-bf16-gemv+amx+torch" if bf16_gemm == "amx" else "cpp-bf16-gemv+torch")
    else:
        dense, names["dense_linear"] = F.linear, "torch"

    if config.lm_head_fp32 and has("lm_head_f32"):
        split = fp32_tiles and bf16_gemm == "amx" and has("bf16_linear_terms_f32")
        lm_head = functools.partial(bf16_linear_cpu.float32_head, split=split, batch_invariant=bi)
        names["lm_head"] = ("fp32-tiles" if bi else "fp32-fma+tiles") if split else "fp32-fma"
    elif config.lm_head_fp32:
        lm_head, names["lm_head"] = layer_ops_ref.float32_linear_ref, "fp32-torch"
    else:
        lm_head, names["lm_head"] = (lambda x, w: dense(x, w, None)), names["dense_linear"]
    # The BF16 linears' and the head's weights in the nt16 layout too, which nt reads as it loads them
    bf16_nt16 = nt16_for(bf16_gemm) and bf16 and has("bf16_linear") and not chunked
    dense_nt16 = functools.partial(bf16_linear_cpu.bf16_linear, batch_invariant=bi, gemm=bf16_gemm,
                                   nt16=True) if bf16_nt16 else None
    head_nt16 = bf16_nt16 and not config.lm_head_fp32 and not config.lm_head_fp8
    if head_nt16:
        lm_head = functools.partial(dense_nt16, bias=None)
        names["lm_head_weights"] = "nt16"
    if bf16_nt16:
        names["dense_weights"] = "nt16"

    layer_ops = has("rms_norm") and has("rotary_embedding_") and has("silu_and_mul")
    if layer_ops:
        rms_norm, rotary, silu = layer_ops_cpu.rms_norm_cpu, layer_ops_cpu.rotary_cpu, layer_ops_cpu.silu_and_mul_cpu
    else:
        rms_norm, rotary, silu = layer_ops_ref.rms_norm_ref, layer_ops_ref.rotary_ref, layer_ops_ref.silu_and_mul_ref
    names["layer_ops"] = "cpp" if layer_ops else "torch"

    partition = 0
    if has("paged_attention"):  # the cache write is C++ with AVX-512, the reference on AVX2 (csrc/paged_attention.cpp)
        partition = BATCH_INVARIANT_KV_PARTITION if bi else 0
        write_kv = attention_cpu.write_kv_cache_cpu if has("write_kv_cache") else attention_ref.write_kv_cache_ref
        attend = functools.partial(attention_cpu.paged_attention_cpu, fixed_partition=partition)
        names["attention"] = "cpp"
    else:
        write_kv, attend = attention_ref.write_kv_cache_ref, attention_ref.paged_attention_ref
        names["attention"] = "torch"

    if config.quantization == "fp8" and has("fp8_block_linear"):
        quantize_into, block_scales = fp8_linear_cpu.quantize_weight_into_cpu, fp8_linear_cpu.block_scales_cpu
    else:
        quantize_into, block_scales = quant.quantize_weight_into, None
    sample_rows = ops.sample_rows if has("sample_rows") else None
    names["sampler"] = "cpp+torch" if sample_rows is not None else "torch"
    gdn = ops.gdn_recurrent_ if has("gdn_recurrent_") else None
    names["gated_delta"] = "cpp-recurrent" if gdn is not None else "torch"
    names["moe"] = "grouped"
    huge_pages = envs.flag("FP8ENGINE_HUGE_PAGES") and host_memory.available()

    decoder_plan = (fused and has("decoder_plan_supported")
                    and bool(ops.decoder_plan_supported()) and layer_ops and names["attention"] == "cpp")
    linear = names.get("fp8_linear", names["dense_linear"])
    if bi and (names["attention"] != "cpp" or linear in ("torch", "torch-reference")):
        raise ValueError(f"batch_invariant=True needs the C++ CPU kernels or the Triton ones, but linear runs on "
                         f"{linear!r} and attention on {names['attention']!r} (is a C++ compiler installed?)")
    if has("lora_add_"):
        lora_add, names["lora"] = layer_ops_cpu.lora_add_cpu, "cpp"
    else:
        lora_add, names["lora"] = functools.partial(layer_ops_ref.lora_add_dense, dense), "dense-linear"
    return KernelSet(bi, config.lm_head_fp32, dense, fp8_linear, lm_head, rms_norm, rotary, silu, lora_add,
                     write_kv, attend, None, sample_rows, quantize_into, block_scales, partition,
                     (fp8_gemm, bf16_gemm), decoder_plan, True, huge_pages, nt16, head_nt16, dense_nt16, names,
                     gdn_recurrent=gdn)


def fp8_linear_ref(x, w_q, w_scale_inv, bias=None, scale_fmt=None, scale_rows=None) -> torch.Tensor:
    """quant.fp8_block_linear_ref with the kernel set's argument order."""
    return quant.fp8_block_linear_ref(x, w_q, w_scale_inv, bias, scale_fmt=scale_fmt, scale_rows=scale_rows)


# ----------------------------------------------------------------------------------------------- CUDA
def _cuda(config: EngineConfig) -> KernelSet:
    try:
        from fp8engine.model_executor.kernels import (attention_triton, dense_triton, fp8_triton, fused_triton,
                                                      moe_triton, pdl)
    except ImportError as exc:
        raise ValueError(f"device='cuda' needs Triton (pip install 'fp8engine[gpu]'): {exc}") from exc
    device, bi = torch.device(config.device), config.batch_invariant
    names = {}
    fp8_linear = fp8_gemm = None
    if config.quantization == "fp8":
        deepgemm = not bi and _probed("DeepGEMM", fp8_triton.probe_deepgemm, device)
        fp8_linear = functools.partial(fp8_triton.fp8_block_linear_triton, batch_invariant=bi, deepgemm=deepgemm)
        fp8_gemm = functools.partial(fp8_triton.fp8_gemm_triton, batch_invariant=bi, deepgemm=deepgemm)
        names["fp8_linear"] = "deepgemm+triton" if deepgemm else "triton"
    fusion = envs.flag("FP8ENGINE_CUDA_FUSION")
    names["fusion"] = ("norm+qkv+attn+act" if config.quantization == "fp8" else "norm+qkv+act") if fusion else "off"
    names["pdl"] = "on" if pdl.configure(device) else "off"  # process-wide (kernels/pdl.py)
    tma = pdl.TMA_GEMM.configure(device)  # process-wide, as PDL
    names["tma_gemm"] = "on" if tma and config.quantization == "fp8" else "off"
    swap = pdl.SWAP_AB_GEMM.configure(device)  # process-wide, as PDL
    names["swap_ab_gemm"] = "on" if swap and config.quantization == "fp8" and not bi else "off"
    if bi:  # one launch configuration for every batch size
        dense, names["dense_linear"] = dense_triton.linear_triton, "triton-bf16"
        rms_norm, names["layer_ops"] = dense_triton.rms_norm_triton, "triton-norm+torch"
    else:
        dense, names["dense_linear"] = F.linear, "torch"
        rms_norm, names["layer_ops"] = layer_ops_ref.rms_norm_ref, "torch"
    if config.lm_head_fp32:  # the Triton GEMM reads the head in its dtype: no float32 copy of it per step
        lm_head = functools.partial(dense_triton.linear_triton, out_dtype=torch.float32)
        names["lm_head"] = "fp32-triton"
    else:
        lm_head, names["lm_head"] = (lambda x, w: dense(x, w, None)), names["dense_linear"]
    flashinfer = not bi and _probed("FlashInfer", attention_triton.probe_flashinfer, device)
    attend = functools.partial(attention_triton.paged_attention_triton, batch_invariant=bi, flashinfer=flashinfer)
    attend_quant = functools.partial(attention_triton.paged_attention_quant_triton, batch_invariant=bi,
                                     flashinfer=flashinfer)
    names["attention"] = "flashinfer+triton" if flashinfer else "triton"
    names["sampler"], names["moe"], names["gated_delta"] = "torch-fused+torch", "triton", "triton-recurrent"

    def quantize_into(w, out_q, out_scale, scale_fmt=None):
        fp8_triton.quantize_weight_blockwise_triton(w, out_q, out_scale, scale_fmt=scale_fmt)

    names["lora"] = "triton"
    return KernelSet(bi, config.lm_head_fp32, dense, fp8_linear, lm_head, rms_norm,
                     layer_ops_ref.rotary_ref, layer_ops_ref.silu_and_mul_ref,
                     dense_triton.lora_add_triton, attention_triton.write_kv_cache_triton,
                     attend, functools.partial(moe_triton.fused_moe_triton, batch_invariant=bi), _sample_rows_on_device,
                     quantize_into,
                     None, 0, ("", ""), False, False, False, False, False, None, names,
                     gdn_recurrent=dense_triton.gdn_recurrent_triton,
                     norm_quant=fused_triton.norm_quant if fusion else None,
                     qkv_epilogue=fused_triton.qkv_epilogue if fusion else None,
                     silu_mul_quant=fused_triton.silu_mul_quant if fusion else None, fp8_gemm=fp8_gemm,
                     attention_quant=attend_quant if fusion and fp8_gemm is not None else None)


def _sample_rows_on_device(logits, temperature, uniform, need_raw, forced=None):
    """The fused sampler's contract on the logits' device (sampler.sample_rows_torch), its host inputs copied
    there."""
    dev = logits.device
    return sampler.sample_rows_torch(logits, temperature.to(dev), uniform.to(dev), need_raw,
                                     None if forced is None else forced.to(dev))


def _probed(library: str, probe, device: torch.device) -> bool:
    """Whether an optional GPU library passed its start-up probe (a small call checked against the Triton
    kernel); when not, the engine says why once and runs Triton."""
    why = probe(device)
    if why is not None:
        logger.info("fp8engine: %s not used: %s; the Triton kernel runs instead", library, why)
    return why is None
