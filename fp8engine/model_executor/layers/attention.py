"""Paged attention layer: writes this step's K/V into the paged cache, then attends over it."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fp8engine.model_executor.kernel_set import KernelSet


@dataclass(slots=True)
class AttentionMetadata:
    """Flat varlen batch: T query tokens from S sequences.

    slot_mapping [T] int64: cache slot (block * block_size + offset) of each new token.
    query_start_loc [S+1] int32, seq_lens [S] int32 (context incl. new tokens),
    block_tables [S, max_blocks] int32.
    state_slots [S] int64: each sequence's slot in the state pool (hybrid models; None: one sequence from the zero
    state, a detached forward).
    decode: every sequence has one new token (a CUDA graph's decode step): layers that need the lengths on the host
    know them without reading them back.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor | None = None
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    decode: bool = False


class Attention(nn.Module):
    def __init__(self, name: str, num_heads: int, num_kv_heads: int, head_dim: int, kernels: KernelSet):
        super().__init__()
        self.name = name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.q_scale = 0.0
        self.observer: Callable | None = None
        self.kernels = kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        if self.observer is not None:
            self.observer(self, q, k, v)
        self.kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the cache as it is (this step's K/V written already: by forward, or by the fused qkv
        epilogue): q [T, Hq, D] -> [T, Hq * D]."""
        out = self.kernels.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc,
                                           meta.seq_lens, self.scale, self.k_scale, self.v_scale,
                                           self.q_scale or None)
        return out.reshape(q.shape[0], -1)

    def attend_quantized(self, q: torch.Tensor, meta: AttentionMetadata,
                         scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """attend's output as an FP8 o_proj takes it, (E4M3 [T, Hq * D], its 1 x 128 scales), quantized in the
        attention launch (kernels.attention_quant: the fused CUDA path)."""
        return self.kernels.attention_quant(q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc,
                                            meta.seq_lens, self.scale, self.k_scale, self.v_scale,
                                            self.q_scale or None, scale_fmt)
