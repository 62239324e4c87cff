"""Micro-benchmark: the CPU W8A8 block-FP8 linear kernel against torch's BF16 F.linear.

Shapes are the default model's (SmolLM2-135M) projections, for decode (M=1) and a prefill chunk
(M=128). The two are timed in alternating rounds and the best round of each is kept, which makes the
ratio robust to other load on the machine.

    python -m fp8engine.benchmarks.fp8_linear_micro
"""

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fp8engine.model_executor.kernels import fp8_linear_cpu
from fp8engine.weights import quant

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 128)


def _best_times(fns: list[Callable[[], object]], rounds: int = 30, round_s: float = 2e-3) -> list[float]:
    """Best seconds per call of each fn, over rounds that alternate between them."""
    for fn in fns:
        fn()
    calls = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        calls.append(max(1, int(round_s / max(time.perf_counter() - t0, 1e-7))))
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls[i]):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls[i])
    return best


def _fp8_linear() -> Callable:
    ops = fp8_linear_cpu.kernel_ops()
    if ops is None:
        return lambda x, w_q, w_s: fp8_linear_cpu.fp8_block_linear_cpu(x, w_q, w_s)
    return lambda x, w_q, w_s: ops.fp8_block_linear(x, w_q, w_s, None, False)


def run() -> dict:
    """Per shape and M: BF16 and FP8 microseconds per call and the speedup (BF16 time / FP8 time)."""
    torch.manual_seed(0)
    fp8 = _fp8_linear()
    results = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
        w_q, w_s = quant.quantize_weight_blockwise(w)
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            t_bf16, t_fp8 = _best_times([functools.partial(F.linear, x, w), functools.partial(fp8, x, w_q, w_s)])
            results.append({"layer": name, "M": m, "N": n, "K": k, "bf16_us": t_bf16 * 1e6,
                            "fp8_us": t_fp8 * 1e6, "speedup": t_bf16 / t_fp8})
    return {"backend": fp8_linear_cpu.cpu_fp8_backend(), "threads": torch.get_num_threads(), "results": results}


def main() -> None:
    report = run()
    print(f"fp8 backend: {report['backend']}, torch threads: {report['threads']}")
    print(f"{'layer':>8} {'M':>4} {'N':>5} {'K':>5} {'bf16 us':>9} {'fp8 us':>9} {'bf16/fp8':>9}")
    for r in report["results"]:
        print(f"{r['layer']:>8} {r['M']:>4} {r['N']:>5} {r['K']:>5} {r['bf16_us']:>9.1f} {r['fp8_us']:>9.1f} "
              f"{r['speedup']:>9.2f}")


if __name__ == "__main__":
    main()
