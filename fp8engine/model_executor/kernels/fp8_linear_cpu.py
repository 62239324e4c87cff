"""CPU W8A8 block-FP8 linear and weight quantization: the C++ kernels (csrc/fp8_linear.cpp). Numerics and
signatures are those of their references in fp8engine.weights.quant; the engine's kernel set
(model_executor/kernel_set.py) picks these where the kernels are built, the references elsewhere.

The kernel's GEMM runs on AMX tiles or on AVX-512 BF16 dot products, as the caller's `gemm` says ("auto": the
tiles where the CPU grants them)."""

import torch

from fp8engine.weights import quant

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _ue8m0(scale_fmt: str | None) -> bool:
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"fp8 scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    return scale_fmt == "ue8m0"


def fp8_block_linear_cpu(x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None, scale_fmt: str | None = None,
                         scale_rows: torch.Tensor | None = None, batch_invariant: bool = False,
                         gemm: str = "auto", nt16: bool = False) -> torch.Tensor:
    """y = x @ dequant(w_q)^T + bias with per-token 1x128 activation quantization; x: [..., K].

    scale_rows (int32 [N]): the w_scale_inv row of each output row, for stacked per-shard grids.
    batch_invariant: the kernel takes one path for every M (its GEMM, never chosen by M), so a row's result
    does not depend on the other rows. nt16: w_q holds its codes in the nt16 layout (weights/layout.py)."""
    kernel = torch.ops.fp8engine.fp8_block_linear
    ue8m0 = _ue8m0(scale_fmt)
    if (x.dim() == 2 and x.dtype in _KERNEL_DTYPES and x.is_contiguous() and w_q.is_contiguous()
            and w_scale_inv.dtype == torch.float32 and w_scale_inv.is_contiguous()):
        # The engine's case, without the conversions below: at decode, 120 calls a token make the
        # Python around the kernel count (3.5 us a call, 0.4 ms a token, for no-op reshapes and copies).
        return kernel(x, w_q, w_scale_inv, bias, ue8m0, scale_rows, batch_invariant, gemm, nt16)
    n, k = w_q.shape
    x2 = x.reshape(-1, k)
    if x.dtype not in _KERNEL_DTYPES:  # the reference computes in float32 and rounds once at the end
        x2 = x2.float()
    y = kernel(x2.contiguous(), w_q.contiguous(), w_scale_inv.float().contiguous(), bias, ue8m0, scale_rows,
               batch_invariant, gemm, nt16)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def block_scales_cpu(w: torch.Tensor, scale_fmt: str | None = None) -> tuple[torch.Tensor, bool] | None:
    """(the float32 block scales quantize_weight_into_cpu would give w, whether all are finite), computed
    without writing anything: weight updates validate with them (a NaN or Inf makes its block's scale
    non-finite) and quantize with them. None when the C++ kernel cannot take w; the caller then
    validates another way."""
    if w.dim() != 2 or w.dtype not in _WEIGHT_DTYPES or w.device.type != "cpu" or w.stride(-1) != 1:
        return None
    scales = torch.empty(quant.cdiv(w.shape[0], quant.BLOCK), quant.cdiv(w.shape[1], quant.BLOCK))
    return scales, torch.ops.fp8engine.fp8_block_scales_(w, scales, _ue8m0(scale_fmt))


def quantize_weight_into_cpu(w: torch.Tensor, out_q: torch.Tensor, out_scale: torch.Tensor,
                             scale_fmt: str | None = None, scales: torch.Tensor | None = None) -> None:
    """Block-quantize w [N, K] into the existing out_q (E4M3 [N, K]) and out_scale (float32 blocks).

    scales: w's block scales from block_scales_cpu, when the caller has them (skips that pass)."""
    ue8m0 = _ue8m0(scale_fmt)
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w.shape)}")
    if w.dtype not in _WEIGHT_DTYPES:
        w = w.float()
    if w.stride(-1) != 1:
        w = w.contiguous()
    direct = out_q.is_contiguous() and out_scale.is_contiguous()
    q = out_q if direct else torch.empty_like(out_q, memory_format=torch.contiguous_format)
    s = out_scale if direct else torch.empty_like(out_scale, memory_format=torch.contiguous_format)
    if scales is not None:
        s.copy_(scales)
    torch.ops.fp8engine.fp8_quantize_weight_(w, q, s, ue8m0, scales is not None)
    if not direct:
        out_q.copy_(q)
        out_scale.copy_(s)
