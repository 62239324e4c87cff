"""Decode micro-benchmark of the CPU paged-attention kernel.

128 sequences x 256 cached tokens by default (--seqs, --context), 9 query / 3 kv heads, head_dim 64, bf16
queries, with bf16 and FP8 caches. Times the C++ kernel, the torch reference (per-sequence gather + masked
softmax), and a "gather + SDPA" baseline that copies every sequence's blocks into a dense batch first.

    python benchmarks/attention_micro.py [--seqs 128] [--context 256] [--threads 2]
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fp8engine.model_executor.kernels.attention_cpu import paged_attention_cpu
from fp8engine.model_executor.kernels.cpu_ops import cpu_kernel
from fp8engine.model_executor.kernels.attention_ref import FP8_DTYPE, paged_attention_ref, quantize_fp8

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
K_SCALE, V_SCALE = 0.05, 0.04


def _time_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _inputs(cache_dtype: torch.dtype, seqs: int, context: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if cache_dtype == FP8_DTYPE:
        k_cache, v_cache = quantize_fp8(k, K_SCALE), quantize_fp8(v, V_SCALE)
    else:
        k_cache, v_cache = k.to(cache_dtype), v.to(cache_dtype)
    return dict(
        q=torch.randn(seqs, NUM_HEADS, HEAD_DIM, generator=gen).bfloat16(),
        k_cache=k_cache, v_cache=v_cache,
        block_tables=torch.randperm(num_blocks, generator=gen).int().view(seqs, blocks_per_seq),
        query_start_loc=torch.arange(seqs + 1, dtype=torch.int32),
        seq_lens=torch.full((seqs,), context, dtype=torch.int32),
        scale=HEAD_DIM ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE,
    )


def _gather_sdpa(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale):
    """Dense baseline: copy each sequence's blocks out, dequantise, one batched SDPA call.

    Valid for this benchmark only: every sequence has the same length and one query token (the last
    position), so no mask is needed.
    """
    def dense(cache: torch.Tensor, cache_scale: float) -> torch.Tensor:
        x = cache[block_tables.long()].flatten(1, 2)[:, :int(seq_lens[0])].transpose(1, 2)  # [S, kv_heads, L, D]
        return x.to(q.dtype) * cache_scale if cache.dtype == FP8_DTYPE else x.to(q.dtype)

    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), dense(k_cache, k_scale), dense(v_cache, v_scale), scale=scale, enable_gqa=True)
    return out.squeeze(2)


def run(seqs: int = 128, context: int = 256, repeats: int = 20) -> dict:
    if cpu_kernel("paged_attention") is None:
        raise RuntimeError("the C++ paged-attention kernel is not available on this machine")
    results = {}
    for name, cache_dtype in (("bf16", torch.bfloat16), ("fp8", FP8_DTYPE)):
        args = _inputs(cache_dtype, seqs, context)
        timings = {
            "kernel_ms": _time_ms(lambda: paged_attention_cpu(**args), repeats),
            "reference_ms": _time_ms(lambda: paged_attention_ref(**args), max(3, repeats // 5)),
            "gather_sdpa_ms": _time_ms(lambda: _gather_sdpa(**args), repeats),
        }
        timings["reference_over_kernel"] = timings["reference_ms"] / timings["kernel_ms"]
        timings["gather_sdpa_over_kernel"] = timings["gather_sdpa_ms"] / timings["kernel_ms"]
        # The baseline must agree with the kernel for the timings to mean anything.
        diff = paged_attention_cpu(**args).float() - _gather_sdpa(**args).float()
        timings["max_abs_diff_vs_sdpa"] = diff.abs().max().item()
        results[name] = timings
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"decode: {args.seqs} seqs x {args.context} ctx, {NUM_HEADS}/{NUM_KV_HEADS} heads, head_dim {HEAD_DIM}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'cache':6}{'kernel ms':>11}{'ref ms':>10}{'sdpa ms':>10}{'ref/kernel':>12}{'sdpa/kernel':>13}"
          f"{'max |kernel - sdpa|':>21}")
    for name, t in run(args.seqs, args.context).items():
        print(f"{name:6}{t['kernel_ms']:11.3f}{t['reference_ms']:10.2f}{t['gather_sdpa_ms']:10.2f}"
              f"{t['reference_over_kernel']:12.1f}{t['gather_sdpa_over_kernel']:13.1f}"
              f"{t['max_abs_diff_vs_sdpa']:21.2e}")


if __name__ == "__main__":
    main()
