"""The FP8 GEMM's launches timed on a GPU, on the linears of an 8B-shaped Llama (hidden 4096, MLP 14336, 32 / 8
heads of 128): tile rows and columns, K split, warps and stages, at decode and prefill row counts, beside torch's
BF16 matmul on the same shapes and the batch-invariant launch. Prints one line per (rows, layer) with the best
launch and the default's, and writes every timing as JSON; w8a8_block_fp8_matmul's choice of launch comes from
here. Without CUDA it says so and exits 0.

    python -m benchmarks.gpu_gemm_sweep [--json bench_results/gpu_gemm_sweep.json] [--rows 1,16,64,256]
                                        [--batch-invariant]
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

LAYERS = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


def configs(rows: int, batch_invariant: bool):
    from fp8engine.model_executor.kernels.fp8_triton import GemmConfig
    if batch_invariant:  # one launch for every M: 64-row tiles (wgmma), no K split
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (3, 4)):
            yield GemmConfig(64, block_n, 1, warps, stages)
    elif rows <= 16:
        for block_n, split, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (2, 4)):
            yield GemmConfig(16, block_n, split, 4, stages)
    else:
        for block_m, block_n, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4)):
            yield GemmConfig(block_m, block_n, 1, warps, stages)


def run(rows_list: list[int], batch_invariant: bool = False) -> dict:
    import triton.testing

    from fp8engine.model_executor.kernels import fp8_triton as ft
    torch.manual_seed(0)
    results = []
    for rows, (layer, (n, k)) in itertools.product(rows_list, LAYERS.items()):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w_q, w_s = ft.quantize_weight_blockwise_triton(w)
        x_q, x_s = ft.per_token_group_quant_fp8(x)
        want = ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16).float()
        fp8_bytes = n * k + rows * k + rows * n * 2
        bf16_us = triton.testing.do_bench(lambda: x @ w.T, warmup=5, rep=25) * 1e3
        row = {"layer": layer, "n": n, "k": k, "rows": rows, "bf16_matmul_us": round(bf16_us, 2), "launches": []}
        default = ft.w8a8_block_fp8_matmul
        row["default_us"] = round(triton.testing.do_bench(
            lambda: default(x_q, x_s, w_q, w_s, torch.bfloat16), warmup=5, rep=25) * 1e3, 2)
        row["batch_invariant_us"] = round(triton.testing.do_bench(
            lambda: default(x_q, x_s, w_q, w_s, torch.bfloat16, batch_invariant=True), warmup=5, rep=25) * 1e3, 2)
        for config in configs(rows, batch_invariant):
            try:
                got = ft.w8a8_matmul_with(config, x_q, x_s, w_q, w_s, torch.bfloat16, None, batch_invariant).float()
                err = float((got - want).abs().max() / want.abs().max())
                us = triton.testing.do_bench(lambda: ft.w8a8_matmul_with(
                    config, x_q, x_s, w_q, w_s, torch.bfloat16, None, batch_invariant), warmup=5, rep=25) * 1e3
            except Exception as exc:  # a launch that does not fit (shared memory, registers) is a result too
                row["launches"].append({"config": list(config), "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            row["launches"].append({"config": list(config), "us": round(us, 2), "rel_err": float(f"{err:.3g}"),
                                    "gb_per_s": round(fp8_bytes / us / 1e3, 1)})
        timed = [launch for launch in row["launches"] if "us" in launch]
        best = min(timed, key=lambda launch: launch["us"]) if timed else {"config": None, "us": float("nan")}
        row["best"] = best
        print(f"{layer:13s} rows {rows:4d}: bf16 {bf16_us:8.1f} us | fp8 default {row['default_us']:8.1f} "
              f"bi {row['batch_invariant_us']:8.1f} best {best['us']:8.1f} us {best.get('gb_per_s', 0):7.1f} GB/s "
              f"{best['config']} err {best.get('rel_err')}", flush=True)
        results.append(row)
        del w, x, w_q, w_s, x_q, x_s
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "rows": rows_list, "batch_invariant": batch_invariant,
            "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="bench_results/gpu_gemm_sweep.json")
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--batch-invariant", action="store_true", help="the batch-invariant kernel's launches")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_gemm_sweep: no CUDA device here, nothing ran")
        return 0
    report = run([int(r) for r in args.rows.split(",")], args.batch_invariant)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
