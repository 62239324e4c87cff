"""CPU paged attention and KV-cache write: the C++ kernels (csrc/paged_attention.cpp). Signatures and semantics
are those of attention_ref, their reference, which the kernel set runs where the kernels are not built."""

import torch

from fp8engine.model_executor.kernels.attention_ref import check_full_fp8


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
                        v_scale: float = 1.0, fp8_q_scale: float | None = None,
                        fixed_partition: int = 0) -> torch.Tensor:
    """fixed_partition: 0 lets the kernel split long contexts by the batch's total keys; a multiple of 16
    splits every context at that many keys, so a query row's result does not depend on the batch."""
    check_full_fp8(k_cache, fp8_q_scale)
    return torch.ops.fp8engine.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                               k_scale, v_scale, 0.0 if fp8_q_scale is None else fp8_q_scale,
                                               fixed_partition)


def write_kv_cache_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    torch.ops.fp8engine.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
