"""Micro-benchmark: the CPU BF16 and W8A8 block-FP8 linear kernels against torch's BF16 F.linear.

Shapes are the default model's (SmolLM2-135M) projections and LM head, for decode (M=1) and a
prefill chunk (M=128). The three are timed in alternating rounds and the best round of each is
kept, which makes the ratios robust to other load on the machine. "ours" is the C++ BF16 kernel
called directly, whatever bf16_linear_cpu.use_kernel picks for the engine.

    python -m fp8engine.benchmarks.fp8_linear_micro
"""

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fp8engine.model_executor.kernels import bf16_linear_cpu, fp8_linear_cpu
from fp8engine.weights import quant

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
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


def _bf16_linear() -> Callable:
    ops = bf16_linear_cpu.kernel_ops()
    if ops is None:
        return F.linear
    return lambda x, w: ops.bf16_linear(x, w, None)


def run() -> dict:
    """Per shape and M: microseconds per call of torch BF16, our BF16 kernel and FP8, and the speedups
    over torch (torch time / kernel time)."""
    torch.manual_seed(0)
    fp8, ours = _fp8_linear(), _bf16_linear()
    results = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
        w_q, w_s = quant.quantize_weight_blockwise(w)
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            t_torch, t_ours, t_fp8 = _best_times([functools.partial(F.linear, x, w), functools.partial(ours, x, w),
                                                  functools.partial(fp8, x, w_q, w_s)])
            results.append({"layer": name, "M": m, "N": n, "K": k, "bf16_us": t_torch * 1e6,
                            "ours_us": t_ours * 1e6, "fp8_us": t_fp8 * 1e6, "ours_speedup": t_torch / t_ours,
                            "speedup": t_torch / t_fp8, "engine_uses_ours": bf16_linear_cpu.use_kernel(m)})
    return {"backend": fp8_linear_cpu.cpu_fp8_backend(), "bf16_kernel": bf16_linear_cpu.kernel_ops() is not None,
            "threads": torch.get_num_threads(), "results": results}


def main() -> None:
    report = run()
    print(f"fp8 backend: {report['backend']}, bf16 kernel built: {report['bf16_kernel']}, "
          f"torch threads: {report['threads']}")
    print(f"{'layer':>8} {'M':>4} {'N':>5} {'K':>5} {'torch us':>9} {'ours us':>9} {'fp8 us':>9} "
          f"{'t/ours':>7} {'t/fp8':>7} {'engine':>7}")
    for r in report["results"]:
        engine = "ours" if r["engine_uses_ours"] else "torch"
        print(f"{r['layer']:>8} {r['M']:>4} {r['N']:>5} {r['K']:>5} {r['bf16_us']:>9.1f} {r['ours_us']:>9.1f} "
              f"{r['fp8_us']:>9.1f} {r['ours_speedup']:>7.2f} {r['speedup']:>7.2f} {engine:>7}")


if __name__ == "__main__":
    main()
