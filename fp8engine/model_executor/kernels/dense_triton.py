"""Triton kernels for batch-invariant model-dtype layers on CUDA: the linear GEMM (also the LM head, with
float32 logits), RMSNorm with the residual add fused in, and a LoRA adapter's share added to a linear's output.

torch's own kernels pick their blocking, split-K and reduction strategy by shape (cuBLAS heuristics, the
reduction launcher's per-output thread counts), so a row's result there can change with the number of
rows. These kernels have one launch for every M:
  * linear: one compiled kernel (never specialised on M) with one tile shape; each output element sums its
    K in BLOCK_K steps into one float32 accumulator, in order; no split-K. bf16 products are exact in
    float32, so the float32-logit LM head is "every product and sum in float32" as on CPU.
  * RMSNorm: one program per row, the whole row in registers: Hugging Face's order (add in the model
    dtype, float32 statistics, normalise, round, times the weight).

Under TRITON_INTERPRET=1 (CPU tensors; the tests) they use attention_triton's interpreter-safe conversions
and matmul (its docstring says why).
"""

import torch
import triton
import triton.language as tl

from fp8engine.model_executor.kernels import pdl
from fp8engine.model_executor.kernels.attention_triton import (_INTERPRET, _mma, _pdl_wait, _prefetch_l2, _round,
                                                               _upcast)

LINEAR_BLOCK_M = 64
LINEAR_BLOCK_N = 64
LINEAR_BLOCK_K = 64
LORA_BLOCK_R = 16  # the expand's K step: adapter ranks are 8-64


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """PDL: the first 128 bytes of each of its weight rows go to L2 before the wait (kernels/pdl.py)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    _prefetch_l2(b_ptr + tl.where(mask_n, offs_n, 0) * stride_bn, PDL)
    _pdl_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + (k0 + offs_k)[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _mma(a, b, acc, INTERPRET)
    if HAS_BIAS:
        acc += _upcast(tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0), tl.float32, INTERPRET)[None, :]
    out = _round(acc, c_ptr.dtype.element_ty, INTERPRET)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], out, mask=mask_m[:, None] & mask_n[None, :])


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) in float32, rounded to out_dtype (x's dtype by default); a row's
    result does not depend on the other rows."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, LINEAR_BLOCK_M), triton.cdiv(n, LINEAR_BLOCK_N))
        _linear_kernel[grid](x2, weight, out, bias, m, n, k, x2.stride(0), weight.stride(0), out.stride(0),
                             HAS_BIAS=bias is not None, BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=LINEAR_BLOCK_N,
                             BLOCK_K=LINEAR_BLOCK_K, INTERPRET=_INTERPRET, num_warps=4, num_stages=2,
                             **pdl.launch_options())
    return out.reshape(*x.shape[:-1], n)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, H, eps, stride_x, stride_r, stride_o, stride_s,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
                     PDL: tl.constexpr = False):
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    dtype = out_ptr.dtype.element_ty
    x = _upcast(tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0), tl.float32, INTERPRET)
    if HAS_RESIDUAL:
        r = _upcast(tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0), tl.float32, INTERPRET)
        x = _upcast(_round(x + r, dtype, INTERPRET), tl.float32, INTERPRET)  # the add in the model dtype
        tl.store(sum_ptr + row * stride_s + cols, _round(x, dtype, INTERPRET), mask=ok)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / H + eps)
    normed = _upcast(_round(x * inv, dtype, INTERPRET), tl.float32, INTERPRET)
    w = _upcast(tl.load(w_ptr + cols, mask=ok, other=0.0), tl.float32, INTERPRET)
    tl.store(out_ptr + row * stride_o + cols, _round(w * normed, dtype, INTERPRET), mask=ok)


def rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(s), s) with s = x + residual (or x): RMSNorm's forward, one program per row."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, h)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    out = torch.empty_like(x2, memory_format=torch.contiguous_format)
    summed = torch.empty_like(out) if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, summed, h, eps, x2.stride(0), r2.stride(0) if r2 is not None else 0,
            out.stride(0), summed.stride(0), HAS_RESIDUAL=residual is not None,
            BLOCK_H=triton.next_power_of_2(h), INTERPRET=_INTERPRET, num_warps=4, **pdl.launch_options())
    shape = x.shape
    return out.reshape(shape), (x if residual is None else summed.reshape(shape))


@triton.jit(do_not_specialize=["M"])
def _lora_expand_kernel(t_ptr, b_ptr, y_ptr, M, N, R, stride_t, stride_b, stride_y, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr):
    """y [M, N] += t [M, R] (float32) @ B [R, N] (B^T's rows, model dtype), summed in float32, y rounded once."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        mask_r = offs_r < R - r0
        t = tl.load(t_ptr + offs_m[:, None] * stride_t + (r0 + offs_r)[None, :],
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptr + (r0 + offs_r)[:, None] * stride_b + offs_n[None, :],
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc = _mma(t, _upcast(b, tl.float32, INTERPRET), acc, INTERPRET)
    mask = mask_m[:, None] & mask_n[None, :]
    y = _upcast(tl.load(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], mask=mask, other=0.0), tl.float32,
                INTERPRET)
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], _round(y + acc, y_ptr.dtype.element_ty, INTERPRET),
             mask=mask)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                    segments: torch.Tensor) -> torch.Tensor:
    """In place, y [..., N] += (x [..., K] A^T) B, B given transposed (bt [R, N]), by segments (int64 [S, 4] on the
    host: j0, j1, o0, o1 — A and B's rows j0:j1 feed y's columns o0:o1, nothing else); y contiguous. As
    layer_ops_ref.lora_add_ref up to the order of the float32 sums; a row's result does not depend on the others."""
    n, k = y.shape[-1], x.shape[-1]
    y2, x2 = y.view(-1, n), x.reshape(-1, k)
    m = y2.shape[0]
    for j0, j1, o0, o1 in segments.tolist():  # a host tensor: no device read
        if m == 0 or j1 == j0 or o1 == o0:
            continue
        t = linear_triton(x2, a[j0:j1], out_dtype=torch.float32)
        b, out = bt[j0:j1, o0:o1], y2[:, o0:o1]
        grid = (triton.cdiv(m, LINEAR_BLOCK_M), triton.cdiv(o1 - o0, LINEAR_BLOCK_N))
        _lora_expand_kernel[grid](t, b, out, m, o1 - o0, j1 - j0, t.stride(0), b.stride(0), out.stride(0),
                                  BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=LINEAR_BLOCK_N, BLOCK_R=LORA_BLOCK_R,
                                  INTERPRET=_INTERPRET, num_warps=4, num_stages=2)
    return y


# ------------------------------------------------------------------ the gated delta rule (hybrid models)
GDN_BLOCK_V = 32  # value columns a program keeps of its head's state: [dk, 32] float32 in registers


@triton.jit(do_not_specialize=["num_seqs"])
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, starts_ptr, out_ptr,
                          num_seqs, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    """One program per (sequence, value head, BLOCK_V value columns): the columns' state in registers, the
    sequence's tokens in order (csrc/gated_delta.cpp's arithmetic; sums over dk as tl.sum of one shape), so a
    state's bits do not depend on the batch or on how the tokens were split into calls."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kh = h // (HV // HK)
    rows = tl.arange(0, DK)
    slot = tl.load(slots_ptr + b)
    s_ptrs = state_ptr + ((slot * HV + h) * DK + rows[:, None]) * DV + cols[None, :]
    s = tl.load(s_ptrs)
    start = tl.load(starts_ptr + b).to(tl.int64)
    end = tl.load(starts_ptr + b + 1).to(tl.int64)
    for t in range(start, end):
        kt = tl.load(k_ptr + (t * HK + kh) * DK + rows)
        qt = tl.load(q_ptr + (t * HK + kh) * DK + rows)
        vt = tl.load(v_ptr + (t * HV + h) * DV + cols)
        s = s * tl.exp(tl.load(g_ptr + t * HV + h))
        mem = tl.sum(s * kt[:, None], axis=0)
        u = (vt - mem) * tl.load(beta_ptr + t * HV + h)
        s = s + kt[:, None] * u[None, :]
        tl.store(out_ptr + (t * HV + h) * DV + cols, tl.sum(s * qt[:, None], axis=0))
    tl.store(s_ptrs, s)


def gdn_recurrent_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, slots: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """The kernel set's gdn_recurrent on CUDA (csrc/gated_delta.cpp's contract): q, k [T, Hk, dk], v [T, Hv, dv],
    g, beta [T, Hv] float32 prepared (kernels/gated_delta_ref.kernel_inputs), state [N, Hv, dk, dv] float32
    advanced in place at the sequences' slots -> o [T, Hv, dv] float32. dk and dv powers of two, dv a multiple
    of GDN_BLOCK_V or smaller than it."""
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    block_v = min(GDN_BLOCK_V, dv)
    if dk & (dk - 1) or dv & (dv - 1) or hv % hk:
        raise ValueError(f"gdn_recurrent_triton: dk={dk} and dv={dv} must be powers of two and Hv={hv} a "
                         f"multiple of Hk={hk}")
    out = torch.empty(tokens, hv, dv, dtype=torch.float32, device=q.device)
    seqs = slots.numel()
    starts = query_start_loc.to(device=q.device, dtype=torch.int64)
    if seqs and tokens:
        _gdn_recurrent_kernel[(seqs, hv, dv // block_v)](
            q, k, v, g, beta, state, slots.to(device=q.device, dtype=torch.int64), starts, out, seqs, HK=hk, HV=hv,
            DK=dk, DV=dv, BLOCK_V=block_v, num_warps=4)
    return out
