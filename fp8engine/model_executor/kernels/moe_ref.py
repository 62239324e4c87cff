"""Mixture-of-experts compute in plain torch: the grouping every backend shares and the reference
(`fused_moe_ref`) that the C++ path (layers/moe.py) and the Triton kernel (moe_triton.py) are tested against.

A token's k expert outputs are weighted and summed in ascending expert order, one rounding per add in the
model dtype, which is how transformers' expert loop accumulates them.
"""

from collections.abc import Callable

import torch
from torch.nn import functional as F

from fp8engine.weights.quant import fp8_block_linear_ref


def grouped_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(e, rows): rows grouped by expert with one stable
    sort, `expert` called once per expert that has tokens (x [T, H] -> [T, H])."""
    ids, weights = ascending(topk_ids, topk_weights)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    rows = x[order // k]
    out = torch.empty_like(rows)
    start = 0
    for e, count in enumerate(torch.bincount(flat).tolist()):
        if count:
            out[start:start + count] = expert(e, rows[start:start + count])
            start += count
    contrib = torch.empty_like(out)
    contrib[order] = out
    return combine(contrib, weights)


def ascending(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (expert ids, weights) reordered by ascending expert id (the order `combine` sums in)."""
    ids, perm = topk_ids.sort(dim=1)
    return ids, topk_weights.gather(1, perm)


def combine(contrib: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """contrib [T * k, H], row t * k + j the output of token t's j-th expert, weights [T, k] -> [T, H]: the
    weighted sum in slot order (ascending expert ids), one rounding per add in contrib's dtype, as
    transformers' expert loop adds them."""
    t, k = weights.shape
    c = contrib.view(t, k, -1) * weights.unsqueeze(-1)
    if k == 1:
        return c[:, 0].contiguous()
    y = c[:, 0] + c[:, 1]
    for j in range(2, k):
        y = y + c[:, j]
    return y


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  scale_rows: torch.Tensor | None = None, scale_fmt: str | None = None) -> torch.Tensor:
    """Plain-torch MoE: F.linear in x's dtype, or fp8_block_linear_ref when the weights are E4M3."""
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        if w13_scale is None:
            return F.linear(silu_and_mul_ref(F.linear(rows, w13[e])), w2[e])
        h = fp8_block_linear_ref(rows, w13[e], w13_scale[e], scale_fmt=scale_fmt, scale_rows=scale_rows)
        return fp8_block_linear_ref(silu_and_mul_ref(h), w2[e], w2_scale[e], scale_fmt=scale_fmt)
    return grouped_moe(x, topk_ids, topk_weights, expert)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
