"""Fused Triton kernels for a decoder layer on CUDA: what the unfused path runs as a dozen small torch ops and a
separate activation-quant launch before each GEMM, each in one launch (issue 64, item 1):

  * norm_quant: [the preceding GEMM's K-split partials summed in order] + residual add + RMSNorm [+ the 1 x 128
    E4M3 activation quant of the normed row]: the input of the next linear;
  * qkv_epilogue: the qkv GEMM's output split into heads, [q/k RMSNorm per head (Qwen3)], RoPE from the step's cos /
    sin rows, K and V written into the paged cache (BF16, or E4M3 with the layer's scales), q out;
  * silu_mul_quant: silu(gate) * up [+ its activation quant]: down_proj's input.

Every kernel rounds where the unfused path rounds (kernels/fused_ref.py is the torch reference, and the tests
compare bit for bit under the interpreter), with one difference: a row's sum of squares runs in a fixed order of
this module's own, the row padded with zeros to a power of two and added pairwise, neighbours first (`_sum_pairs`),
where torch sums in an order of its choosing. A program handles one row (or a few head rows of one token, or 1,024
columns of one row) whatever else is in the batch, so every kernel is batch invariant; none takes the number of rows.

Under TRITON_INTERPRET=1 the kernels take the interpreter-safe conversions of attention_triton (its docstring).
"""

import torch
import triton
import triton.language as tl

from fp8engine.model_executor.kernels.attention_triton import _INTERPRET, _e4m3, _round, _upcast
from fp8engine.model_executor.kernels import pdl
from fp8engine.model_executor.kernels.fp8_triton import _E4M3_BY_BITS, _block_scale, _pdl_wait, _quantize, _ue8m0
from fp8engine.weights.quant import BLOCK, FP8_DTYPE, cdiv

@triton.jit
def _sum_pairs(acc, ROWS: tl.constexpr, N: tl.constexpr, LOG2_N: tl.constexpr):
    """Each row of acc [ROWS, N = 2^LOG2_N] summed pairwise, neighbours first (a fixed order on every device)."""
    for i in tl.static_range(LOG2_N - 1):
        acc = tl.sum(tl.reshape(acc, (ROWS, N >> (i + 1), 2)), axis=2)
    return tl.sum(acc, axis=1)  # the last two


@triton.jit
def _rn(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 x rounded to the model dtype, as float32 again (where torch rounds a model-dtype op's result)."""
    return _upcast(_round(x, dtype, INTERPRET), tl.float32, INTERPRET)


@triton.jit
def _load_row(x_ptr, row, stride_x, stride_split, cols, ok, SPLIT: tl.constexpr, dtype: tl.constexpr,
              INTERPRET: tl.constexpr):
    """A row as float32: the model-dtype row, or SPLIT float32 partial sums added in order and rounded to the model
    dtype once (what the GEMM would have stored)."""
    if SPLIT == 0:
        return _upcast(tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0), tl.float32, INTERPRET)
    total = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        total += tl.load(x_ptr + s * stride_split + row * stride_x + cols, mask=ok, other=0.0)
    return _rn(total, dtype, INTERPRET)


@triton.jit
def _norm_quant_kernel(x_ptr, res_ptr, w_ptr, sum_ptr, normed_ptr, q_ptr, s_ptr, H, eps,
                       stride_x, stride_split, stride_r, stride_sum, stride_n, stride_q, stride_s,
                       SPLIT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_SUM: tl.constexpr,
                       WRITE_NORMED: tl.constexpr, QUANT: tl.constexpr, BLOCK_H: tl.constexpr,
                       LOG2_H: tl.constexpr, UE8M0: tl.constexpr, E4M3_BY_BITS: tl.constexpr,
                       INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    dtype = w_ptr.dtype.element_ty
    s = _load_row(x_ptr, row, stride_x, stride_split, cols, ok, SPLIT, dtype, INTERPRET)
    if HAS_RESIDUAL:  # the add in the model dtype
        r = _upcast(tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0), tl.float32, INTERPRET)
        s = _rn(s + r, dtype, INTERPRET)
    if WRITE_SUM:
        tl.store(sum_ptr + row * stride_sum + cols, _round(s, dtype, INTERPRET), mask=ok)
    total = _sum_pairs(tl.reshape(s * s, (1, BLOCK_H)), 1, BLOCK_H, LOG2_H)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(total, H.to(tl.float32)) + eps))
    normed = _rn(s * inv, dtype, INTERPRET)
    w = _upcast(tl.load(w_ptr + cols, mask=ok, other=0.0), tl.float32, INTERPRET)
    out = _rn(w * normed, dtype, INTERPRET)
    if WRITE_NORMED:
        tl.store(normed_ptr + row * stride_n + cols, _round(out, dtype, INTERPRET), mask=ok)
    if QUANT:  # the 1 x 128 groups of the row
        groups = tl.reshape(out, (BLOCK_H // 128, 128))
        scale = _block_scale(tl.max(tl.abs(groups), axis=1), UE8M0)
        gcols = tl.reshape(cols, (BLOCK_H // 128, 128))
        tl.store(q_ptr + row * stride_q + gcols, _quantize(groups, scale[:, None], E4M3_BY_BITS), mask=gcols < H)
        g = tl.arange(0, BLOCK_H // 128)
        tl.store(s_ptr + row * stride_s + g, scale, mask=g * 128 < H)


def norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
               quant: bool = True, normed: bool = False, scale_fmt: str | None = None):
    """RMSNorm of s = x + residual (or x), and what the next linear reads, in one launch:
    (x_q E4M3 [T, H] or None, x_scale float32 [T, ceil(H / 128)] or None, s [T, H], normed [T, H] or None).

    x: [T, H] in the model dtype, or [S, T, H] float32 K-split partials of the GEMM before (summed in order, rounded
    to the model dtype once). quant: the 1 x 128 E4M3 groups of the normed row (quant.quantize_activation_groups);
    normed: the normed row itself in the model dtype (a BF16 linear, LoRA or the LM head read it). Without a
    residual, s is x (rounded to the model dtype when x is partials)."""
    split = x.shape[0] if x.dim() == 3 else 0
    h = x.shape[-1]
    rows = x.shape[-2]
    if x.stride(-1) != 1 or (split and x.stride(0) != rows * x.stride(1)):
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    dtype, device = weight.dtype, x.device
    write_sum = residual is not None or split > 0
    summed = torch.empty(rows, h, dtype=dtype, device=device) if write_sum else x
    out = torch.empty(rows, h, dtype=dtype, device=device) if normed else None
    block = max(BLOCK, triton.next_power_of_2(h))
    x_q = torch.empty(rows, h, dtype=FP8_DTYPE, device=device) if quant else None
    x_s = torch.empty(rows, cdiv(h, BLOCK), dtype=torch.float32, device=device) if quant else None
    if rows:
        _norm_quant_kernel[(rows,)](
            x, residual, weight, summed, out, x_q, x_s, h, eps, x.stride(-2), x.stride(0) if split else 0,
            residual.stride(0) if residual is not None else 0, summed.stride(0), out.stride(0) if normed else 0,
            x_q.stride(0) if quant else 0, x_s.stride(0) if quant else 0,
            SPLIT=split, HAS_RESIDUAL=residual is not None, WRITE_SUM=write_sum, WRITE_NORMED=normed, QUANT=quant,
            BLOCK_H=block, LOG2_H=block.bit_length() - 1, UE8M0=_ue8m0(scale_fmt), E4M3_BY_BITS=_E4M3_BY_BITS,
            INTERPRET=_INTERPRET, num_warps=4 if block <= 4096 else 8, **pdl.launch_options())
    return x_q, x_s, summed, out


@triton.jit
def _to_cache(y, scale, cache_ptr, INTERPRET: tl.constexpr):
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return _e4m3(tl.div_rn(y, scale), INTERPRET)
    return _round(y, cache_ptr.dtype.element_ty, INTERPRET)


@triton.jit
def _qkv_epilogue_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                         k_scale, v_scale, eps, stride_t, stride_cs, stride_qt, stride_cb, stride_co, stride_ch,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr,
                         HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
                         INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, j): HEADS of token t's Hq + 2 Hkv head rows (q heads, then k, then v) from j * HEADS on."""
    _pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    dims = tl.arange(0, D)
    dtype = cos_ptr.dtype.element_ty
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HKV)
    is_v = (h >= HQ + HKV) & (h < HQ + 2 * HKV)
    ok = (is_q | is_k | is_v)[:, None]
    half: tl.constexpr = D // 2
    partner = (dims + half) % D  # rotate_half(x)[d] = -x[d + D/2] (d < D/2), x[d - D/2] (d >= D/2)
    row = qkv_ptr + t * stride_t + h[:, None] * D
    x = _upcast(tl.load(row + dims[None, :], mask=ok, other=0.0), tl.float32, INTERPRET)
    xp = _upcast(tl.load(row + partner[None, :], mask=ok, other=0.0), tl.float32, INTERPRET)
    if HAS_NORM:  # q / k RMSNorm per head (its sum of squares pairwise), each step rounded as torch rounds
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(_sum_pairs(x * x, HEADS, D, LOG2_D), D) + eps))[:, None]
        wq = _upcast(tl.load(qn_ptr + dims), tl.float32, INTERPRET)[None, :]
        wk = _upcast(tl.load(kn_ptr + dims), tl.float32, INTERPRET)[None, :]
        wqp = _upcast(tl.load(qn_ptr + partner), tl.float32, INTERPRET)[None, :]
        wkp = _upcast(tl.load(kn_ptr + partner), tl.float32, INTERPRET)[None, :]
        xn = _rn(_rn(x * inv, dtype, INTERPRET) * tl.where(is_q[:, None], wq, wk), dtype, INTERPRET)
        xpn = _rn(_rn(xp * inv, dtype, INTERPRET) * tl.where(is_q[:, None], wqp, wkp), dtype, INTERPRET)
        x = tl.where(is_v[:, None], x, xn)
        xp = xpn
    xp = tl.where((dims < half)[None, :], -xp, xp)
    c = _upcast(tl.load(cos_ptr + t * stride_cs + dims), tl.float32, INTERPRET)[None, :]
    s = _upcast(tl.load(sin_ptr + t * stride_cs + dims), tl.float32, INTERPRET)[None, :]
    rotated = _rn(x * c, dtype, INTERPRET) + _rn(xp * s, dtype, INTERPRET)
    y = _rn(tl.where(is_v[:, None], x, rotated), dtype, INTERPRET)
    full = dims[None, :] < D  # the masks as whole [HEADS, D] tiles
    tl.store(q_out_ptr + t * stride_qt + h[:, None] * D + dims[None, :], _round(y, dtype, INTERPRET),
             mask=is_q[:, None] & full)
    slot = tl.load(slot_ptr + t + 0 * h)  # per head row, so that its test is a vector mask
    kv = tl.where(is_k, h - HQ, h - HQ - HKV)
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + kv * stride_ch)[:, None] + dims[None, :]
    full = full & (slot >= 0)[:, None]
    tl.store(k_cache_ptr + dst, _to_cache(y, k_scale, k_cache_ptr, INTERPRET), mask=is_k[:, None] & full)
    tl.store(v_cache_ptr + dst, _to_cache(y, v_scale, v_cache_ptr, INTERPRET), mask=is_v[:, None] & full)


def qkv_epilogue(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                 k_norm: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float, v_scale: float, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] (the fused projection's output) -> q [T, Hq, D] rotated, K rotated and V written into
    their cache slots (slot -1: skipped), in one launch. cos / sin: the step's rows [T, D] of the RoPE tables;
    q_norm / k_norm: Qwen3's per-head RMSNorm weights (both or neither, eps theirs). head_dim: a power of two."""
    tokens = qkv.shape[0]
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same strides and a contiguous last dim")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if k_cache.dtype != FP8_DTYPE:
        k_scale = v_scale = 1.0
    heads = num_heads + 2 * num_kv_heads
    # Heads per program: a few on a GPU, so that one token's step spreads over the SMs; all of them under the
    # interpreter, which pays per program. Each head row is computed alone either way: the same bits.
    per_program = triton.next_power_of_2(heads) if _INTERPRET else 4
    if tokens:
        _qkv_epilogue_kernel[(tokens, triton.cdiv(heads, per_program))](
            qkv, cos, sin, q_norm, k_norm, q, k_cache, v_cache, slot_mapping, k_scale, v_scale, eps, qkv.stride(0),
            cos.stride(0), q.stride(0), *k_cache.stride()[:3], HQ=num_heads, HKV=num_kv_heads, D=head_dim,
            LOG2_D=head_dim.bit_length() - 1, HEADS=per_program, BLOCK_SIZE=k_cache.shape[1],
            HAS_NORM=q_norm is not None, INTERPRET=_INTERPRET, num_warps=2, **pdl.launch_options())
    return q


@triton.jit
def _silu_mul_quant_kernel(x_ptr, out_ptr, q_ptr, s_ptr, I, stride_x, stride_o, stride_q, stride_s,
                           CHUNK: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr, E4M3_BY_BITS: tl.constexpr,
                           INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = cols < I
    dtype = x_ptr.dtype.element_ty
    gate = _upcast(tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0), tl.float32, INTERPRET)
    up = _upcast(tl.load(x_ptr + row * stride_x + I + cols, mask=ok, other=0.0), tl.float32, INTERPRET)
    silu = _rn(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype, INTERPRET)
    h = _rn(silu * up, dtype, INTERPRET)
    if QUANT:
        groups = tl.reshape(h, (CHUNK // 128, 128))
        scale = _block_scale(tl.max(tl.abs(groups), axis=1), UE8M0)
        gcols = tl.reshape(cols, (CHUNK // 128, 128))
        tl.store(q_ptr + row * stride_q + gcols, _quantize(groups, scale[:, None], E4M3_BY_BITS), mask=gcols < I)
        g = tl.program_id(1) * (CHUNK // 128) + tl.arange(0, CHUNK // 128)
        tl.store(s_ptr + row * stride_s + g, scale, mask=g * 128 < I)
    else:
        tl.store(out_ptr + row * stride_o + cols, _round(h, dtype, INTERPRET), mask=ok)


def silu_mul_quant(x: torch.Tensor, quant: bool = True, scale_fmt: str | None = None):
    """x [T, 2I] = [gate | up] -> silu(gate) * up, as (x_q E4M3 [T, I], scale float32 [T, ceil(I / 128)]) with
    quant, else (h [T, I] in x's dtype, None); one launch, programs of up to 1,024 columns (whole 128-groups)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    chunk = min(1024, max(BLOCK, triton.next_power_of_2(inter)))
    if quant:
        out, q = None, torch.empty(rows, inter, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty(rows, cdiv(inter, BLOCK), dtype=torch.float32, device=x.device)
    else:
        out, q, s = torch.empty(rows, inter, dtype=x.dtype, device=x.device), None, None
    if rows:
        _silu_mul_quant_kernel[(rows, triton.cdiv(inter, chunk))](
            x, out, q, s, inter, x.stride(0), out.stride(0) if out is not None else 0, q.stride(0) if quant else 0,
            s.stride(0) if quant else 0, CHUNK=chunk, QUANT=quant, UE8M0=_ue8m0(scale_fmt),
            E4M3_BY_BITS=_E4M3_BY_BITS, INTERPRET=_INTERPRET, num_warps=4, **pdl.launch_options())
    return (q, s) if quant else (out, None)
