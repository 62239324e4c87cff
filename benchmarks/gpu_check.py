"""GPU check: first the whole engine on the device (benchmarks/gpu_engine.py: checks against the CPU engine,
weight updates in place, batch invariance, then decode speed of an 8B-shaped model beside the HBM floor), then
the Triton kernels: the launches tests/test_triton_compile.py compiles without a GPU, run natively on CUDA
against their torch references, timed. `--dry-run` runs the engine part on the CPU (the CUDA path under
tests/fake_cuda.py, Triton on the interpreter, tiny shapes), as tests/test_gpu_check.py does in CI.

The cases come from tests/triton_launch.py (the default model in bf16 with both scale
formats, a 7B-class Llama in bf16, the default model's attention in float32): the engine's own wrappers on the
engine's tensor layouts, with DeepGEMM and FlashInfer kept out so the Triton kernels are what runs. Checked:

  * activation / weight quantisation and the KV-cache write: bit for bit (fp8 codes and scales);
  * the FP8 linear layers: max |out - ref| / max |ref| against quant.fp8_block_linear_ref (float32 sums);
  * attention against attention_ref.paged_attention_ref: as the interpreter tests (rtol 2^-7 for bf16);
    full FP8 allows rare E4M3 rounding-tie flips of P.

Prints one line per case (error, time per call including the Python wrapper) and the registers, spills
and shared memory the driver reports for every compiled kernel, writes all figures as JSON, and exits 1
when a case is off. Without CUDA it says so and exits 0.

    python -m benchmarks.gpu_check [--json bench_results/gpu_check.json] [--sets llama-7b] [--no-engine]
                                   [--engine-only cuda_graph,speed_fp8]       (a rerun of some engine checks)
    python -m benchmarks.gpu_check --dry-run                                                   (from the checkout)
"""

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from tests import triton_launch

BF16_RTOL = 2 ** -7
LINEAR_TOL = 2 ** -6  # max error / max |ref|: two bf16 roundings of the largest output (fp8 products are exact)
FUSED_CODE_TOL = 2 ** -3  # an E4M3 code a step away (<= 1/8 of its value) after a bf16 rounding moved


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    nan = want.float().isnan()
    return int((_bits(got) != _bits(want))[~nan].sum()) + int((got.float().isnan() != nan).sum())


def _compare_quant(pairs_got, pairs_want) -> dict:
    codes = sum(_mismatches(q, rq) for (q, _), (rq, _) in zip(pairs_got, pairs_want))
    scales = sum(_mismatches(s, rs) for (_, s), (_, rs) in zip(pairs_got, pairs_want))
    return {"code_mismatches": codes, "scale_mismatches": scales, "ok": codes == 0 and scales == 0}


def _compare(case: triton_launch.Case, inputs: dict, out, ref) -> dict:
    if case.kind == "act_quant":
        return _compare_quant([out], [ref])
    if case.kind == "weight_quant":
        return _compare_quant(out, ref)
    if case.kind == "write_kv":
        bad = sum(_mismatches(got, want) for got, want in zip(out, ref))
        return {"mismatches": bad, "ok": bad == 0}
    if case.kind == "fused":  # a tuple of outputs: each model-dtype one as a linear output, E4M3 ones dequantized
        return _compare_fused(out, ref)
    if case.kind == "rms_norm":  # (normed, residual sum): the sum bit for bit, the norm as a linear output
        bad = _mismatches(out[1], ref[1])
        result = _compare(dataclasses.replace(case, kind="dense"), inputs, out[0], ref[0])
        return {**result, "sum_mismatches": bad, "ok": result["ok"] and bad == 0}
    out, ref = out.float(), ref.float()
    err = (out - ref).abs()
    scale = ref.abs().max().clamp_min(1e-30)
    result = {"max_abs_err": float(err.max()), "max_rel_err": float(err.max() / scale)}
    if case.kind in ("linear", "dense", "lora", "gdn", "moe"):
        result["ok"] = result["max_rel_err"] <= LINEAR_TOL
        return result
    rtol = BF16_RTOL if inputs["q"].dtype == torch.bfloat16 else 1e-5
    close = torch.isclose(out, ref, rtol=rtol, atol=1e-5)
    result["frac_close"] = float(close.float().mean())
    if inputs["fp8_q_scale"] is None:
        result["ok"] = bool(close.all())
    else:  # a P * 448 next to an E4M3 rounding tie may round the other way (see test_triton_attention)
        max_v = float(inputs["v_cache"].float().abs().max()) * inputs["v_scale"]
        result["ok"] = result["frac_close"] >= 0.999 and result["max_abs_err"] <= 32 / 448 * max_v
    return result


def _compare_fused(out: tuple, ref: tuple) -> dict:
    """The fused kernels (kernels/fused_triton.py) against fused_ref: bit for bit under the interpreter; on the device
    exp, sqrt and FMA contraction may move a bf16 rounding, so a value within LINEAR_TOL of the largest, and an
    E4M3 code (compared as code x its group's scale) may round the other way: within FUSED_CODE_TOL, and at most 1%
    of the codes differ. A KV cache's codes: the same rule."""
    worst, codes, total = 0.0, 0, 0
    for i, (got, want) in enumerate(zip(out, ref)):
        if got is None or want is None or got.dtype == torch.float32:
            continue  # scales are compared through their codes
        if got.dtype == torch.float8_e4m3fn:
            scale = next((o for o in out[i + 1:i + 2] if o is not None and o.dtype == torch.float32), None)
            codes += _mismatches(got, want)
            total += got.numel()
            got, want = got.float(), want.float()
            if scale is not None:
                groups = scale.repeat_interleave(128, dim=-1)[..., :got.shape[-1]]
                ref_groups = ref[i + 1].repeat_interleave(128, dim=-1)[..., :got.shape[-1]]
                got, want = got * groups, want * ref_groups
            tol = FUSED_CODE_TOL
        else:
            tol = LINEAR_TOL
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
        worst = max(worst, err / tol)
    frac = codes / total if total else 0.0
    return {"worst_err_over_tol": worst, "code_mismatch_frac": frac, "ok": worst <= 1.0 and frac <= 0.01}


def _moved(x, device: torch.device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_moved(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _moved(v, device) for k, v in x.items()}
    return x


def _reference(case: triton_launch.Case, inputs: dict, device: torch.device):
    """The torch reference on a CPU copy of the inputs, moved back: CPU arithmetic is the contract (on CUDA torch
    computes "tensor / number" as "tensor * (1 / number)", an ulp off the IEEE quotient for some values)."""
    if case.kind not in ("weight_quant", "act_quant", "write_kv", "attention", "gdn", "fused"):  # refs on device
        return case.ref(inputs)
    return _moved(case.ref(_moved(inputs, torch.device("cpu"))), device)


def _time_us(fn, iters: int, device: torch.device) -> float:
    fn()
    if device.type != "cuda":  # the interpreter (--device cpu): wall time, once
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e6
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _compiled_kernels(mods) -> list[dict]:
    """What the driver reports for every kernel the run compiled (Triton's in-memory JIT cache)."""
    rows = []
    for name, kernel in sorted(triton_launch.kernel_names(mods).items()):
        for device_cache in getattr(kernel, "device_caches", {}).values():
            for compiled in device_cache[0].values():
                if not hasattr(compiled, "metadata"):
                    continue
                compiled._init_handles()
                meta = compiled.metadata
                rows.append({"kernel": name, "regs": compiled.n_regs, "spills": compiled.n_spills,
                             "shared": meta.shared, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
                             "arch": str(getattr(meta.target, "arch", meta.target))})
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(sets: list[str], iters: int, device: torch.device, only: str = "") -> dict:
    torch.manual_seed(0)
    mods = triton_launch.canonical_kernels()
    all_sets = triton_launch.case_sets()
    results = []
    with triton_launch.triton_only(mods), torch.inference_mode():
        for label in sets:
            for case in all_sets[label]:
                if only not in case.name:
                    continue
                row = {"case": case.name, "kind": case.kind}
                inputs = out = None
                try:
                    inputs = case.make(device)
                    started = time.perf_counter()
                    out = case.run(mods, inputs)  # compiles on first use
                    _sync(device)
                    row["first_call_s"] = round(time.perf_counter() - started, 3)
                    row.update(_compare(case, inputs, out, _reference(case, inputs, device)))
                    row["time_us"] = round(_time_us(functools.partial(case.run, mods, inputs), iters, device), 2)
                except Exception as exc:  # one broken case must not hide the others on a short device run
                    traceback.print_exc()
                    row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
                results.append(row)
                metrics = {k: v for k, v in row.items() if k not in ("case", "kind", "ok", "first_call_s")}
                print(f"{'ok ' if row['ok'] else 'BAD'} {case.name:48s} "
                      + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()),
                      flush=True)
                del inputs, out
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    try:
        compiled = _compiled_kernels(mods) if device.type == "cuda" else []
    except Exception:  # the driver's figures are a report, not a check: Triton's cache layout moves between releases
        traceback.print_exc()
        compiled = []
    print("\ncompiled kernels (driver):")
    for row in compiled:
        print(f"  sm_{row['arch']} {row['kernel']:28s} regs {row['regs']:3d}  spills {row['spills']:3d}  "
              f"shared {row['shared']:6d}  warps {row['num_warps']}  stages {row['num_stages']}")
    import triton
    cuda = device.type == "cuda"
    return {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
            "capability": list(torch.cuda.get_device_capability()) if cuda else [],
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "iters": iters, "cases": results, "compiled": compiled,
            "failures": [r["case"] for r in results if not r["ok"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="bench_results/gpu_check.json", help="where to write the figures")
    parser.add_argument("--sets", default=",".join(triton_launch.case_sets()),
                        help="comma-separated case sets (default: all)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per case")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: this script's own check, on the Triton interpreter (TRITON_INTERPRET=1; slow)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the engine part only, on the CPU (fake device, Triton interpreter, tiny shapes)")
    parser.add_argument("--no-engine", action="store_true", help="the kernel cases only")
    parser.add_argument("--engine-only", default="", help="comma-separated: the engine checks and speed rows whose "
                        "names hold one of these (a rerun of what failed); default: all")
    args = parser.parse_args(argv)
    if args.dry_run:
        return _dry_run(Path(args.json))
    if args.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu runs the kernels on the Triton interpreter: set TRITON_INTERPRET=1")
    elif not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False), so nothing ran. "
              "What needs no GPU (native compile for sm_90 / sm_89, instruction classes, registers, shared "
              "memory, spills) is checked by: pytest tests/test_triton_compile.py")
        return 0
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu-check: TRITON_INTERPRET is set; unset it to run the kernels natively", file=sys.stderr)
        return 2
    sets = [s for s in args.sets.split(",") if s]
    unknown = set(sets) - set(triton_launch.case_sets())
    if unknown:
        parser.error(f"unknown case sets {sorted(unknown)}; known: {sorted(triton_launch.case_sets())}")
    engine = None
    if not args.no_engine and args.device == "cuda":
        from benchmarks import gpu_engine
        engine = gpu_engine.run(dry=False, only=[s for s in args.engine_only.split(",") if s])
    report = run(sets, args.iters, torch.device(args.device), args.only)
    if engine is not None:
        report["engine"] = engine
        report["failures"] += [f"engine/{name}" for name in engine["failures"]]
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    bad = report["failures"]
    arch = f" (sm_{''.join(map(str, report['capability']))})" if report["capability"] else ""
    print(f"\ngpu-check: {len(report['cases']) - len(bad)}/{len(report['cases'])} cases ok on "
          f"{report['device']}{arch}; figures in {path}")
    for name in bad:
        print(f"  off: {name}")
    return 1 if bad else 0


def _dry_run(path: Path) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu-check --dry-run runs the Triton kernels on the interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    from benchmarks import gpu_engine
    report = {"engine": gpu_engine.run(dry=True), "dry_run": True}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    bad = report["engine"]["failures"]
    print(f"\ngpu-check --dry-run: {len(report['engine']['engine_checks']) - len(bad)}/"
          f"{len(report['engine']['engine_checks'])} engine checks ok on the CPU; figures in {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
