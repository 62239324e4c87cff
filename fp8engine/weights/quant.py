"""FP8 (E4M3) blockwise quantization: the plain-torch definition every kernel is tested against.

Weights W[N, K] use 128 x 128 blocks, activations x[M, K] use 1 x 128 groups along K; the last
block in either direction may be partial. For a block B:

    scale = max(amax(|B|), 1e-12) / 448            (or 2^ceil(log2(that)) with scale_fmt="ue8m0")
    B_q   = E4M3(clamp(B / scale, -448, 448))

and the stored inverse scale is `scale` itself, so that `B ~= B_q * scale` (the Hugging Face /
DeepSeek-V3 `weight_scale_inv` convention).
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
_MIN_AMAX = 1e-12


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compute_scale(amax: torch.Tensor, scale_fmt: str | None = None) -> torch.Tensor:
    """float32 scales from float32 block amax values."""
    # Divided by a tensor, not a Python number: on CUDA torch turns "/ number" into "* (1 / number)", which is an
    # ulp off the IEEE quotient that the CPU and the Triton kernels compute for a third of the scales.
    amax = amax.float().clamp(min=_MIN_AMAX)
    scale = amax / torch.full((), FP8_MAX, device=amax.device)
    if scale_fmt == "ue8m0":
        mantissa, exponent = torch.frexp(scale)  # exact, unlike ceil(log2(.)) in float32
        scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).int())
    elif scale_fmt is not None:
        raise ValueError(f"fp8 scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    return scale


def _cast_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _pad_to_blocks(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    n, k = w.shape
    pn, pk = cdiv(n, block_n) * block_n - n, cdiv(k, block_k) * block_k - k
    return torch.nn.functional.pad(w, (0, pk, 0, pn)) if pn or pk else w


def weight_block_amax(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """amax of |w| per block x block tile: float32 [ceil(N/block), ceil(K/block)]."""
    n, k = w.shape
    padded = _pad_to_blocks(w.float().abs(), block, block)
    tiles = padded.view(cdiv(n, block), block, cdiv(k, block), block)
    return tiles.amax(dim=(1, 3))


def quantize_weight_blockwise(w: torch.Tensor, block: int = BLOCK,
                              scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W[N, K] (any float dtype) -> (W_q E4M3 [N, K], scale_inv float32 [ceil(N/b), ceil(K/b)])."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w.shape)}")
    n, k = w.shape
    scale = compute_scale(weight_block_amax(w, block), scale_fmt)
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return _cast_fp8(w.float() / full), scale


def quantize_weight_into(w: torch.Tensor, out_q: torch.Tensor, out_scale: torch.Tensor,
                         block: int = BLOCK, scale_fmt: str | None = None) -> None:
    """Quantize W into existing buffers (no re-allocation of out_q / out_scale)."""
    q, s = quantize_weight_blockwise(w, block, scale_fmt)
    out_q.copy_(q)
    out_scale.copy_(s)


def dequantize_weight_blockwise(w_q: torch.Tensor, scale_inv: torch.Tensor,
                                dtype: torch.dtype = torch.float32, block: int = BLOCK,
                                row_phase: int = 0) -> torch.Tensor:
    """W_q * its block scales; row_phase: W_q's first row sits that many rows into its first block (a tensor-parallel
    rank's slice of a weight, layers/linear.py)."""
    n, k = w_q.shape
    full = scale_inv.repeat_interleave(block, 0)[row_phase:row_phase + n].repeat_interleave(block, 1)[:, :k]
    return (w_q.float() * full).to(dtype)


def quantize_activation_groups(x: torch.Tensor, group: int = BLOCK,
                               scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x[M, K] -> (x_q E4M3 [M, K], scale float32 [M, ceil(K/group)]) per 1 x group tile."""
    m, k = x.shape
    padded = _pad_to_blocks(x.float(), 1, group)
    groups = padded.view(m, cdiv(k, group), group)
    scale = compute_scale(groups.abs().amax(dim=2), scale_fmt)
    x_q = _cast_fp8(groups / scale.unsqueeze(2)).view(m, -1)[:, :k]
    return x_q, scale


def fp8_block_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None, block: int = BLOCK,
                         scale_fmt: str | None = None, scale_rows: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 block linear: y = sum_b (x_q . W_q)_b * sx[m, b] * sw[r(n), b], float32 accumulation.

    x: [..., K] in the model dtype; returns [..., N] in x's dtype. r(n) = n // block, or scale_rows[n]
    for fused projections whose own scale grids are stacked (shards not multiples of `block` rows).
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n, k = w_q.shape
    x_q, sx = quantize_activation_groups(x2, block, scale_fmt)
    nkb = cdiv(k, block)
    out = torch.zeros(x2.shape[0], n, dtype=torch.float32, device=x.device)
    sw = w_scale_inv.repeat_interleave(block, 0)[:n] if scale_rows is None else w_scale_inv[scale_rows.long()]
    for b in range(nkb):
        ks = slice(b * block, min(k, (b + 1) * block))
        partial = x_q[:, ks].float() @ w_q[:, ks].float().t()
        out += partial * sx[:, b:b + 1] * sw[:, b].unsqueeze(0)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*shape[:-1], n)
