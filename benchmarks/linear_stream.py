"""Micro-benchmark: the CPU linear kernels as a model forward runs them, every layer's weights from DRAM.

fp8_linear_micro.py times one weight over and over, so it stays in the caches; a decode step streams all 30
layers' weights (106 MB in FP8, 212 MB in BF16 for the default model) and the LM head (57 MB, BF16) once. Here
each kernel runs the 30 layers' four projections of the default model's shapes, each layer its own weights, then
the head ("fp8+head8": the FP8 layers and then the head in FP8, as EngineConfig.lm_head_fp8 runs them), at each M,
in alternating rounds (the best round kept). "fp8-bi", "bf16-bi" and "head-bi" run batch-invariant calls on weights
in the nt16 layout, as a batch-invariant engine on AMX stores them ("auto": nt16 in the tiles' order at a few rows,
the tiles above), beside the plain calls on rows ("rows": the gemv at 1-2 rows, the tiles above). Each AVX-512
kernel is forced by its `gemm` name ("avx512-gemv": K
in the lanes, "avx512-nt": weight rows in the lanes, "avx512-gemm": activation rows in the lanes; "auto": what the
engine runs at that M), beside torch's F.linear for BF16. The DRAM floor is the bytes a
forward reads over the stream bandwidth measured here, two ways: a copy of a 256 MB tensor (read + written bytes,
memcpy's non-temporal stores) and a read of one (torch's sum over float32: only reads, as a forward). On these VMs
either can come out higher (Zen 4: 38.2 GB/s copy one day, 33.4 copy / 34.3 read another).

    python benchmarks/linear_stream.py [--rows 1,2,4,8,16,24,32,64] [--threads 2] [--kernels fp8,bf16,head,fp8+head8]
    python benchmarks/linear_stream.py --kernels fp8-bi,bf16-bi,head-bi     # on AMX: batch invariant vs plain
"""

import argparse
import time

import torch
import torch.nn.functional as F

from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops
from fp8engine.weights import layout, quant

LAYERS = 30
PROJ = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
ROWS = (1, 2, 4, 8, 16, 24, 32, 64)
PATHS = ("auto", "avx512-gemv", "avx512-nt", "avx512-gemm")


def _best(fns: dict, rounds: int) -> dict:
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def stream_bandwidth(mb: int = 256) -> float:
    """Bytes/s of a copy (read + write) of an mb-MB tensor, best of 5."""
    src = torch.empty(mb << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / _best({"copy": lambda: dst.copy_(src)}, 5)["copy"]


def read_bandwidth(mb: int = 256) -> float:
    """Bytes/s of a read of an mb-MB tensor (a float32 sum: nothing written), best of 5."""
    src = torch.ones(mb << 18, dtype=torch.float32)
    return src.numel() * 4 / _best({"read": src.sum}, 5)["read"]


def run(rows=ROWS, kernels=("fp8", "bf16", "head"), rounds: int = 5) -> dict:
    ops = load_cpu_ops()
    torch.manual_seed(0)
    bf16 = [{name: torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for name, (n, k) in PROJ.items()}
            for _ in range(LAYERS)]
    fp8 = [{name: quant.quantize_weight_blockwise(w) for name, w in layer.items()} for layer in bf16]
    head = torch.randn(*HEAD, dtype=torch.bfloat16) * 0.05
    head8 = quant.quantize_weight_blockwise(head)
    bytes_ = {"fp8": sum(q.numel() for layer in fp8 for q, _ in layer.values()),
              "bf16": 2 * sum(w.numel() for layer in bf16 for w in layer.values()), "head": 2 * head.numel()}
    bytes_["fp8+head8"] = bytes_["fp8"] + head8[0].numel()
    bytes_.update({"fp8-bi": bytes_["fp8"], "bf16-bi": bytes_["bf16"], "head-bi": bytes_["head"]})
    bi = any(kind.endswith("-bi") for kind in kernels)
    fp8_nt16 = [{name: (layout.to_nt16_(q.clone()), s) for name, (q, s) in layer.items()} for layer in fp8] if bi else []
    bf16_nt16 = [{name: layout.to_nt16_(w.clone()) for name, w in layer.items()} for layer in bf16] if bi else []
    head_nt16 = layout.to_nt16_(head.clone()) if bi else None
    bandwidth, read = stream_bandwidth(), read_bandwidth()
    results = []
    for m in rows:
        xs = {name: torch.randn(m, PROJ[name][1], dtype=torch.bfloat16) for name in PROJ}
        xh = torch.randn(m, HEAD[1], dtype=torch.bfloat16)

        def fp8_forward(path):
            return lambda: [ops.fp8_block_linear(xs[name], q, s, None, False, None, False, path)
                            for layer in fp8 for name, (q, s) in layer.items()]

        def bf16_forward(path):
            if path == "torch":
                return lambda: [F.linear(xs[name], w) for layer in bf16 for name, w in layer.items()]
            return lambda: [ops.bf16_linear(xs[name], w, None, False, False, path)
                            for layer in bf16 for name, w in layer.items()]

        def head_forward(path):
            if path == "torch":
                return lambda: F.linear(xh, head)
            return lambda: ops.bf16_linear(xh, head, None, False, False, path)

        def fp8_head8_forward(path):  # the layers, then the head in FP8 (EngineConfig.lm_head_fp8): what it reads
            layers = fp8_forward(path)
            return lambda: (layers(), ops.fp8_block_linear(xh, *head8, None, False, None, False, path))

        def bi_forward(kind):  # rows, plain (what a plain engine runs), and nt16, batch invariant
            if kind == "fp8-bi":
                return {"rows": fp8_forward("auto"), "nt16-bi": lambda: [
                    ops.fp8_block_linear(xs[name], q, s, None, False, None, True, "auto", True)
                    for layer in fp8_nt16 for name, (q, s) in layer.items()]}
            if kind == "bf16-bi":
                return {"rows": bf16_forward("auto"), "nt16-bi": lambda: [
                    ops.bf16_linear(xs[name], w, None, True, False, "auto", True)
                    for layer in bf16_nt16 for name, w in layer.items()]}
            return {"rows": head_forward("auto"),
                    "nt16-bi": lambda: ops.bf16_linear(xh, head_nt16, None, True, False, "auto", True)}

        fns = {}
        for kind, make in (("fp8", fp8_forward), ("bf16", bf16_forward), ("head", head_forward),
                           ("fp8+head8", fp8_head8_forward)):
            if kind in kernels:
                for path in PATHS + (("torch",) if kind in ("bf16", "head") else ()):
                    fns[(kind, path)] = make(path)
        for kind in ("fp8-bi", "bf16-bi", "head-bi"):
            if kind in kernels:
                fns.update({(kind, path): fn for path, fn in bi_forward(kind).items()})
        for (kind, path), seconds in _best(fns, rounds).items():
            results.append({"kind": kind, "path": path, "M": m, "ms": seconds * 1e3,
                            "floor_ms": bytes_[kind] / bandwidth * 1e3, "read_floor_ms": bytes_[kind] / read * 1e3})
    return {"threads": torch.get_num_threads(), "stream_GBps": bandwidth / 1e9, "read_GBps": read / 1e9,
            "bytes": bytes_, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernels", default="fp8,bf16,head")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(tuple(int(m) for m in args.rows.split(",")), tuple(args.kernels.split(",")), args.rounds)
    print(f"threads {report['threads']}, stream bandwidth {report['stream_GBps']:.1f} GB/s (copy), "
          f"{report['read_GBps']:.1f} GB/s (read), "
          f"bytes per forward: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in report["bytes"].items()))
    kinds = dict.fromkeys(r["kind"] for r in report["results"])
    for kind in kinds:
        rs = [r for r in report["results"] if r["kind"] == kind]
        paths = list(dict.fromkeys(r["path"] for r in rs))
        print(f"\n{kind}: ms per forward (DRAM floor {rs[0]['floor_ms']:.2f} ms copy, "
              f"{rs[0]['read_floor_ms']:.2f} ms read)")
        print(f"{'M':>4} " + " ".join(f"{p:>12}" for p in paths))
        for m in dict.fromkeys(r["M"] for r in rs):
            row = {r["path"]: r["ms"] for r in rs if r["M"] == m}
            print(f"{m:>4} " + " ".join(f"{row[p]:>12.2f}" for p in paths))


if __name__ == "__main__":
    main()
