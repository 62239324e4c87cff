"""What T = 2 equal to T = 1 bit for bit would cost (issue 65, item 4): the T = 1 engine would split every
row-parallel GEMM (o_proj, down_proj) into P fixed parts over K and add their outputs in order, as P / T ranks a rank
would. Times one FP8 GEMM over K against P over K / P plus the ordered adds, on the engine's own kernels (those of a
batch-invariant FP8 engine: the nt16 layout on AVX-512), at layer 0's shapes of the bench's `--model`, batch 1 and
32; best of 3 runs a side, alternating.

    python benchmarks/tp_invariant_cost.py [--model qwen3-0.6b-shape] [--splits 2,4] [--batches 1,32]
"""

import argparse
import time

import torch

from fp8engine import EngineConfig, LLMEngine
from fp8engine.bench import model_shapes
from fp8engine.weights import layout
from fp8engine.weights.quant import quantize_weight_blockwise


def _weights(kernels, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = quantize_weight_blockwise(torch.randn(n, k) * 0.02)
    if kernels.fp8_nt16:
        layout.mark(layout.to_nt16_(codes))
    return codes, scales


def _micros(fn, reps: int) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b-shape", choices=list(model_shapes.SHAPES))
    parser.add_argument("--splits", default="2,4")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=model_shapes.shape_path(args.model), load_format="dummy",
                                    quantization="fp8", batch_invariant=True, kv_cache_memory_bytes=1 << 28))
    kernels, layer = engine.runner.kernels, engine.runner.model.model.layers[0]
    print(f"{args.model}, {kernels.names['fp8_linear']}, {args.threads} threads")
    for label, linear in (("o_proj", layer.self_attn.o_proj), ("down_proj", layer.mlp.down_proj)):
        n, k = linear.weight.shape
        whole = _weights(kernels, n, k)
        for parts in (int(p) for p in args.splits.split(",")):
            pieces = [_weights(kernels, n, k // parts) for _ in range(parts)]
            for m in (int(b) for b in args.batches.split(",")):
                x = torch.randn(m, k).to(torch.bfloat16)
                xs = [x[:, i * k // parts:(i + 1) * k // parts].contiguous() for i in range(parts)]

                def one():
                    return kernels.fp8_linear(x, *whole, None, None)

                def split():
                    y = kernels.fp8_linear(xs[0], *pieces[0], None, None).float()
                    for xi, w in zip(xs[1:], pieces[1:]):
                        y += kernels.fp8_linear(xi, *w, None, None)
                    return y.to(x.dtype)
                reps = 300 if m == 1 else 100
                a, b = [], []
                for _ in range(3):
                    a.append(_micros(one, reps))
                    b.append(_micros(split, reps))
                print(f"{label} [{n} x {k}] P={parts} batch {m}: one GEMM {min(a):.1f} us, split {min(b):.1f} us "
                      f"(+{min(b) - min(a):.1f} us, {min(b) / min(a):.3f}x)")
    engine.shutdown()


if __name__ == "__main__":
    main()
