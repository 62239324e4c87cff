"""Triton paged attention and KV-cache write for CUDA, with the semantics of attention_ref.

One attention kernel serves decode, chunked prefill and mixed batches. Its grid is (query block, kv head):
a query block is up to BLOCK_Q consecutive query tokens of one sequence, and its tile holds the GROUP
query heads of each of those tokens that share the kv head (rows token-major), so GQA reads every K/V row
once per tile. The kernel walks the sequence's keys BLOCK_N at a time through its block table, reading
the paged cache in place, dequantising FP8 in registers, with an online softmax in float32.

Precision: every matmul accumulates in float32. With bf16 q and a bf16 or FP8 cache, q, K and V are exact
in bf16 and go to the tensor cores as they are; the probabilities are split into a high and a low bf16
part (two MMAs), which keeps about 16 of their bits where a single bf16 P would keep 8. Other dtype
mixes multiply float32 operands in IEEE precision (no TF32).

Full FP8 (fp8_q_scale): the reference quantises the normalised probabilities, E4M3(P * 448), which
needs each row's final max and sum before any P is formed; no single online pass can reproduce that,
so the kernel makes two passes over the keys (max and sum, then quantised P @ V), as the C++ kernel
does. What remains is float rounding (exp, summation order): a P * 448 within an ulp of an E4M3
rounding tie may round the other way than in the reference.

Under TRITON_INTERPRET=1 (CPU tensors; the tests) the interpreter stores bf16 as uint16 and fp8 as
uint8 and gets some of their conversions wrong, so there (INTERPRET) the kernels take other routes:
  * float32 -> E4M3 rounds wrongly: fp8_triton's integer encoder, plus NaN, which it does not cover;
  * E4M3 -> float decodes the NaN codes as +-480: an integer decoder;
  * bf16 -> float32 flushes subnormals to zero: a 16-bit shift;
  * float32 -> bf16 truncates: round-to-nearest-even with integer ops;
  * tl.dot multiplies bf16 bit patterns as integers: its operands go to float32 first, which gives
    the same products (bf16 x bf16 is exact in float32).

FP8 caches need sm_89 or later: below, Triton has no E4M3 type. An optional FlashInfer fast path takes
over on CUDA when flashinfer imports (not for full FP8).
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fp8engine.model_executor.kernels.attention_ref import FP8_DTYPE, FP8_MAX, check_full_fp8
from fp8engine.model_executor.kernels import pdl
from fp8engine.model_executor.kernels.fp8_triton import (_block_scale, _e4m3_from_bits, _pdl_wait,  # noqa: F401
                                                         _prefetch_l2, _quantize, _ue8m0, per_token_group_quant_fp8)
from fp8engine.weights.quant import BLOCK


_INTERPRET = bool(triton.knobs.runtime.interpret)


# ------------------------------------------------------------------------------------------ conversions


@triton.jit
def _e4m3(y, INTERPRET: tl.constexpr):
    """E4M3(clamp(y, +-448)) with round-to-nearest-even, as torch casts; NaN stays NaN."""
    y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if INTERPRET:
        nan = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F  # torch keeps the sign
        code = _e4m3_from_bits(tl.where(y == y, y, 0.0))
        return tl.where(y == y, code, nan.to(tl.uint8).to(tl.float8e4nv, bitcast=True))
    return y.to(tl.float8e4nv)


@triton.jit
def _upcast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x as dtype, which holds its values exactly (E4M3 values fit in bf16 and float32)."""
    if INTERPRET and x.dtype == tl.float8e4nv:
        code = x.to(tl.uint8, bitcast=True).to(tl.int32)
        mag = code & 0x7F
        # Normal codes: rebias the exponent 7 -> 127. Subnormals are mag * 2^-9; 0x7F is NaN.
        normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        value = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, normal)
        value = tl.where(mag == 0x7F, float("nan"), value)
        return tl.where(code >= 0x80, -value, value).to(dtype)
    if INTERPRET and x.dtype == tl.bfloat16 and dtype == tl.float32:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 x rounded to dtype to nearest even, as torch rounds."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x == x, rounded, 0x7FC0)  # a NaN's payload could carry into the sign
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _mma(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b in float32; float32 operands multiply in IEEE precision, not TF32. The interpreter sums each
    output's products along K itself: its tl.dot is numpy's matmul, whose BLAS sums a row in an order that can
    depend on where the row sits in the tile (seen with OpenBLAS on AVX-512 without AMX), and a GPU's MMA never
    mixes rows."""
    if INTERPRET:
        a = _upcast(a, tl.float32, INTERPRET)
        return acc + tl.sum(a[:, :, None] * _upcast(b, tl.float32, INTERPRET)[None, :, :], axis=1)
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# ------------------------------------------------------------------------------------------ cache write


@triton.jit
def _store_rows(src_ptr, cache_ptr, dst, heads, dims, mask, stride_h, scale, INTERPRET: tl.constexpr):
    """One token's [heads, dims] rows into the cache, rounded as the reference rounds."""
    x = _upcast(tl.load(src_ptr + heads[:, None] * stride_h + dims[None, :], mask=mask), tl.float32, INTERPRET)
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        y = _e4m3(tl.div_rn(x, scale), INTERPRET)  # IEEE division, as the reference divides
    else:
        y = _round(x, cache_ptr.dtype.element_ty, INTERPRET)
    tl.store(cache_ptr + dst, y, mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
                     PDL: tl.constexpr = False):
    _pdl_wait(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
            + heads[:, None] * stride_ch + dims[None, :]
        _store_rows(k_ptr + token.to(tl.int64) * stride_kt, k_cache_ptr, dst, heads, dims, mask, stride_kh,
                    k_scale, INTERPRET)
        _store_rows(v_ptr + token.to(tl.int64) * stride_vt, v_cache_ptr, dst, heads, dims, mask, stride_vh,
                    v_scale, INTERPRET)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_cache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes k, v [T, num_kv_heads, head_dim] into their slots in place; slot -1 marks a token to skip."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same strides and a contiguous last dim")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), *k_cache.stride()[:3], NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        INTERPRET=_INTERPRET, num_warps=4, **pdl.launch_options())


# ------------------------------------------------------------------------------------------ attention


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence of global query block q_block. Sequence s's blocks start at query_start_loc[s] // BLOCK_Q
    + s: increasing, and far enough apart for its ceil(q_len / BLOCK_Q) blocks, so no host sync is needed
    to lay out the grid; the price is a few spare programs, which return at once."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _scores(q, q_pos, start, num_keys, seq, kv_head, block_tables_ptr, k_cache_ptr, qk_scale, dims, dim_ok,
            stride_bt, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            MMA_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Causally masked scores of keys start..start+BLOCK_N, and those keys' cache row offsets."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < num_keys
    block = tl.load(block_tables_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0)
    rows = block.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    k = tl.load(k_cache_ptr + rows[None, :] + dims[:, None], mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
    s = _mma(q, _upcast(k, MMA_DTYPE, INTERPRET), tl.zeros([q.shape[0], BLOCK_N], tl.float32), INTERPRET)
    return tl.where(keys[None, :] <= q_pos[:, None], s * qk_scale, float("-inf")), rows, key_ok


@triton.jit
def _load_v(v_cache_ptr, rows, key_ok, dims, dim_ok, MMA_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """The V tile [keys, dims] as p @ v's B operand. An E4M3 cache's is loaded as its transpose ([dims, keys], as K's
    tile) and transposed after the upcast to bf16: loaded [keys, dims], Triton copied it 8 bytes a thread (the shared
    buffer's vector width of a 16-bit operand), this way 16 as K's; the same values. A BF16 / float32 cache's, and an
    E4M3 one under a float32 model (FMA, no tensor cores), as it is (transposed, sm_89 spills a BF16 one)."""
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv and MMA_DTYPE != tl.float32:
        v = tl.load(v_cache_ptr + rows[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        return tl.trans(_upcast(v, MMA_DTYPE, INTERPRET))
    v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    return _upcast(v, MMA_DTYPE, INTERPRET)


@triton.jit
def _walk(q, q_pos, key_begin, key_end, seq, kv_head, block_tables_ptr, k_cache_ptr, v_cache_ptr, qk_scale, dims,
          dim_ok, stride_bt, stride_cb, stride_cs, stride_ch, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MMA_DTYPE: tl.constexpr, FULL_FP8: tl.constexpr,
          INTERPRET: tl.constexpr, UNSEEN: tl.constexpr = False):
    """Keys key_begin..key_end BLOCK_N at a time with an online softmax in float32: each row's running max m, sum
    of exp(s - m) and unnormalised accumulator (left zero under FULL_FP8, whose first pass needs max and sum only).
    A row that sees the range's first key has a finite max from the first step on; keys past a row's causal limit
    add exact zeros. UNSEEN: a row may see none of the range (a prefill row before a later fold run); it ends with
    m = -inf and zero sums, which _fold adds with weight 0 (the other rows' bits are the same either way)."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(key_begin, key_end, BLOCK_N):
        s, kv_rows, key_ok = _scores(q, q_pos, start, key_end, seq, kv_head, block_tables_ptr, k_cache_ptr,
                                     qk_scale, dims, dim_ok, stride_bt, stride_cb, stride_cs, stride_ch,
                                     BLOCK_SIZE, BLOCK_N, MMA_DTYPE, INTERPRET)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = m_new
        if UNSEEN:  # a row that has seen no key yet: exact zeros, not exp(-inf + inf)
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        m = m_new
        if not FULL_FP8:
            v = _load_v(v_cache_ptr, kv_rows, key_ok, dims, dim_ok, MMA_DTYPE, INTERPRET)
            acc *= alpha[:, None]
            if MMA_DTYPE == tl.float32:
                acc = _mma(p, v, acc, INTERPRET)
            else:
                p_hi = p.to(MMA_DTYPE)
                acc = _mma(p_hi, v, acc, INTERPRET)
                acc = _mma((p - _upcast(p_hi, tl.float32, INTERPRET)).to(MMA_DTYPE), v, acc, INTERPRET)
    return m, row_sum, acc


@triton.jit
def _fold(m, row_sum, acc, run_m, run_sum, run_acc):
    """(m, row_sum, acc) with one more run of keys folded in: both rescaled to the larger max and added. A row that
    saw no key of the run (run_m = -inf, zero sums) keeps its bits (weights 1 and 0); the first fold into (-inf, 0,
    0) gives the run's own values exactly (weights 0 and 1). The sums are explicit fmas so that no compiler
    contracts them one way in the attention kernel and another in the combine: a split decode and a prefill tile
    fold to the same bits."""
    top = tl.maximum(m, run_m)
    old = tl.exp(m - top)
    new = tl.exp(run_m - top)
    return top, tl.fma(row_sum, old, run_sum * new), tl.fma(acc, old[:, None], run_acc * new[:, None])


@triton.jit
def _quant_out(y, xq_ptr, xs_ptr, tok, head, dims, tile_ok, row_ok, stride_xq, stride_xs, HEAD_DIM: tl.constexpr,
               UE8M0: tl.constexpr, INTERPRET: tl.constexpr):
    """Output rows y [rows, HEAD_DIM] (token tok, head `head`; rounded to the model dtype already), each head one
    1 x 128 activation group of the FP8 o_proj's input [T, Hq * 128], quantized as fp8_triton's group quant does:
    E4M3 codes into xq [T, Hq * 128], the group's scale into xs [T, Hq]."""
    x = tl.where(tile_ok, _upcast(y, tl.float32, INTERPRET), 0.0)
    scale = _block_scale(tl.max(tl.abs(x), 1), UE8M0)
    tl.store(xq_ptr + tok[:, None] * stride_xq + head[:, None] * HEAD_DIM + dims[None, :],
             _quantize(x, scale[:, None], INTERPRET), mask=tile_ok)
    tl.store(xs_ptr + tok * stride_xs + head, scale, mask=row_ok)


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        num_seqs, qk_scale, out_scale, q_scale, stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_bt, part_ptr, stats_ptr, num_tokens, xq_ptr, xs_ptr, stride_xq,
        stride_xs, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MMA_DTYPE: tl.constexpr,
        FULL_FP8: tl.constexpr, SPLIT: tl.constexpr, PART: tl.constexpr, INTERPRET: tl.constexpr,
        QUANT: tl.constexpr = False, UE8M0: tl.constexpr = False, PDL: tl.constexpr = False,
        FOLD: tl.constexpr = False):
    """SPLIT (decode, one query per sequence, not full FP8): program (q, kv head, s) walks keys s * PART ..
    (s + 1) * PART and writes its unnormalised accumulator, max and sum (part / stats) for _combine_kernel.
    FOLD (batch invariant, not full FP8): one program walks the same PART-key runs from key 0 and folds them in
    order as the combine does (_fold), so a row's bits do not depend on whether its step split: a prefill tile, an
    unsplit decode and a split decode agree bit for bit, and a context of <= PART keys is one run, folded exactly.
    QUANT (HEAD_DIM == 128): the output goes to the FP8 o_proj as its E4M3 codes and 1 x 128 scales (xq / xs,
    _quant_out) instead of out (whose dtype is still the rounding's)."""
    _pdl_wait(PDL)
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    first = (q_block - q_begin // BLOCK_Q - seq) * BLOCK_Q  # the tile's first query, counted in its sequence
    if first >= q_len:
        return
    context = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    tile_ok = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + (q_begin + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :], mask=tile_ok, other=0.0)
    if FULL_FP8:
        q = _e4m3(tl.div_rn(_upcast(q, tl.float32, INTERPRET), q_scale), INTERPRET)
    q = _upcast(q, MMA_DTYPE, INTERPRET)
    q_pos = context + tok
    num_keys = context + tl.minimum(first + BLOCK_Q, q_len)  # the keys the tile's last query sees
    if FOLD:  # fixed PART-key runs from key 0, each walked afresh and folded in order (_fold)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for run in range(0, num_keys, PART):
            run_m, run_sum, run_acc = _walk(q, q_pos, run, tl.minimum(run + PART, num_keys), seq, kv_head,
                                            block_tables_ptr, k_cache_ptr, v_cache_ptr, qk_scale, dims, dim_ok,
                                            stride_bt, stride_cb, stride_cs, stride_ch, BLOCK_M, BLOCK_SIZE, BLOCK_N,
                                            BLOCK_D, MMA_DTYPE, FULL_FP8, INTERPRET, UNSEEN=True)
            m, row_sum, acc = _fold(m, row_sum, acc, run_m, run_sum, run_acc)
    else:
        key_begin = 0
        key_end = num_keys
        if SPLIT:
            key_begin = tl.program_id(2) * PART
            key_end = tl.minimum(key_begin + PART, num_keys)
            if key_begin >= num_keys:
                return
        m, row_sum, acc = _walk(q, q_pos, key_begin, key_end, seq, kv_head, block_tables_ptr, k_cache_ptr,
                                v_cache_ptr, qk_scale, dims, dim_ok, stride_bt, stride_cb, stride_cs, stride_ch,
                                BLOCK_M, BLOCK_SIZE, BLOCK_N, BLOCK_D, MMA_DTYPE, FULL_FP8, INTERPRET)
    if FULL_FP8:
        # Second pass: the normalised probabilities exist only now. softmax's own order: exp, then * 1/sum.
        inv_sum = 1.0 / row_sum
        for start in range(0, num_keys, BLOCK_N):
            s, kv_rows, key_ok = _scores(q, q_pos, start, num_keys, seq, kv_head, block_tables_ptr, k_cache_ptr,
                                         qk_scale, dims, dim_ok, stride_bt, stride_cb, stride_cs, stride_ch,
                                         BLOCK_SIZE, BLOCK_N, MMA_DTYPE, INTERPRET)
            p = tl.exp(s - m[:, None]) * inv_sum[:, None]
            p = _upcast(_e4m3(p * 448.0, INTERPRET), MMA_DTYPE, INTERPRET)
            acc = _mma(p, _load_v(v_cache_ptr, kv_rows, key_ok, dims, dim_ok, MMA_DTYPE, INTERPRET), acc, INTERPRET)
        acc *= out_scale
    elif SPLIT:  # this split's share, unnormalised, for the combine: [split, token, head, dim], [.., 2]
        at = (tl.program_id(2) * num_tokens + q_begin + tok) * (GROUP * tl.num_programs(1)) + head  # < 2^31
        tl.store(part_ptr + at[:, None] * HEAD_DIM + dims[None, :], acc, mask=tile_ok)
        tl.store(stats_ptr + at * 2, m, mask=row_ok)
        tl.store(stats_ptr + at * 2 + 1, row_sum, mask=row_ok)
        return
    else:
        acc *= (out_scale / row_sum)[:, None]
    out = _round(acc, out_ptr.dtype.element_ty, INTERPRET)
    if QUANT:
        _quant_out(out, xq_ptr, xs_ptr, (q_begin + tok).to(tl.int64), head, dims, tile_ok, row_ok, stride_xq,
                   stride_xs, HEAD_DIM, UE8M0, INTERPRET)
    else:
        tl.store(out_ptr + (q_begin + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
                 + dims[None, :], out, mask=tile_ok)


@triton.jit
def _combine_kernel(part_ptr, stats_ptr, out_ptr, seq_lens_ptr, out_scale, num_tokens, stride_ot, stride_oh,
                    xq_ptr, xs_ptr, stride_xq, stride_xs, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PART: tl.constexpr, INTERPRET: tl.constexpr,
                    QUANT: tl.constexpr = False, UE8M0: tl.constexpr = False, PDL: tl.constexpr = False):
    """Decode token t's heads from its sequence's splits (ceil(keys / PART) of them), folded in split order by
    _fold (the fold a batch-invariant prefill tile makes in registers), then out = acc * out_scale / sum; a
    sequence without keys (a graph's padding) gets zeros. QUANT: quantized for the FP8 o_proj instead
    (_paged_attention_kernel's)."""
    _pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < NUM_HEADS
    ok = head_ok[:, None] & (dims < HEAD_DIM)[None, :]
    num_keys = tl.load(seq_lens_ptr + t)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(0, tl.cdiv(num_keys, PART)):
        at = (s * num_tokens + t) * NUM_HEADS + heads
        m, total, acc = _fold(m, total, acc, tl.load(stats_ptr + at * 2, mask=head_ok, other=float("-inf")),
                              tl.load(stats_ptr + at * 2 + 1, mask=head_ok, other=0.0),
                              tl.load(part_ptr + at[:, None] * HEAD_DIM + dims[None, :], mask=ok, other=0.0))
    acc *= tl.where(total > 0, out_scale / total, 0.0)[:, None]
    out = _round(acc, out_ptr.dtype.element_ty, INTERPRET)
    if QUANT:
        _quant_out(out, xq_ptr, xs_ptr, t + 0 * heads, heads, dims, ok, head_ok, stride_xq, stride_xs, HEAD_DIM,
                   UE8M0, INTERPRET)
    else:
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :], out, mask=ok)


# Batch invariant: never specialised on num_seqs, the block-table width or the token count (Triton folds a 1 into
# the code and specialises multiples of 16), one query tile for decode and prefill alike. A row's keys are walked
# from key 0 in BLOCK_N steps, in runs of SPLIT_KEYS folded in order, whatever else is in the tile or the batch;
# keys past a row's causal limit add exact zeros, so its sums keep one order. A decode step that would leave SMs
# idle splits the runs over programs and the combine folds them as the unsplit kernel does (FOLD): a second binary,
# the same bits.
_paged_attention_kernel_bi = triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_tokens"])(
    _paged_attention_kernel.fn)
BATCH_INVARIANT_BLOCK_M = 64
# A folding program holds two 64 x 128 float32 accumulators (the runs' and its current run's): on 4 warps an 8B's
# tile takes 232-247 registers on sm_90 and spills on sm_89; on 8 it takes 185-228 and none. The split programs take
# the same warps, so that a run's reductions have one order in both binaries.
BATCH_INVARIANT_WARPS = 8


def _mma_dtype(q: torch.Tensor, k_cache: torch.Tensor, full_fp8: bool) -> tl.dtype:
    """bf16 where q and the cache values are exact in it (E4M3 codes are), float32 otherwise."""
    exact = full_fp8 or (q.dtype == torch.bfloat16 and k_cache.dtype in (torch.bfloat16, FP8_DTYPE))
    return tl.bfloat16 if exact else tl.float32


def _triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, k_scale: float,
                      v_scale: float, fp8_q_scale: float | None, batch_invariant: bool = False,
                      quant: bool = False, scale_fmt: str | None = None):
    """out [T, Hq, D]; quant (D == 128): (x_q E4M3 [T, Hq * D], x_scale float32 [T, Hq]) for the FP8 o_proj, the
    output rounded to q's dtype and quantized per head in the same launch. Tokens outside every sequence (a graph's
    padding) stay zero either way: one zero-filled buffer."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if quant:  # the codes and the scales share one zero-fill (one launch, as the plain output's)
        raw = torch.zeros(num_tokens * num_heads * (head_dim + 4), dtype=torch.uint8, device=q.device)
        x_q = raw[:num_tokens * num_heads * head_dim].view(FP8_DTYPE).view(num_tokens, num_heads * head_dim)
        x_s = raw[num_tokens * num_heads * head_dim:].view(torch.float32).view(num_tokens, num_heads)
        out, result = q, (x_q, x_s)  # out: never written, its dtype the rounding's
    else:
        out = result = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # tokens outside every sequence: zero
        x_q = x_s = out
    if num_tokens == 0 or num_seqs == 0:
        return result
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same strides and a contiguous last dim")
    q = _last_dim_contiguous(q)
    group = num_heads // num_kv_heads
    # Pure decode needs few rows per tile; prefill tiles share each K/V load among more queries.
    if batch_invariant:
        block_m = max(BATCH_INVARIANT_BLOCK_M, triton.next_power_of_2(group))
    else:
        block_m = max(16 if num_tokens == num_seqs else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    full_fp8 = fp8_q_scale is not None
    if full_fp8:
        qk_scale, out_scale = fp8_q_scale * k_scale * scale, v_scale / FP8_MAX
    else:
        qk_scale, out_scale = k_scale * scale, v_scale
    block_d = max(16, triton.next_power_of_2(head_dim))
    # a run ends on a key block's end: _scores masks keys by position, and a block past a run's end must not count
    assert SPLIT_KEYS % ATTENTION_BLOCK_N == 0, (SPLIT_KEYS, ATTENTION_BLOCK_N)
    splits = 1 if full_fp8 or num_tokens != num_seqs else decode_splits(
        num_seqs, num_kv_heads, block_tables.shape[1] * k_cache.shape[1])
    part = stats = out
    if splits > 1:  # each split's share, then one combine launch
        part = torch.empty(splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(splits, num_tokens, num_heads, 2, dtype=torch.float32, device=q.device)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    kernel = _paged_attention_kernel_bi if batch_invariant else _paged_attention_kernel
    kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, num_seqs, qk_scale, out_scale,
        fp8_q_scale or 1.0, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3],
        block_tables.stride(0), part, stats, num_tokens, x_q, x_s, x_q.stride(0), x_s.stride(0), HEAD_DIM=head_dim,
        GROUP=group, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=ATTENTION_BLOCK_N,
        BLOCK_D=block_d, MMA_DTYPE=_mma_dtype(q, k_cache, full_fp8), FULL_FP8=full_fp8, SPLIT=splits > 1,
        PART=SPLIT_KEYS, INTERPRET=_INTERPRET, QUANT=quant, UE8M0=_ue8m0(scale_fmt),
        FOLD=batch_invariant and not full_fp8 and splits == 1,
        num_warps=BATCH_INVARIANT_WARPS if batch_invariant else 4, **pdl.launch_options())
    if splits > 1:
        _combine_kernel[(num_tokens,)](
            part, stats, out, seq_lens, out_scale, num_tokens, out.stride(0), out.stride(1), x_q, x_s, x_q.stride(0),
            x_s.stride(0), NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=block_d, PART=SPLIT_KEYS, INTERPRET=_INTERPRET, QUANT=quant, UE8M0=_ue8m0(scale_fmt),
            num_warps=4, **pdl.launch_options())
    return result


ATTENTION_BLOCK_N = 32
SPLIT_KEYS = 256  # keys a decode split walks: fixed, so a sequence's splits follow from its own length alone
SPLIT_TARGET_PROGRAMS = 4 * 132  # ~4 programs per SM of an H100 / H200 (132 SMs)


def decode_splits(num_seqs: int, num_kv_heads: int, max_keys: int) -> int:
    """Splits of a decode step (one query per sequence) over SPLIT_KEYS-key runs of its contexts: as many as the
    longest context the block tables can hold needs (max_keys: their width in keys), when (sequences x KV heads)
    programs alone would leave SMs idle; else 1, one program walking all of a sequence's keys. A sequence's result
    depends on its own length only (a context of <= SPLIT_KEYS keys gives the unsplit kernel's bits; batch
    invariant, any context does: its unsplit kernel folds the same runs), and a CUDA graph bucket, whose block
    tables have a fixed width, keeps its splits."""
    if num_seqs * num_kv_heads >= SPLIT_TARGET_PROGRAMS:
        return 1
    return max(1, -(-max_keys // SPLIT_KEYS))


# ------------------------------------------------------------------------------------------ FlashInfer


def probe_flashinfer(device: torch.device) -> str | None:
    """None when FlashInfer can run this engine's BF16 attention on `device`: it imports and a small batch (a
    prefill chunk and decodes over a paged BF16 cache) gives the Triton kernel's result within bf16 rounding;
    otherwise why not. The engine's kernel set asks once, at start-up."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # not installed, or its extension fails to load
        return f"flashinfer does not import ({type(exc).__name__}: {exc})"
    gen = torch.Generator(device=device).manual_seed(0)
    heads, kv_heads, dim, block, blocks = 8, 2, 128, 16, 12
    seq_lens = torch.tensor([40, 17, 70], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 24, 25, 26], dtype=torch.int32, device=device)
    block_tables = torch.arange(blocks, dtype=torch.int32, device=device).view(3, 4)
    q = torch.randn(26, heads, dim, generator=gen, device=device).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(blocks, block, kv_heads, dim, generator=gen, device=device).to(torch.bfloat16)
                        for _ in range(2))
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, dim ** -0.5, 1.0, 1.0)
    try:
        got = _flashinfer_attention(*args)
    except Exception as exc:
        return f"its paged attention failed ({type(exc).__name__}: {exc})"
    want = _triton_attention(*args, None)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    return None if err <= 2 ** -6 else f"its paged attention differs from the Triton kernel's by {err:.2e}"


def _flashinfer_fits(q: torch.Tensor, k_cache: torch.Tensor, fp8_q_scale: float | None) -> bool:
    # Full FP8 is this engine's own emulation; FlashInfer has no float32 kernels.
    return (fp8_q_scale is None and q.dtype == torch.bfloat16 and k_cache.dtype in (torch.bfloat16, FP8_DTYPE)
            and q.shape[-1] in (64, 128, 256))


@functools.cache
def _flashinfer_wrapper(device: torch.device):
    import flashinfer
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")


def _flashinfer_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, k_scale: float,
                          v_scale: float) -> torch.Tensor:
    """FlashInfer's paged prefill kernel (its causal mask aligns the queries to the end of the context, as
    here). plan() reads the batch's layout on the host; every layer of a step passes the same metadata tensors, so
    the wrapper is planned once a step (when they or the shapes it was planned for change), not once a layer."""
    block_size = k_cache.shape[1]
    wrapper = _flashinfer_wrapper(q.device)
    key = (q.shape[1], k_cache.shape[2], q.shape[2], block_size, scale, q.dtype, k_cache.dtype)
    planned = getattr(wrapper, "fp8engine_planned", None)
    if planned is None or planned[0] is not query_start_loc or planned[1] is not seq_lens \
            or planned[2] is not block_tables or planned[3] != key:
        pages = (seq_lens + block_size - 1) // block_size
        used = torch.arange(block_tables.shape[1], device=q.device) < pages[:, None]
        wrapper.plan(query_start_loc.int(), F.pad(pages.cumsum(0), (1, 0)).int(), block_tables[used].int(),
                     (seq_lens - (pages - 1) * block_size).int(), q.shape[1], k_cache.shape[2], q.shape[2],
                     block_size, causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        # the metadata held (not their ids): a later step's tensors cannot take their place unnoticed
        planned = wrapper.fp8engine_planned = (query_start_loc, seq_lens, block_tables, key,
                                               int(query_start_loc[-1]))
    total = planned[4]
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    wrapper.run(q[:total].contiguous(), (k_cache, v_cache), k_scale=k_scale, v_scale=v_scale, out=out[:total])
    return out


# ------------------------------------------------------------------------------------------ entry point


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0, fp8_q_scale: float | None = None,
                           batch_invariant: bool = False, flashinfer: bool = False, quant: bool = False,
                           scale_fmt: str | None = None):
    """Varlen causal attention over a paged KV cache: the semantics of attention_ref.paged_attention_ref.
    batch_invariant: the Triton kernel on its one batch-invariant launch. flashinfer: FlashInfer where it fits
    (the kernel set passes what probe_flashinfer found; it plans by batch, so never when batch invariant).
    quant: the output [T, Hq * D] as the FP8 o_proj takes it, (E4M3 codes, 1 x 128 scales [T, Hq * D / 128]), bit
    for bit the group quant (fp8_triton.per_token_group_quant_fp8) of the rounded output: with D == 128 the
    Triton launch (or its combine) writes them itself; otherwise, or on FlashInfer, a launch after quantizes."""
    check_full_fp8(k_cache, fp8_q_scale)
    if k_cache.dtype != FP8_DTYPE:
        k_scale = v_scale = 1.0
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale)
    if flashinfer and not batch_invariant and _flashinfer_fits(q, k_cache, fp8_q_scale):
        out = _flashinfer_attention(*args)
    elif quant and q.shape[-1] == BLOCK:
        return _triton_attention(*args, fp8_q_scale, batch_invariant, quant=True, scale_fmt=scale_fmt)
    else:
        out = _triton_attention(*args, fp8_q_scale, batch_invariant)
    return per_token_group_quant_fp8(out.reshape(q.shape[0], -1), BLOCK, scale_fmt) if quant else out


def paged_attention_quant_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                 scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                                 fp8_q_scale: float | None = None, scale_fmt: str | None = None,
                                 batch_invariant: bool = False,
                                 flashinfer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel set's attention_quant: paged_attention_triton(..., quant=True), scale_fmt after fp8_q_scale."""
    return paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale,
                                  v_scale, fp8_q_scale, batch_invariant, flashinfer, quant=True, scale_fmt=scale_fmt)
