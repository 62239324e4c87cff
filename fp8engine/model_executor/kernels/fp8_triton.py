"""Triton kernels for W8A8 block FP8: activation / weight quantization and the block-scaled GEMM.

Numerics are those of fp8engine.weights.quant (the tests compare bit for bit): 1 x 128 activation
groups, 128 x 128 weight blocks, scale = max(amax, 1e-12) / 448 (optionally rounded up to a power of
two, "ue8m0"), x_q = E4M3(clamp(x / scale, +-448)) with IEEE division and round-to-nearest-even.
The GEMM multiplies each 128-wide K block on the tensor cores and applies both scales to that
partial sum in float32, as DeepSeek-V3 / DeepGEMM do.

Triton is imported only here and in attention_triton.py, both loaded lazily on CUDA. Under TRITON_INTERPRET=1
(CPU tensors) it runs on the Triton interpreter, whose float32 -> fp8 cast does not round correctly,
so there the kernels encode E4M3 with integer ops instead (_E4M3_BY_BITS).
"""


from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from fp8engine.model_executor.kernels import pdl
from fp8engine.weights.quant import BLOCK, FP8_DTYPE, cdiv


_E4M3_BY_BITS = bool(triton.knobs.runtime.interpret)


# ------------------------------------------------------------------------------------------ PDL (kernels/pdl.py)
@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """A PDL kernel's first access to memory comes after this: the kernel before it has completed, its writes
    visible (griddepcontrol.wait)."""
    if PDL:
        gdc_wait()


@triton.jit
def _prefetch_l2(ptrs, PDL: tl.constexpr):
    """Before a PDL kernel's wait: the 128-byte lines at `ptrs` (valid addresses, of what no kernel of the step
    writes) into L2."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _block_scale(amax, UE8M0: tl.constexpr):
    scale = tl.div_rn(tl.maximum(amax, 1e-12), 448.0)
    if UE8M0:
        # 2^ceil(log2(scale)) exactly: a non-zero mantissa carries into the exponent.
        bits = scale.to(tl.int32, bitcast=True)
        scale = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _e4m3_from_bits(y):
    """RNE float32 -> E4M3 with integer ops; y is already clamped to +-448."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: drop 20 mantissa bits with round-half-even, then rebias the exponent 127 -> 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range (< 2^-6): the code is |y| / 2^-9 rounded half-even by a float32 add.
    sub = (((tl.abs(y) + 16384.0) - 16384.0) * 512.0).to(tl.int32)
    code = tl.where(mag >= (121 << 23), normal, sub) | sign
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _quantize(x, scale, E4M3_BY_BITS: tl.constexpr):
    y = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
    if E4M3_BY_BITS:
        return _e4m3_from_bits(y)
    return y.to(tl.float8e4nv)  # round-to-nearest-even, the default for fp downcasts


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                        GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                        UE8M0: tl.constexpr, E4M3_BY_BITS: tl.constexpr, PDL: tl.constexpr = False):
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    lane = tl.arange(0, BLOCK_G)
    offs = group * GROUP + lane
    mask = (lane < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = _block_scale(tl.max(tl.abs(x)), UE8M0)
    tl.store(q_ptr + row * stride_qm + offs, _quantize(x, scale, E4M3_BY_BITS), mask=mask)
    tl.store(s_ptr + row * stride_sm + group, scale)


@triton.jit
def _weight_quant_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_wk, stride_qn, stride_qk,
                         stride_sn, stride_sk, BLOCK_W: tl.constexpr,
                         UE8M0: tl.constexpr, E4M3_BY_BITS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = (pid_n * BLOCK_W + tl.arange(0, BLOCK_W)).to(tl.int64)
    offs_k = pid_k * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    scale = _block_scale(tl.max(tl.abs(w)), UE8M0)
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] * stride_qk
    tl.store(q_ptrs, _quantize(w, scale, E4M3_BY_BITS), mask=mask)
    tl.store(s_ptr + pid_n * stride_sn + pid_k * stride_sk, scale)


@triton.jit
def _prefetch_then_wait(b_ptr, offs_n, mask_n, stride_bn, stride_bk, kb_begin, num_kb, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
    """A GEMM's PDL start: its weight rows' first two K blocks of its run (a 128-byte line a row each) into L2, then
    the wait for the kernel before (nothing without PDL)."""
    rows = b_ptr + tl.where(mask_n, offs_n, 0) * stride_bn
    _prefetch_l2(rows + kb_begin * BLOCK_K * stride_bk, PDL)
    _prefetch_l2(rows + tl.minimum(kb_begin + 1, num_kb - 1) * BLOCK_K * stride_bk, PDL)
    _pdl_wait(PDL)


@triton.jit
def _tile(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """A GEMM program's share: its K blocks [begin, end) of num_kb (program_id(2)'s run of a K split, else all), its
    rows and columns (int64) and their masks."""
    num_kb = tl.cdiv(K, BLOCK_K)
    kb_begin = 0
    kb_end = num_kb
    if SPLIT_K > 1:
        per_split = tl.cdiv(num_kb, SPLIT_K)
        kb_begin = tl.program_id(2) * per_split
        kb_end = tl.minimum(kb_begin + per_split, num_kb)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    return kb_begin, kb_end, num_kb, offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _w8a8_block_matmul_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                              stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_cs,
                              stride_asm, stride_ask, stride_bsn, stride_bsk,
                              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                              PDL: tl.constexpr = False):
    """SPLIT_K > 1: program (m, n, s) sums the s-th run of K blocks into float32 partials c[s] (no bias); the
    caller adds them up in a fixed order. SPLIT_K == 1 is the plain kernel (one program per output tile).
    PDL: its weight rows' first two K blocks (a 128-byte line a row each) go to L2 before the wait."""
    kb_begin, kb_end, num_kb, offs_m, offs_n, mask_m, mask_n = _tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (offs_k[None, :] + kb_begin * BLOCK_K) * stride_ak
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + (offs_k[:, None] + kb_begin * BLOCK_K) * stride_bk
    as_ptrs = as_ptr + offs_m * stride_asm
    _prefetch_then_wait(b_ptr, offs_n, mask_n, stride_bn, stride_bk, kb_begin, num_kb, BLOCK_K, PDL)
    # Weight scales are per 128 rows of W, and BLOCK_K == 128 is that block size.
    bs_ptrs = bs_ptr + (offs_n // BLOCK_K) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        mask_k = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_ask, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=mask_n, other=0.0)
        # A fresh dot per K block: Hopper's fp8 MMA accumulates with reduced precision, so it is
        # promoted into the float32 accumulator every 128 elements.
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if SPLIT_K > 1:
        c_ptrs += tl.program_id(2) * stride_cs
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w8a8_block_matmul_tma_kernel(a_desc, b_desc, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                                  stride_bn, stride_cm, stride_cn, stride_asm, stride_ask, stride_bsn, stride_bsk,
                                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """_w8a8_block_matmul_kernel (no K split) with its A and weight tiles copied by the tensor memory accelerator:
    a_desc / b_desc describe x_q [M, K] and w_q [N, K] in [BLOCK_M | BLOCK_N, BLOCK_K] boxes, whose rows and columns
    past the edges arrive as zeros (the masked loads' `other`). The same products and sums in the same order. PDL: as
    the pointer kernel, its weight rows' first two K blocks go to L2 before the wait (b_ptr: w_q's own address)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    _prefetch_then_wait(b_ptr, offs_n, mask_n, stride_bn, 1, 0, tl.cdiv(K, BLOCK_K), BLOCK_K, PDL)
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // BLOCK_K) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
        a_s = tl.load(as_ptrs + kb * stride_ask, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=mask_n, other=0.0)
        acc += tl.dot(a, b.T, out_dtype=tl.float32) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w8a8_block_matmul_swap_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                                   stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_cs,
                                   stride_asm, stride_ask, stride_bsn, stride_bsk,
                                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                                   PDL: tl.constexpr = False):
    """_w8a8_block_matmul_kernel with A and B swapped (FP8ENGINE_SWAP_AB_GEMM, a few rows): each K block multiplies
    the [BLOCK_N, BLOCK_K] weight tile by the activations' transpose, so the weights are the 64-row operand of
    Hopper's wgmma and a tile of BLOCK_M = 8 or 16 rows is its narrow side (m64n16k32 on E4M3 operands: no conversion
    of the weight codes, no tensor-core work on padding rows). The accumulator is the output tile's transpose; the
    same per-K-block promotion and scales, the same K split and partials."""
    kb_begin, kb_end, num_kb, offs_m, offs_n, mask_m, mask_n = _tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (offs_k[None, :] + kb_begin * BLOCK_K) * stride_ak
    w_ptrs = b_ptr + offs_n[:, None] * stride_bn + (offs_k[None, :] + kb_begin * BLOCK_K) * stride_bk
    as_ptrs = as_ptr + offs_m * stride_asm
    _prefetch_then_wait(b_ptr, offs_n, mask_n, stride_bn, stride_bk, kb_begin, num_kb, BLOCK_K, PDL)
    bs_ptrs = bs_ptr + (offs_n // BLOCK_K) * stride_bsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        mask_k = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_ask, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=mask_n, other=0.0)
        acc += tl.dot(w, tl.trans(a), out_dtype=tl.float32) * a_s[None, :] * b_s[:, None]
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None] * stride_cn
    if SPLIT_K > 1:
        c_ptrs += tl.program_id(2) * stride_cs
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


# Batch invariant: the same kernel, never specialised on M (Triton would fold M == 1 into the code), launched
# with one tile shape for every M. No split-K at all, so a row's sum runs over its K blocks in one order.
_w8a8_block_matmul_kernel_bi = triton.jit(do_not_specialize=["M"])(_w8a8_block_matmul_kernel.fn)
BATCH_INVARIANT_BLOCK_M = 64


def _ue8m0(scale_fmt: str | None) -> bool:
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"fp8 scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    return scale_fmt == "ue8m0"


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = BLOCK,
                              scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x[M, K] -> (x_q E4M3 [M, K], scale float32 [M, ceil(K / group_size)]) per 1 x group tile."""
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D, got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = cdiv(k, group_size)
    x_q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m and k:
        _group_quant_kernel[(m, groups)](
            x, x_q, scale, k, x.stride(0), x_q.stride(0), scale.stride(0),
            GROUP=group_size, BLOCK_G=triton.next_power_of_2(group_size), UE8M0=_ue8m0(scale_fmt),
            E4M3_BY_BITS=_E4M3_BY_BITS, num_warps=1, **pdl.launch_options())
    return x_q, scale


def quantize_weight_blockwise_triton(w: torch.Tensor, out_q: torch.Tensor | None = None,
                                     out_scale: torch.Tensor | None = None,
                                     scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W[N, K] -> (W_q E4M3 [N, K], scale_inv float32 [ceil(N/128), ceil(K/128)]), into out_* if given."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w.shape)}")
    n, k = w.shape
    grid = (cdiv(n, BLOCK), cdiv(k, BLOCK))
    if out_q is None:
        out_q = torch.empty(n, k, dtype=FP8_DTYPE, device=w.device)
    if out_scale is None:
        out_scale = torch.empty(grid, dtype=torch.float32, device=w.device)
    if out_q.shape != w.shape or out_q.dtype != FP8_DTYPE:
        raise ValueError(f"out_q must be {FP8_DTYPE} {tuple(w.shape)}, "
                         f"got {out_q.dtype} {tuple(out_q.shape)}")
    if out_scale.shape != grid or out_scale.dtype != torch.float32:
        raise ValueError(f"out_scale must be float32 {grid}, got {out_scale.dtype} {tuple(out_scale.shape)}")
    if n and k:
        _weight_quant_kernel[grid](
            w, out_q, out_scale, n, k, *w.stride(), *out_q.stride(), *out_scale.stride(),
            BLOCK_W=BLOCK, UE8M0=_ue8m0(scale_fmt), E4M3_BY_BITS=_E4M3_BY_BITS, num_warps=8)
    return out_q, out_scale


def w8a8_block_fp8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                          w_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                          bias: torch.Tensor | None = None, batch_invariant: bool = False,
                          partials: bool = False) -> torch.Tensor:
    """C[M, N] = sum_b (x_q . w_q^T)_b * x_scale[m, b] * w_scale_inv[n // 128, b], float32 accumulation.

    batch_invariant: one compiled kernel and tile shape for every M, so a row's result does not depend on
    the other rows (the default picks a 16-row tile for decode-sized M, another MMA shape on the GPU).
    partials: see w8a8_matmul_with."""
    m, k = x_q.shape
    n, k_w = w_q.shape
    nkb = cdiv(k, BLOCK)
    if k_w != k or x_scale.shape != (m, nkb) or w_scale_inv.shape != (cdiv(n, BLOCK), nkb):
        raise ValueError(f"shape mismatch: x_q {tuple(x_q.shape)}, x_scale {tuple(x_scale.shape)}, "
                         f"w_q {tuple(w_q.shape)}, w_scale_inv {tuple(w_scale_inv.shape)}")
    return w8a8_matmul_with(gemm_config(m, n, k, batch_invariant, partials and bias is None), x_q, x_scale, w_q,
                            w_scale_inv, out_dtype, bias,
                            batch_invariant, partials)


# GEMMs of more than 64 rows copy their tiles with TMA descriptors (_w8a8_block_matmul_tma_kernel) where
# pdl.TMA_GEMM is on (FP8ENGINE_TMA_GEMM=1, sm_90 and later), off until a device run has timed it against the pointer
# loads (benchmarks/gpu_perf.py's gemm section runs both).
def _tma_fits(x_q: torch.Tensor, w_q: torch.Tensor) -> bool:
    """A TMA descriptor's rules: rows contiguous, row strides and base addresses multiples of 16 bytes."""
    return all(t.stride(-1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (x_q, w_q))


def gemm_config(m: int, n: int, k: int, batch_invariant: bool, partials: bool = False) -> "GemmConfig":
    """The launch for M rows, N outputs and K inputs, from benchmarks/gpu_gemm_sweep.py and gpu_decode_tiles.py on an
    H200 (docs/gpu.md: 8B-shaped layers at 1-256 rows). Four pipeline stages everywhere (the weights stream from
    HBM). Decode-sized M takes 16-row tiles of 32 columns, so that a 4096-wide layer still spreads over 128
    programs, and 64 columns for wide layers; a deep layer (K >= 8192: an 8B's down_proj, 112 K blocks) splits K
    in 4 (under CUDA graphs 38 -> 23 us at 1-16 rows; at K = 4096 a split gained nothing). Batch invariant: the
    launch depends on N alone, never on M (64-row tiles; 64 columns, 128 for wide layers), and never splits K.
    FP8ENGINE_SWAP_AB_GEMM: up to 16 rows take _swap_config's launch (partials: whether the caller adds a K split's
    float32 partials itself, which lets that launch split more)."""
    if batch_invariant:
        return GemmConfig(BATCH_INVARIANT_BLOCK_M, 128 if n >= 16384 else 64, 1, 4, 4)
    if m <= 16 and pdl.SWAP_AB_GEMM.on:
        return _swap_config(m, n, k, partials)
    if m <= 16:
        return GemmConfig(16, 64 if n >= 16384 else 32, 4 if k >= 8192 else 1, 4, 4)
    return GemmConfig(64, 64 if m <= 64 else 128, 1, 4, 4, tma=pdl.TMA_GEMM.on and m > 64)


def _swap_config(m: int, n: int, k: int, partials: bool) -> "GemmConfig":
    """FP8ENGINE_SWAP_AB_GEMM's launch for at most 16 rows: 64 weight rows a program (wgmma's narrowest M), the rows
    in an 8- or 16-wide tile (its N), and the K split of the 16 x 32 launch for deep layers. A layer whose consumer
    adds K-split partials itself (`partials`: o_proj before the fused norm) and that would leave fewer than 128
    programs (an 8B's o_proj: 64) splits K in 2, so as many programs stream weights as with the 32-column tiles; one
    whose partials would take a reduce launch (qkv_proj) does not. On paper from the compiled code (docs/gpu.md);
    gpu_perf's gemm section times it."""
    split = 4 if k >= 8192 else 2 if partials and cdiv(n, 64) < 128 and cdiv(k, BLOCK) >= 4 else 1
    return GemmConfig(8 if m <= 8 else 16, 64, split, 4, 4, swap_ab=True)


class GemmConfig(NamedTuple):
    """A launch of the FP8 GEMM: tile rows and columns, K split (float32 partials added in a fixed order after),
    warps and pipeline stages."""
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    tma: bool = False  # A and weight tiles copied by TMA (no K split; where the tensors fit a descriptor)
    swap_ab: bool = False  # the weight tile as the MMA's 64-row operand, the rows as its narrow side


def w8a8_matmul_with(config: GemmConfig, x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                     w_scale_inv: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                     batch_invariant: bool = False, partials: bool = False) -> torch.Tensor:
    """w8a8_block_fp8_matmul with an explicit launch (benchmarks/gpu_gemm_sweep.py times them). partials: a K split's
    float32 partial sums [split, M, N] as they are, for a consumer that adds them in order (kernels/fused_triton.py's
    norm_quant), instead of adding them here (no bias then)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if BLOCK % config.block_n or (batch_invariant and (config.split_k != 1 or config.swap_ab)):
        raise ValueError(f"bad FP8 GEMM launch {config}: block_n must divide {BLOCK}; no K split or swapped operands "
                         f"when batch invariant")
    kernel = _w8a8_block_matmul_kernel_bi if batch_invariant else \
        _w8a8_block_matmul_swap_kernel if config.swap_ab else _w8a8_block_matmul_kernel
    split = max(1, min(config.split_k, cdiv(k, BLOCK)))
    keep_partials = split > 1 and partials and bias is None
    out = None if keep_partials else torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    dest = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x_q.device)
    grid = (cdiv(m, config.block_m), cdiv(n, config.block_n), split)
    if m and n and k and config.tma and split == 1 and not batch_invariant and _tma_fits(x_q, w_q):
        _w8a8_block_matmul_tma_kernel[grid[:2]](
            TensorDescriptor.from_tensor(x_q, [config.block_m, BLOCK]),
            TensorDescriptor.from_tensor(w_q, [config.block_n, BLOCK]), w_q, out, x_scale, w_scale_inv, bias, m, n, k,
            w_q.stride(0), out.stride(0), out.stride(1), *x_scale.stride(), *w_scale_inv.stride(),
            HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK,
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options())
    elif m and n:
        kernel[grid](
            x_q, w_q, dest, x_scale, w_scale_inv, bias, m, n, k,
            *x_q.stride(), *w_q.stride(), dest.stride(-2), dest.stride(-1), dest.stride(0) if split > 1 else 0,
            *x_scale.stride(), *w_scale_inv.stride(),
            HAS_BIAS=bias is not None and split == 1, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK,
            SPLIT_K=split, num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options())
    if keep_partials:
        return dest
    if split > 1:
        total = dest.sum(0)  # one reduction kernel, in the same order every call
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out


def probe_deepgemm(device: torch.device) -> str | None:
    """None when DeepGEMM can run this engine's FP8 linears on `device`: it imports, the device is a Hopper
    (sm_90), and a small GEMM gives the Triton kernel's result (within bf16 rounding); otherwise why not. The
    engine's kernel set asks once, at start-up."""
    try:
        import deep_gemm  # noqa: F401
    except Exception as exc:  # not installed, or its extension fails to load
        return f"deep_gemm does not import ({type(exc).__name__}: {exc})"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return f"it needs a Hopper GPU (sm_90), this is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 512, generator=gen, device=device).to(torch.bfloat16)
    w_q, w_s = quantize_weight_blockwise_triton(torch.randn(256, 512, generator=gen, device=device) * 0.05)
    x_q, x_s = per_token_group_quant_fp8(x)
    try:
        got = _deepgemm_matmul(x_q, x_s, w_q, w_s)
    except Exception as exc:
        return f"its FP8 GEMM failed ({type(exc).__name__}: {exc})"
    want = w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16)
    err = float(((got.float() - want.float()).abs().max() / want.float().abs().max()))
    return None if err <= 2 ** -6 else f"its FP8 GEMM differs from the Triton kernel's by {err:.2e} (relative)"


def _deepgemm_fits(x_q: torch.Tensor, w_q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    n, k = w_q.shape
    return out_dtype == torch.bfloat16 and n % 64 == 0 and k % 128 == 0 and w_q.is_contiguous()


def _deepgemm_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                     w_scale_inv: torch.Tensor) -> torch.Tensor:
    """bf16 x_q . w_q^T via DeepGEMM."""
    import deep_gemm
    # fp8_gemm_nt is the DeepGEMM >= 2.0 name; gemm_fp8_fp8_bf16_nt the 1.x one. Both take
    # (data, scales) pairs, 1x128 / 128x128 float32 scales, and transpose the scales themselves.
    out = torch.empty(x_q.shape[0], w_q.shape[0], dtype=torch.bfloat16, device=x_q.device)
    gemm = getattr(deep_gemm, "fp8_gemm_nt", None) or deep_gemm.gemm_fp8_fp8_bf16_nt
    gemm((x_q, x_scale), (w_q, w_scale_inv.float().contiguous()), out)
    return out


def fp8_block_linear_triton(x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                            bias: torch.Tensor | None = None, scale_fmt: str | None = None,
                            batch_invariant: bool = False, deepgemm: bool = False) -> torch.Tensor:
    """W8A8 block linear, the semantics of quant.fp8_block_linear_ref: x [..., K] -> [..., N] in x's dtype.
    batch_invariant: the Triton GEMM on its one batch-invariant launch. deepgemm: DeepGEMM for the shapes it
    takes (the kernel set passes what probe_deepgemm found; it picks kernels by shape, so never when batch
    invariant)."""
    shape = x.shape
    n = w_q.shape[0]
    x_q, x_scale = per_token_group_quant_fp8(x.reshape(-1, shape[-1]), BLOCK, scale_fmt)
    out = fp8_gemm_triton(x_q, x_scale, w_q, w_scale_inv, x.dtype, bias, batch_invariant, deepgemm)
    return out.reshape(*shape[:-1], n)


def fp8_gemm_triton(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                    out_dtype: torch.dtype, bias: torch.Tensor | None = None, batch_invariant: bool = False,
                    deepgemm: bool = False, partials: bool = False) -> torch.Tensor:
    """The GEMM of fp8_block_linear_triton on activations quantized already (x_q [M, K] E4M3, x_scale [M, K / 128]):
    what a fused kernel before it (kernels/fused_triton.py) hands over. partials: where the launch splits K, its
    float32 partials [split, M, N] unsummed (w8a8_matmul_with), for a fused norm to add."""
    if deepgemm and not batch_invariant and _deepgemm_fits(x_q, w_q, out_dtype):
        out = _deepgemm_matmul(x_q, x_scale, w_q, w_scale_inv)
        return out if bias is None else out.add_(bias)
    return w8a8_block_fp8_matmul(x_q, x_scale, w_q, w_scale_inv, out_dtype, bias, batch_invariant, partials)
