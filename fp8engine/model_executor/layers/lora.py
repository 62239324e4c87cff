"""A LoRA adapter beside a (fused) linear layer, unmerged: y = base(x) + (x A^T) B^T.

Buffers are allocated once for the largest rank (EngineConfig.max_lora_rank) and written in place by
`update_lora`. A fused layer (q/k/v, gate/up) holds one adapter per shard: shard s's A [r, K] in rows
s*R..s*R+r of `lora_a` [S*R, K], its B [N_s, r] (scaling folded in) transposed in the same rows and its output
columns of `lora_b` [S*R, N], zero elsewhere, so one pair of GEMMs serves every shard and a smaller rank or a shard without
an adapter adds exact zeros. The kernel set's lora_add runs it: on CPU the C++ kernel (csrc/layer_ops.cpp lora_add_:
each row's products in fp32, y rounded once, batch invariant), elsewhere two of its dense linears (Triton on CUDA);
kernels/layer_ops_ref.py lora_add_ref is the plain-torch reference.
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
        self.register_buffer("lora_b", torch.zeros(width, sum(self.shard_sizes), dtype=dtype), persistent=False)
        self.lora_add = kernels.lora_add
        self.ranks = [0] * len(self.shard_sizes)  # the rank each shard's adapter has (0: none); the rest is zeros
        # tensor parallelism (Linear.shard_for_tp): where this rank's output rows and input columns sit in the layer
        self.tp_rows: list[tuple[int, int]] | None = None
        self.tp_cols: tuple[int, int] | None = None
        # where each shard's full rows start in one HF module's B, when the shards are pieces of one module (a GDN
        # layer's in_proj_qkv under tensor parallelism: q, k and v a shard each); None: a module a shard
        self.module_starts: list[int] | None = None
        # per shard (j0, j1, o0, o1): rows j0:j1 of A and B (its rank's) feed output columns o0:o1; the kernel skips
        # the rest (zeros: other shards' blocks, ranks under max_rank)
        shards = enumerate(zip(self.shard_offsets, self.shard_sizes))
        self.register_buffer("segments", torch.tensor([[s * max_rank, s * max_rank, o, o + n] for s, (o, n) in shards],
                                                      dtype=torch.int64, device="cpu"), persistent=False)

    def set_rank(self, shard: int, rank: int) -> None:
        self.ranks[shard] = rank
        self.segments[shard, 1] = shard * self.max_rank + rank

    @property
    def active(self) -> bool:
        """Some shard holds an adapter (otherwise the layer skips both products)."""
        return any(self.ranks)

    def full_shape(self, shard: int) -> tuple[int, int]:
        """(output rows of the shard's HF module, input columns) of the full layer: an adapter's B and A have these."""
        rows = self.shard_sizes[shard] if self.tp_rows is None else self.tp_rows[shard][1]
        if self.module_starts is not None:
            rows = sum(full for _, full in self.tp_rows)
        return rows, self.lora_a.shape[1] if self.tp_cols is None else self.tp_cols[1]

    def module_shards(self, shard: int) -> list[int]:
        """The shards one HF module's adapter fills (that of `shard`)."""
        return [shard] if self.module_starts is None else list(range(len(self.shard_sizes)))

    def local(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slices of a full adapter's A [r, K] and B [N_s, r] (all of them at one rank): a column-parallel
        layer's B rows, a row-parallel layer's A columns."""
        if self.tp_rows is not None:
            start = self.tp_rows[shard][0] + (0 if self.module_starts is None else self.module_starts[shard])
            b = b[start:start + self.shard_sizes[shard]]
        if self.tp_cols is not None:
            start = self.tp_cols[0]
            a = a[:, start:start + self.lora_a.shape[1]]
        return a, b

    def shard_views(self, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A rows [R, K], B block [N_s, R]) of one shard: views into the buffers (B's transposed)."""
        rows = slice(shard * self.max_rank, (shard + 1) * self.max_rank)
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        return self.lora_a[rows], self.lora_b[rows, start:start + size].T

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's fresh output for x) plus the adapter's, in place."""
        return self.lora_add(y, x, self.lora_a, self.lora_b, self.segments)
