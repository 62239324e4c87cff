"""Linear layers in the model dtype or FP8 (W8A8, 128x128 weight blocks, 1x128 activation groups).

A layer may fuse several Hugging Face projections (q/k/v, gate/up) along the output dimension:
`shard_sizes` lists them. In FP8 each shard keeps its own 128x128 scale grid (the checkpoint
convention), stacked along the scale rows, so a shard can be loaded or updated on its own; when
every shard is a multiple of 128 rows the stacked grid is the fused grid and one GEMM serves all, and
otherwise the CPU kernel maps each output row to its scale row (one call still serves all shards).
"""

import torch
from torch import nn

from fp8engine.model_executor.kernel_set import KernelSet
from fp8engine.model_executor.layers.lora import LoRA
from fp8engine.weights import layout
from fp8engine.weights.quant import BLOCK, FP8_DTYPE, cdiv


class Linear(nn.Module):
    """fp8: E4M3 weights with block scales, run by kernels.fp8_linear; otherwise the model dtype, run by
    kernels.dense_linear. lora_rank > 0: a LoRA adapter of up to that rank beside it (layers/lora.py)."""

    def __init__(self, in_features: int, shard_sizes: list[int], dtype: torch.dtype, kernels: KernelSet,
                 bias: bool = False, fp8: bool = False, scale_fmt: str | None = None, lora_rank: int = 0):
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = list(shard_sizes)
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        self.out_features = sum(self.shard_sizes)
        self.kernels = kernels
        self.is_fp8 = fp8
        # tensor parallelism (model_executor/tensor_parallel.py, shard_for_tp): where this rank's rows and input columns
        # sit in the full weight, and what adds a row-parallel layer's partial sums over the ranks
        self.tp_rows: list[tuple[int, int]] | None = None
        self.tp_cols: tuple[int, int] | None = None
        self.reduce = None
        self.scale_fmt = scale_fmt
        weight_dtype = FP8_DTYPE if fp8 else dtype
        self.weight = _param(torch.empty(self.out_features, in_features, dtype=weight_dtype))
        self.bias = _param(torch.zeros(self.out_features, dtype=dtype)) if bias else None
        self.row_phases = [0] * len(self.shard_sizes)
        if fp8:
            self._scale_grid()
        self.lora = LoRA(in_features, self.shard_sizes, lora_rank, dtype, kernels) if lora_rank else None

    def _scale_grid(self) -> None:
        """The stacked scale grid: each shard's 128-row blocks, counted from its row phase (0 unless tensor parallelism
        starts the shard inside a block of the full weight)."""
        rows = [cdiv(phase + n, BLOCK) for phase, n in zip(self.row_phases, self.shard_sizes)]
        self.scale_row_offsets = [sum(rows[:i]) for i in range(len(rows))]
        self.weight_scale_inv = _param(torch.ones(sum(rows), cdiv(self.in_features, BLOCK)))
        self.fused_scales = (not any(self.row_phases)) and all(n % BLOCK == 0 for n in self.shard_sizes[:-1])
        # Otherwise output row n reads scale row scale_rows[n]: one CPU call serves every shard.
        self.scale_rows = None if self.fused_scales else torch.cat(
            [(torch.arange(size, dtype=torch.int32) + phase) // BLOCK + row0
             for size, phase, row0 in zip(self.shard_sizes, self.row_phases, self.scale_row_offsets)])

    def shard_for_tp(self, rows: list[tuple[int, int]] | None = None, cols: tuple[int, int] | None = None,
                     reduce=None) -> None:
        """Tensor parallelism: this rank holds rows start .. start + shard size of each fused shard's full weight
        (rows: (start, full rows) per shard; column-parallel), or input columns start .. start + in_features of the
        full weight (cols: (start, full columns); row-parallel, its partial sums added over the ranks by `reduce`,
        its bias after that). A column shard that starts inside a 128-row FP8 block keeps that block's scale for its
        rows, so its codes and scales are a slice of the unsharded layer's. Before the weights load."""
        self.tp_rows, self.tp_cols, self.reduce = rows, cols, reduce
        if self.lora is not None:  # update_lora takes the full A and B and writes this rank's slices
            self.lora.tp_rows, self.lora.tp_cols = rows, cols
        if rows is not None and self.is_fp8:
            self.row_phases = [start % BLOCK for start, _ in rows]
            self._scale_grid()

    def shard_views(self, shard: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight rows, scale rows) of one shard: views into the layer's own storage."""
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        weight = self.weight[start:start + size]
        if not self.is_fp8:
            return weight, None
        row0 = self.scale_row_offsets[shard]
        return weight, self.weight_scale_inv[row0:row0 + cdiv(self.row_phases[shard] + size, BLOCK)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is not None:  # row-parallel: this rank's partial sums, added over the ranks, then the bias
            y = self._base(x, with_bias=False)
            if self.lora is not None and self.lora.active:  # (x_r A_r^T) B^T: this rank's part of the adapter's sum
                y = self.lora(x, y)
            y = self.reduce(y)
            return y if self.bias is None else y + self.bias
        y = self._base(x)
        return y if self.lora is None or not self.lora.active else self.lora(x, y)

    def forward_quantized(self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype,
                          partials: bool = False) -> torch.Tensor:
        """The FP8 layer on activations quantized already (E4M3 [T, K] and their 1 x 128 scales, from a fused kernel
        before it: kernels.fp8_gemm); no LoRA (the fused path is built without it). A row-parallel layer's partial
        sums are added over the ranks, then its bias, as forward does. partials: a K-split launch may return its
        float32 partials [split, T, N] for the fused norm after it (not a row-parallel layer's: they are summed)."""
        gemm = self.kernels.fp8_gemm
        if self.reduce is not None:
            y = self.reduce(gemm(x_q, x_scale, self.weight, self.weight_scale_inv, out_dtype, None)
                            if self.fused_scales else self._quantized_shards(x_q, x_scale, out_dtype))
            return y if self.bias is None else y + self.bias
        if self.fused_scales:
            return gemm(x_q, x_scale, self.weight, self.weight_scale_inv, out_dtype, self.bias,
                        partials=partials and self.bias is None)
        out = self._quantized_shards(x_q, x_scale, out_dtype)
        return out if self.bias is None else out + self.bias

    def _quantized_shards(self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """forward_quantized of a layer whose fused shards have scales of their own, without its bias."""
        return torch.cat([self.kernels.fp8_gemm(x_q, x_scale, *self.shard_views(shard), out_dtype, None)
                          for shard in range(len(self.shard_sizes))], dim=-1)

    def _base(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        bias = self.bias if with_bias else None
        if not self.is_fp8:
            if self.kernels.dense_nt16 is not None and layout.is_marked(self.weight):
                return self.kernels.dense_nt16(x, self.weight, bias)
            return self.kernels.dense_linear(x, self.weight, bias)
        fp8_linear = self.kernels.fp8_linear
        if self.fused_scales:
            return fp8_linear(x, self.weight, self.weight_scale_inv, bias, self.scale_fmt)
        if self.kernels.fp8_scale_rows:
            return fp8_linear(x, self.weight, self.weight_scale_inv, bias, self.scale_fmt, self.scale_rows)
        parts = []
        for shard in range(len(self.shard_sizes)):
            weight, scale = self.shard_views(shard)
            parts.append(fp8_linear(x, weight, scale, None, self.scale_fmt))
        out = torch.cat(parts, dim=-1)
        return out if bias is None else out + bias


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)
