"""Decode-sized FP8 GEMM launches on an 8B's layers timed under CUDA graphs (triton.testing.do_bench_cudagraph: no
host overhead, which benchmarks/gpu_gemm_sweep.py's timings include), plain and batch-invariant kernels, at 1, 8 and
16 rows; what gemm_config's decode rule (K split for deep layers) comes from. Run from the checkout on a GPU:

    python -m benchmarks.gpu_decode_tiles
"""
import torch


def main() -> None:
    if not torch.cuda.is_available():
        print("gpu_decode_tiles: no CUDA device here, nothing ran")
        return
    import triton.testing

    from benchmarks.gpu_gemm_sweep import LAYERS as layers
    from fp8engine.model_executor.kernels import fp8_triton as ft
    from fp8engine.model_executor.kernels.fp8_triton import GemmConfig as G
    cfgs = [G(16, 32, 1, 4, 4), G(16, 64, 1, 4, 4), G(64, 32, 1, 4, 4), G(64, 64, 1, 4, 4), G(64, 128, 1, 4, 4),
            G(16, 32, 2, 4, 4), G(16, 32, 4, 4, 4)]
    tot = {}
    for rows in (1, 8, 16):
        for name, (n, k) in layers.items():
            w_q, w_s = ft.quantize_weight_blockwise_triton(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * .02)
            x_q, x_s = ft.per_token_group_quant_fp8(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
            line = []
            for bi in (False, True):
                for c in cfgs:
                    if bi and (c.block_m != 64 or c.split_k != 1):
                        continue
                    fn = lambda: ft.w8a8_matmul_with(c, x_q, x_s, w_q, w_s, torch.bfloat16, None, bi)
                    fn()
                    us = triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3
                    key = (bi,) + tuple(c)
                    tot[(rows, key)] = tot.get((rows, key), 0) + us
                    line.append(f"{'bi' if bi else ''}{c.block_m}x{c.block_n}s{c.split_k}:{us:.1f}")
            print(f"rows {rows:3d} {name:12s} ({n * k / 1e6:.0f} MB) " + " ".join(line), flush=True)
    for rows in (1, 8, 16):
        best = sorted((v, k) for (r, k), v in tot.items() if r == rows)
        print("rows", rows, "sum us by launch:", [(round(v, 1), k) for v, k in best])


if __name__ == "__main__":
    main()
