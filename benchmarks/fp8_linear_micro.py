"""Micro-benchmark: the CPU BF16 and W8A8 block-FP8 linear kernels against torch's BF16 F.linear.

Shapes are the default model's (SmolLM2-135M) projections and LM head, from decode (M=1) to batched
decode and prefill chunks (M=512). All are timed in alternating rounds and the best round of each is
kept, which makes the ratios robust to other load on the machine. "ours" is the C++ BF16 kernel
called directly, whatever bf16_linear_cpu.kernel_takes picks for the engine. The FP8 kernel runs once
per GEMM this CPU has ("avx512", and "amx" with AMX tiles), as the engine calls it ("fp8", small M on the
GEMV) and batch invariant ("bi", the GEMM for every M).

    python benchmarks/fp8_linear_micro.py [--rows 1,4,16,64,128,512] [--layers qkv,o,gate_up,down]
"""

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fp8engine.model_executor.kernels import bf16_linear_cpu
from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops
from fp8engine.weights import quant

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
ROWS = (1, 4, 16, 64, 128, 512)


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


def _ops():
    ops = load_cpu_ops()
    if ops is None or not hasattr(ops, "fp8_block_linear") or not hasattr(ops, "bf16_linear"):
        raise RuntimeError("the C++ linear kernels are not built on this machine (they need AVX512-BF16)")
    return ops


def gemms() -> list[str]:
    """The GEMMs the kernels can run on this CPU ("amx" needs AMX tiles the OS grants)."""
    return ["avx512", "amx"] if _ops().amx_usable() else ["avx512"]


def _fp8_linear(gemm: str, batch_invariant: bool) -> Callable:
    ops = _ops()
    return lambda x, w_q, w_s: ops.fp8_block_linear(x, w_q, w_s, None, False, None, batch_invariant, gemm)


def run(rows: tuple[int, ...] = ROWS, layers: tuple[str, ...] = tuple(SHAPES)) -> dict:
    """Per layer and M: microseconds per call of torch BF16, our BF16 kernel and FP8 on each GEMM ("fp8 amx",
    "bi amx", ...), and the speedups over torch (torch time / kernel time)."""
    torch.manual_seed(0)
    ops = _ops()
    best = gemms()[-1]
    fp8 = {f"{mode} {gemm}": _fp8_linear(gemm, mode == "bi") for gemm in gemms() for mode in ("fp8", "bi")}
    results = []
    for name in layers:
        n, k = SHAPES[name]
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
        w_q, w_s = quant.quantize_weight_blockwise(w)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            fns = [functools.partial(F.linear, x, w), functools.partial(ops.bf16_linear, x, w, None, False, False, best)]
            fns += [functools.partial(fn, x, w_q, w_s) for fn in fp8.values()]
            t_torch, t_ours, *t_fp8 = _best_times(fns)
            results.append({"layer": name, "M": m, "N": n, "K": k, "bf16_us": t_torch * 1e6,
                            "ours_us": t_ours * 1e6, "ours_speedup": t_torch / t_ours,
                            "fp8_us": {key: t * 1e6 for key, t in zip(fp8, t_fp8)},
                            "fp8_speedup": {key: t_torch / t for key, t in zip(fp8, t_fp8)},
                            "engine_uses_ours": bf16_linear_cpu.kernel_takes(m, False, best)})
    return {"backend": f"cpp-{best}", "bf16_kernel": True, "threads": torch.get_num_threads(), "fp8": list(fp8),
            "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    parser.add_argument("--layers", default="qkv,o,gate_up,down,lm_head", help=f"comma-separated, of {list(SHAPES)}")
    args = parser.parse_args()
    report = run(tuple(int(m) for m in args.rows.split(",")), tuple(args.layers.split(",")))
    print(f"fp8 backend: {report['backend']}, bf16 kernel built: {report['bf16_kernel']}, "
          f"torch threads: {report['threads']}")
    keys = report["fp8"]
    print(f"{'layer':>8} {'M':>4} {'N':>5} {'K':>5} {'torch us':>9} {'ours us':>9} "
          + " ".join(f"{key:>11}" for key in keys) + f" {'t/ours':>7} " + " ".join(f"{'t/' + key:>13}" for key in keys)
          + f" {'engine':>7}")
    for r in report["results"]:
        engine = "ours" if r["engine_uses_ours"] else "torch"
        print(f"{r['layer']:>8} {r['M']:>4} {r['N']:>5} {r['K']:>5} {r['bf16_us']:>9.1f} {r['ours_us']:>9.1f} "
              + " ".join(f"{r['fp8_us'][key]:>11.1f}" for key in keys) + f" {r['ours_speedup']:>7.2f} "
              + " ".join(f"{r['fp8_speedup'][key]:>13.2f}" for key in keys) + f" {engine:>7}")


if __name__ == "__main__":
    main()
