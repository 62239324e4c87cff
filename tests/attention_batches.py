"""Random paged-attention batches shared by the CPU-kernel and Triton-kernel tests."""

import math

import torch

from fp8engine.model_executor.kernels.attention_ref import FP8_DTYPE, quantize_fp8

K_SCALE, V_SCALE, Q_SCALE = 0.05, 0.03, 0.02  # real values ~N(0, 1) use a good part of the E4M3 range


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               cache_dtype: torch.dtype, q_dtype: torch.dtype = torch.float32, seed: int = 0,
               strided_q: bool = False) -> dict:
    """Arguments of paged_attention for random data, with every sequence's blocks shuffled over the pool.

    seqs: (context length including the new tokens, new query tokens) per sequence. strided_q gives q
    as sliced from a fused qkv projection (rows are strided).
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks, generator=gen).int()
    # Entries past a sequence's need are invalid on purpose: the kernel must not read them.
    block_tables = torch.full((len(seqs), max(needed) + 2), -1, dtype=torch.int32)
    for s, start in enumerate(torch.tensor([0] + needed).cumsum(0)[:-1].tolist()):
        block_tables[s, :needed[s]] = ids[start:start + needed[s]]

    def cache(scale: float) -> torch.Tensor:
        return random_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, gen, scale)

    q_lens = torch.tensor([n for _, n in seqs])
    num_tokens = int(q_lens.sum())
    extra = 2 * num_kv_heads if strided_q else 0
    q = torch.randn(num_tokens, num_heads + extra, head_dim, generator=gen).to(q_dtype)[:, :num_heads]
    return dict(
        q=q, k_cache=cache(K_SCALE), v_cache=cache(V_SCALE), block_tables=block_tables,
        query_start_loc=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int(),
        seq_lens=torch.tensor([seq_len for seq_len, _ in seqs], dtype=torch.int32),
        scale=head_dim ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE,
    )


def random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """A KV cache of N(0, 1) values, stored as E4M3 with `scale` when dtype is FP8."""
    x = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return quantize_fp8(x, scale) if dtype == FP8_DTYPE else x.to(dtype)
