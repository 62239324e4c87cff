"""Fused MoE on the GPU: one Triton grouped GEMM launch per projection over every expert's tokens.

Rows (token, slot) are sorted by expert and each expert's group is padded to whole BLOCK_M tiles, so a tile
belongs to one expert (vLLM's moe_align_block_size); the kernel gathers the tile's activation rows, runs
them against that expert's weight (bf16, or E4M3 with 128 x 128 block scales and 1 x 128 activation groups,
the numerics of fp8engine.weights.quant) and scatters the results back to the rows' own places. The
weighted sum over a token's experts is moe_ref's `combine`, as on CPU; moe_ref's `fused_moe_ref` is the
reference (tests/test_moe_triton.py runs this under TRITON_INTERPRET=1 against it). Model-dtype operands
multiply through attention_triton's `_mma` (float32 in IEEE precision, not TF32; bf16 upcast exactly under
the interpreter, which multiplies bf16 bit patterns as integers) and results round through its `_round`.
"""

import torch
import triton
import triton.language as tl

from fp8engine.model_executor.kernels.attention_triton import _mma, _round
from fp8engine.model_executor.kernels.fp8_triton import per_token_group_quant_fp8
from fp8engine.model_executor.kernels.moe_ref import ascending, combine, silu_and_mul_ref
from fp8engine.weights.quant import BLOCK, cdiv

BATCH_INVARIANT_BLOCK_M = 64
_INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _moe_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, scale_rows_ptr, c_ptr, rows_ptr, tile_expert_ptr,
                     N, K, num_rows, a_row_div,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                     stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                     FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     INTERPRET: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a tile past the last expert's (align_rows launches a fixed count)
        return
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = rows < num_rows
    a_rows = rows // a_row_div  # GEMM 1 reads token row // k of x, GEMM 2 its own row
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    if FP8:
        scale_rows = tl.load(scale_rows_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        bs_ptrs = b_scale_ptr + expert * stride_bse + scale_rows * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if FP8:
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm + kb * stride_ask, mask=mask_m, other=0.0)
            b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=mask_n, other=0.0)
            # a fresh dot per 128-wide K block, scaled into the float32 accumulator (as fp8_triton's GEMM)
            acc += tl.dot(a, b, out_dtype=tl.float32) * a_s[:, None] * b_s[None, :]
        else:
            acc = _mma(a, b, acc, INTERPRET)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, _round(acc, c_ptr.dtype.element_ty, INTERPRET), mask=mask_m[:, None] & mask_n[None, :])


# Batch invariant: never specialised on the row count, one tile shape for every batch.
_moe_gemm_kernel_bi = triton.jit(do_not_specialize=["num_rows"])(_moe_gemm_kernel.fn)


def align_rows(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows: the row indices of flat_ids sorted by expert, each expert's run padded with len(flat_ids) to a
    multiple of block_m; tile_expert: the expert of each block_m tile, -1 for the tiles past the last expert's).

    The tile count is the most n rows can need, ceil(n / block_m) + min(E, n) (each expert's run adds at most one
    partial tile), fixed by n: nothing is read back to the host, so a CUDA graph holds the routing (bincount, which
    reads its maximum back on CUDA, is a scatter-add here)."""
    n, device = len(flat_ids), flat_ids.device
    max_tiles = cdiv(n, block_m) + min(num_experts, n)
    order = flat_ids.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + block_m - 1) // block_m * block_m
    start, padded_start = counts.cumsum(0) - counts, padded.cumsum(0) - padded
    sorted_ids = flat_ids[order]
    rank = torch.arange(n, device=device) - start[sorted_ids]
    rows = torch.full((max_tiles * block_m,), n, dtype=torch.int32, device=device)
    rows[padded_start[sorted_ids] + rank] = order.to(torch.int32)
    tiles_end = (padded // block_m).cumsum(0)  # one past each expert's last tile
    tile_expert = torch.searchsorted(tiles_end, torch.arange(max_tiles, device=device), right=True).to(torch.int32)
    return rows, tile_expert.masked_fill_(tile_expert >= num_experts, -1)


def _gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
          scale_rows: torch.Tensor | None, rows: torch.Tensor, tile_expert: torch.Tensor, num_rows: int,
          a_row_div: int, out_dtype: torch.dtype, block_m: int, batch_invariant: bool) -> torch.Tensor:
    """out [num_rows, N]: row r = a[r // a_row_div] @ w[expert of r]^T for every row listed in rows."""
    _, n, k = w.shape
    out = torch.empty(num_rows, n, dtype=out_dtype, device=a.device)
    fp8 = w_scale is not None
    if fp8 and scale_rows is None:
        scale_rows = torch.arange(n, dtype=torch.int32, device=a.device) // BLOCK
    dummy = out  # stands in for the scale pointers on the bf16 path, never read
    grid = (len(tile_expert), cdiv(n, 128))
    kernel = _moe_gemm_kernel_bi if batch_invariant else _moe_gemm_kernel
    if len(tile_expert):
        kernel[grid](
            a, a_scale if fp8 else dummy, w, w_scale if fp8 else dummy, scale_rows if fp8 else dummy, out, rows,
            tile_expert, n, k, num_rows, a_row_div, *a.stride(), *w.stride(), *out.stride(),
            *(a_scale.stride() if fp8 else (0, 0)), *(w_scale.stride() if fp8 else (0, 0, 0)),
            FP8=fp8, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=BLOCK if fp8 else 64, INTERPRET=_INTERPRET,
            num_warps=4, num_stages=2)
    return out


def fused_moe_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                     scale_rows: torch.Tensor | None = None, scale_fmt: str | None = None,
                     batch_invariant: bool = False) -> torch.Tensor:
    """x [T, H]; topk_ids / topk_weights [T, k]; w13 [E, 2I, H], w2 [E, H, I] (bf16, or E4M3 with scale grids
    [E, rows, ceil(H/128)] / [E, ceil(H/128), ceil(I/128)], scale_rows mapping gate_up rows to theirs) -> [T, H],
    the semantics of layers/moe.py's fused_moe_ref."""
    ids, weights = ascending(topk_ids, topk_weights)
    t, k = ids.shape
    num_experts = w13.shape[0]
    block_m = BATCH_INVARIANT_BLOCK_M if batch_invariant else 16 if t * k <= 16 * num_experts else 64
    rows, tile_expert = align_rows(ids.reshape(-1), num_experts, block_m)
    fp8 = w13_scale is not None
    common = dict(rows=rows, tile_expert=tile_expert, num_rows=t * k, out_dtype=x.dtype, block_m=block_m,
                  batch_invariant=batch_invariant)
    a, a_scale = per_token_group_quant_fp8(x, BLOCK, scale_fmt) if fp8 else (x.contiguous(), None)
    h = _gemm(a, a_scale, w13, w13_scale, scale_rows, a_row_div=k, **common)
    act = silu_and_mul_ref(h)
    a, a_scale = per_token_group_quant_fp8(act, BLOCK, scale_fmt) if fp8 else (act.contiguous(), None)
    return combine(_gemm(a, a_scale, w2, w2_scale, None, a_row_div=1, **common), weights)
