"""A LoRA adapter beside a (fused) linear layer, unmerged: y = base(x) + (x A^T) B^T.

Buffers are allocated once for the largest rank (EngineConfig.max_lora_rank) and written in place by
`update_lora`. A fused layer (q/k/v, gate/up) holds one adapter per shard: shard s's A [r, K] in rows
s*R..s*R+r of `lora_a` [S*R, K], its B [N_s, r] (scaling folded in) in its output rows and the same columns of
`lora_b` [N, S*R], zero elsewhere, so one pair of GEMMs serves every shard and a smaller rank or a shard without
an adapter adds exact zeros. Both products run through the kernel set's dense linear: the C++ kernels on CPU
(batch invariant when the engine is), Triton on CUDA; `lora_reference` is the plain-torch reference.
"""

import torch
from torch import nn

from fp8engine.model_executor.kernel_set import KernelSet


class LoRA(nn.Module):
    def __init__(self, in_features: int, shard_sizes: list[int], max_rank: int, dtype: torch.dtype,
                 kernels: KernelSet):
        super().__init__()
        self.max_rank = max_rank
        self.shard_sizes = list(shard_sizes)
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        width = len(self.shard_sizes) * max_rank
        # buffers, not parameters: no checkpoint holds them, update_lora writes them
        self.register_buffer("lora_a", torch.zeros(width, in_features, dtype=dtype), persistent=False)
        self.register_buffer("lora_b", torch.zeros(sum(self.shard_sizes), width, dtype=dtype), persistent=False)
        self.dense_linear = kernels.dense_linear
        self.ranks = [0] * len(self.shard_sizes)  # the rank each shard's adapter has (0: none); the rest is zeros

    @property
    def active(self) -> bool:
        """Some shard holds an adapter (otherwise the layer skips both products)."""
        return any(self.ranks)

    def shard_views(self, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A rows [R, K], B block [N_s, R]) of one shard: views into the buffers."""
        cols = slice(shard * self.max_rank, (shard + 1) * self.max_rank)
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        return self.lora_a[cols], self.lora_b[start:start + size, cols]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x) plus the adapter's."""
        return y + self.dense_linear(self.dense_linear(x, self.lora_a, None), self.lora_b, None)


def lora_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """What one shard's adapter adds, as PEFT computes it: scaling * (x A^T) B^T, in float32."""
    return scaling * (x.float() @ a.float().T) @ b.float().T
