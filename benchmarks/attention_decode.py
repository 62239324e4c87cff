"""Micro-benchmark: the CPU paged-attention kernel at decode, each layer's KV cache from DRAM.

attention_micro.py calls the kernel on one cache over and over, which stays in L3 where it fits; in a decode step
every layer reads its own cache once. Here each shape gets as many layers' caches as spill L3 (80 MB in all), in
scattered blocks (a random block table, as a long-running engine's), and the time is per layer. One token a sequence,
the default model's heads (9 query, 3 kv, head_dim 64), bf16 queries; caches bf16, FP8 and FP8 with full-FP8
attention (q_scale > 0). --library loads a given build of the extension (fp8engine_cpu.so from the build cache)
instead of this checkout's, so that two commits' kernels can be timed in alternating processes.

    python benchmarks/attention_decode.py [--shapes 1x4096,8x1024,32x1024,8x160,32x160] [--library PATH]
"""

import argparse
import statistics
import time

import torch

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 9, 3, 64
SPILL_BYTES = 80e6


def run(shapes, rounds: int = 7) -> list[dict]:
    ops = torch.ops.fp8engine
    results = []
    for seqs, context in shapes:
        blocks = -(-context // BLOCK_SIZE)
        for name, dtype, q_scale in (("bf16", torch.bfloat16, 0.0), ("fp8", torch.float8_e4m3fn, 0.0),
                                     ("full-fp8", torch.float8_e4m3fn, 0.05)):
            gen = torch.Generator().manual_seed(0)
            per_layer = 2 * seqs * blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
            layers = max(2, int(SPILL_BYTES / per_layer))
            shape = (seqs * blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
            caches = [tuple((torch.randn(shape, generator=gen) * 0.5).to(dtype) for _ in "kv") for _ in range(layers)]
            q = torch.randn(seqs, NUM_HEADS, HEAD_DIM, generator=gen).bfloat16()
            table = torch.randperm(seqs * blocks, generator=gen).int().view(seqs, blocks)
            starts = torch.arange(seqs + 1, dtype=torch.int32)
            lens = torch.full((seqs,), context, dtype=torch.int32)

            def step():
                for k, v in caches:
                    ops.paged_attention(q, k, v, table, starts, lens, HEAD_DIM ** -0.5, 1.0, 1.0, q_scale, 0)

            step()
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                step()
                times.append((time.perf_counter() - start) / layers * 1e6)
            results.append({"seqs": seqs, "context": context, "cache": name, "layers": layers,
                            "us_per_layer": statistics.median(times)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x4096,8x1024,32x1024,8x160,32x160", help="seqs x keys, comma-separated")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--library", default=None, help="a built fp8engine_cpu.so to load instead of this checkout's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.library:
        torch.ops.load_library(args.library)
    else:
        from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops
        if load_cpu_ops() is None:
            raise SystemExit("the C++ kernels are not available on this machine")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    print(f"decode attention from DRAM, {torch.get_num_threads()} threads, us a layer (median of 7)")
    for r in run(shapes):
        print(f"{r['seqs']:>4} x {r['context']:<6} {r['cache']:<9} {r['us_per_layer']:9.1f}   ({r['layers']} layers)")


if __name__ == "__main__":
    main()
