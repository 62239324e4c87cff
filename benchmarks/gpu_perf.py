"""The prepared device run of issue 64 (the GPU floor): at most ~6 minutes on an H100 / H200 with no network, one
JSON per section written to --out as each section finishes (a run cut short still returns what it did), a section
that no longer fits --budget-s skipped (its file says so). In this order:

  1. checks     the engine checks of `make gpu-check` that bear on speed work (logprobs against the CPU engine,
                batch invariance, CUDA graphs against eager steps bitwise), the fused layers against the unfused ones
                (FP8ENGINE_CUDA_FUSION=0: teacher-forced logprobs within a few bf16 roundings) and the fused kernel
                cases (kernels/fused_triton.py) against their references natively, and the FP8 engine's tokens and
                logprobs with programmatic dependent launch on and off, and with async scheduling on and off,
                bitwise;
  2. bandwidth  HBM ceilings measured here: a read (sum of a 2 GiB tensor) and a copy, GB/s;
  3. engine     an 8B-shaped Llama (random weights drawn on the device) at batch 1 / 64 / 256, BF16 and FP8, ms a
                decode step from CUDA graphs beside the floor (the step's bytes / the measured read ceiling), and at
                batch 1 fused against unfused (the A/B of each fusion's launches), with programmatic dependent
                launch (FP8ENGINE_PDL=1) against without at batch 1, and FP8 with the GEMM's swapped operands
                (FP8ENGINE_SWAP_AB_GEMM=1) against without at batch 1;
  4. gemm       the FP8 GEMM (default and batch-invariant launch) and torch's BF16 matmul at M = 1 / 4 / 16 / 64 /
                256 on the 8B's layers, each call replayed from a CUDA graph over weight copies that do not fit the
                L2 cache together, GB/s; at 256 rows also with TMA tiles (FP8ENGINE_TMA_GEMM's kernel), and
                TMA against pointer loads bitwise where every tile is partial; at up to 16 rows also with swapped
                operands (FP8ENGINE_SWAP_AB_GEMM's E4M3 wgmma, partials kept where the engine keeps them) and
                their result against the default launch's;
  5. attention  decode attention at 128 / 2K / 8K tokens of context, BF16 and FP8 caches, batch 1 and 64, beside
                the KV-read floor; the batch-invariant launch (runs folded, split where SMs would idle) beside;
  6. profile    the kernels of an eager FP8 decode step by device time (benchmarks/gpu_profile.py);
  7. peers      vLLM's Triton block-FP8 GEMM when its file is carried (benchmarks/peers/vllm_w8a8_block_fp8.py, not
                committed: `fetch` it before the run) and FlashInfer's fp8_blockscale_gemm_sm90 when it imports and
                loads within 30 s; otherwise the row says why not;
  8. async      the 8B-shaped FP8 engine with async scheduling (EngineConfig.async_scheduling) against steps that
                wait, at batch 1 and 64, each timed as one loop of steps: where the budget leaves time, or alone;
  9. hybrid     the hybrid engine on CUDA (issue 63): a small Qwen3.5 through the engine's float32 logprobs check
                (against the CPU engine) and its graph check (graphs against eager steps, bitwise); Qwen3.5-2B's
                shape at batch 1 and 64, BF16 and FP8, from CUDA graphs, and FP8 at batch 1 eager: last, so it runs
                only where the budget is left (`--budget-s 570` runs every section, or `--sections async,hybrid`).

    python -m benchmarks.gpu_perf [--out bench_results/gpu_perf] [--budget-s 360] [--sections engine,gemm]
    TRITON_INTERPRET=1 python -m benchmarks.gpu_perf --dry-run        (CPU: tiny shapes, the stand-in device; CI)
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import gpu_engine
from fp8engine import EngineConfig, LLMEngine, SamplingParams

GEMM_ROWS = (1, 4, 16, 64, 256)
CONTEXTS = (128, 2048, 8192)
L2_BYTES = 60 << 20  # H100 50 MB, H200 60 MB: weight copies rotated past it
PEER_FILE = Path(__file__).parent / "peers" / "vllm_w8a8_block_fp8.py"


class Run:
    """Shared state of a run: where the device is (dry: the CPU under tests/fake_cuda.py), the models, the read
    ceiling the floors use."""

    def __init__(self, dry: bool, root: Path):
        self.dry, self.root = dry, root
        self.small_shape = gpu_engine.TINY if dry else gpu_engine.DEFAULT_SHAPE
        self.small = gpu_engine.model_dir(root / "small", self.small_shape, weights=True)
        self.big = gpu_engine.model_dir(root / "8b", gpu_engine.TINY if dry else gpu_engine.EIGHT_B, weights=False)
        self.read_gb_s = gpu_engine.HBM_BYTES_PER_S / 1e9  # until the bandwidth section measures it

    def device(self):
        """The stand-in device around a section's work in a dry run; nothing on CUDA."""
        if not self.dry:
            return contextlib.nullcontext()
        from tests.fake_cuda import FakeCuda
        return FakeCuda()

    def time_us(self, fn, graph: bool = True) -> float:
        """Median µs of fn() on the device, replayed from a CUDA graph when `graph`; dry: one call's wall time."""
        if self.dry:
            started = time.perf_counter()
            fn()
            return (time.perf_counter() - started) * 1e6
        import triton.testing
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3
        return triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3


@contextlib.contextmanager
def _env(name: str, on: bool):
    """An engine switch (FP8ENGINE_CUDA_FUSION, FP8ENGINE_PDL) set to 1 or 0 for the engines built inside."""
    saved = os.environ.get(name)
    os.environ[name] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _fusion(on: bool):
    return _env("FP8ENGINE_CUDA_FUSION", on)


def _swap(on: bool):
    """The FP8 GEMM's swapped operands at up to 16 rows (FP8ENGINE_SWAP_AB_GEMM): sm_90 and later, never dry."""
    return _env("FP8ENGINE_SWAP_AB_GEMM", on)


def _pdl(on: bool):
    """Programmatic dependent launch (kernels/pdl.py): never on in a dry run (the interpreter has none)."""
    return _env("FP8ENGINE_PDL", on)


# ------------------------------------------------------------------------------------------------ sections
def checks(run: Run) -> dict:
    only = ["logprobs_vs_cpu", "batch_invariance", "cuda_graph_replay"]
    engine = gpu_engine.run(dry=run.dry, workdir=str(run.root / "checks"), only=only)  # dry: its own stand-in
    with run.device():
        rows = engine["engine_checks"] + [_fused_vs_unfused(run)]
    if not run.dry:  # PDL: never on under the interpreter; async scheduling: tests/test_cuda_graphs.py
        rows += [_pdl_vs_off(run), _async_vs_off(run)]
    if not run.dry:
        from benchmarks import gpu_check
        kernels = gpu_check.run(["llama-7b"], 10, torch.device("cuda"), only="/fused/")
        rows += [dict(r, check=f"kernel {r['case']}") for r in kernels["cases"]]
    return {"checks": rows, "failures": [r["check"] for r in rows if not r.get("ok", True)]}


def _fused_vs_unfused(run: Run) -> dict:
    """Teacher-forced logprobs of the fused FP8 engine's greedy tokens, fused against unfused."""
    prompts = gpu_engine._prompts(4, 24, run.small_shape["vocab_size"], 5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, logprobs_mode="raw")
    scored = []
    responses = None
    for on in (True, False):
        with _fusion(on):
            engine = LLMEngine(EngineConfig(model=run.small, device="cuda", quantization="fp8", num_kv_blocks=256))
            if responses is None:
                responses = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
            scored.append(engine.score(prompts, responses, params))
            del engine
    diff = max(abs(a - b) for x, y in zip(*scored) for a, b in zip(x, y))
    return gpu_engine._check("fused_vs_unfused_fp8", diff <= 0.05, max_abs_logprob_diff=float(f"{diff:.3g}"))


def _pdl_vs_off(run: Run) -> dict:
    """The FP8 engine's sampled tokens and logprobs (CUDA graphs, a batch of 8 then one sequence) with programmatic
    dependent launch on and off: bit for bit, or a kernel reads before its wait."""
    prompts = gpu_engine._prompts(8, 24, run.small_shape["vocab_size"], 6)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3, logprobs=0)
    outs, names = [], []
    for on in (False, True):
        with _pdl(on):
            engine = LLMEngine(EngineConfig(model=run.small, device="cuda", quantization="fp8",
                                            kv_cache_dtype="fp8_e4m3", num_kv_blocks=256))
            names.append(engine.get_stats().kernels.get("pdl", "off"))
            got = engine.generate(prompts, params) + engine.generate(prompts[:1], params)
            outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got])
            del engine
    return gpu_engine._check("pdl_vs_off_bitwise", outs[0] == outs[1] and names == ["off", "on"], pdl=names[1])


def _async_vs_off(run: Run) -> dict:
    """The FP8 engine's sampled tokens and logprobs with async scheduling on and off (decode graphs; sequences that
    end by length, so no step runs a row that stopped): bit for bit, and steps did run ahead."""
    prompts = gpu_engine._prompts(8, 24, run.small_shape["vocab_size"], 7)
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 1.0, max_tokens=12 + i, ignore_eos=True, seed=5,
                             logprobs=0) for i in range(len(prompts))]
    outs, ahead = [], 0
    for on in (False, True):
        engine = LLMEngine(EngineConfig(model=run.small, device="cuda", quantization="fp8", num_kv_blocks=256,
                                        async_scheduling=on))
        outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.generate(prompts, params)])
        ahead = engine.num_steps_ahead
        del engine
    return gpu_engine._check("async_vs_off_bitwise", outs[0] == outs[1] and ahead > 0, steps_ahead=ahead)


def bandwidth(run: Run) -> dict:
    numel = (1 << 20) if run.dry else (1 << 30)  # bf16: 2 MiB dry, 2 GiB on the device
    src = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    nbytes = numel * 2
    read_us = run.time_us(lambda: src.sum(dtype=torch.float32), graph=False)
    copy_us = run.time_us(lambda: dst.copy_(src), graph=False)
    run.read_gb_s = nbytes / read_us / 1e3
    return {"bytes": nbytes, "read_gb_s": round(run.read_gb_s, 1), "copy_gb_s": round(2 * nbytes / copy_us / 1e3, 1)}


def engine(run: Run) -> dict:
    steps, prompt_len = (2, 16) if run.dry else (16, 128)
    sizes = (1, 4) if run.dry else (1, 64, 256)
    rows = []
    # (fused, PDL, quantizations, batches, swap): the fused engine, unfused at batch 1, PDL at batch 1, FP8 with the
    # GEMM's swapped operands at batch 1 (the last two not in a dry run)
    runs = [(True, False, (None, "fp8"), sizes, False), (False, False, (None, "fp8"), sizes[:1], False)]
    if not run.dry:
        runs += [(True, True, (None, "fp8"), sizes[:1], False), (True, False, ("fp8",), sizes[:1], True)]

    def add(row: dict, fused: bool) -> None:
        floor_ms = row["hbm_floor_ms"] * gpu_engine.HBM_BYTES_PER_S / 1e9 / run.read_gb_s
        rows.append(dict(row, fused=fused, floor_ms_measured=float(f"{floor_ms:.3g}"),
                         x_floor=float(f"{row['ms_per_step'] / floor_ms:.3g}")))
    for fused, pdl, quantizations, batches, swap in runs:
        for quantization in quantizations:
            for batch in batches:
                with _fusion(fused), _pdl(pdl), _swap(swap):
                    add(gpu_engine.decode_speed(run.big, "cuda", batch, quantization, steps, prompt_len), fused)
    swapped = {r["batch"]: r["ms_per_step"] for r in rows if r["swap_ab"] == "on"}
    rows = [r for r in rows if r["swap_ab"] != "on"]
    by = {(r["mode"], r["batch"], r["fused"], r["pdl"]): r["ms_per_step"] for r in rows}
    swap_gain = {f"fp8_batch{b}": float(f"{by[('fp8', b, True, 'off')] / ms:.3g}") for b, ms in swapped.items()}
    ratios = {f"fp8_over_bf16_batch{b}": float(f"{by[('bf16', b, True, 'off')] / by[('fp8', b, True, 'off')]:.3g}")
              for b in sizes}
    pdl_gain = {f"{mode}_batch{b}": float(f"{by[(mode, b, True, 'off')] / by[(mode, b, True, 'on')]:.3g}")
                for mode, b, fused, pdl in by if fused and pdl == "on" and mode in ("bf16", "fp8")}
    return {"rows": rows, "fp8_speedup": ratios, "pdl_speedup": pdl_gain, "swap_ab_ms": swapped,
            "swap_ab_speedup": swap_gain}


def async_ab(run: Run) -> dict:
    """The 8B-shaped FP8 engine with async scheduling against steps that wait, at batch 1 and 64, each timed as one
    loop of steps (a wait after each step would undo the overlap)."""
    steps, prompt_len = (2, 16) if run.dry else (16, 128)
    rows = [gpu_engine.decode_speed(run.big, "cuda", batch, "fp8", steps, prompt_len, async_scheduling=on)
            for batch in ((1,) if run.dry else (1, 64)) for on in (False, True)]
    by = {(r["mode"], r["batch"]): r["ms_per_step"] for r in rows}
    return {"rows": rows, "async_speedup": {f"fp8_batch{b}": float(f"{by['fp8-sync', b] / by['fp8-async', b]:.3g}")
                                            for _, b in by}}


def gemm(run: Run) -> dict:
    from fp8engine.model_executor.kernels import fp8_triton as ft, pdl
    layers = {"tiny": (256, 128)} if run.dry else {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
                                                    "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
    rows = []
    for (layer, (n, k)), m in ((lk, m) for lk in layers.items() for m in ((1, 4, 80) if run.dry else GEMM_ROWS)):
        copies = 2 if run.dry else max(2, -(-2 * L2_BYTES // (n * k)))  # FP8 weights: n * k bytes a copy
        weights = [ft.quantize_weight_blockwise_triton(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        x_q, x_s = ft.per_token_group_quant_fp8(x)

        def per_call_us(call, items) -> float:  # one timed replay calls each copy in turn
            return run.time_us(lambda: [call(item) for item in items]) / len(items)

        def fp8(w):
            return ft.w8a8_block_fp8_matmul(x_q, x_s, *w, torch.bfloat16)
        fp8_us = per_call_us(fp8, weights)
        bi_us = per_call_us(lambda w: ft.w8a8_block_fp8_matmul(x_q, x_s, *w, torch.bfloat16, batch_invariant=True),
                            weights)
        bf16_us = per_call_us(lambda w: x @ w.T, bf16)
        # FP8ENGINE_TMA_GEMM's tiles (more than 64 rows, sm_90 and later) against the pointer loads above: time, bits
        tma_us = tma_bitwise = None
        if m > 64 and (run.dry or torch.cuda.get_device_capability()[0] >= 9):
            tma_bitwise = _tma_same_bits(x_q, x_s, *weights[0])
            with pdl.TMA_GEMM.forced(True):
                tma_us = round(per_call_us(fp8, weights), 2)
        # FP8ENGINE_SWAP_AB_GEMM's launch (up to 16 rows, sm_90 and later) and the default one, their partials kept
        # where the engine's fused norm adds them (o_proj, down_proj): times, and the swap's result against the default
        swap_us = swap_close = partials_us = None
        if m <= 16 and (run.dry or torch.cuda.get_device_capability()[0] >= 9):
            keep = layer in ("o_proj", "down_proj")

            def as_the_engine(w):  # its partials kept where the engine keeps them
                return ft.w8a8_block_fp8_matmul(x_q, x_s, *w, torch.bfloat16, partials=keep)
            partials_us = round(per_call_us(as_the_engine, weights), 2)
            with pdl.SWAP_AB_GEMM.forced(True):
                swap_us = round(per_call_us(as_the_engine, weights), 2)
                swapped = ft.w8a8_block_fp8_matmul(x_q, x_s, *weights[0], torch.bfloat16).float()
            swap_close = bool(torch.allclose(swapped, fp8(weights[0]).float(), rtol=2**-6, atol=1e-3))
        moved = n * k + m * k + 2 * m * n
        rows.append({"layer": layer, "m": m, "n": n, "k": k, "fp8_us": round(fp8_us, 2), "fp8_bi_us": round(bi_us, 2),
                     "fp8_tma_us": tma_us, "tma_bitwise": tma_bitwise, "fp8_partials_us": partials_us,
                     "fp8_swap_us": swap_us,
                     "swap_close": swap_close, "bf16_matmul_us": round(bf16_us, 2),
                     "fp8_gb_s": round(moved / fp8_us / 1e3, 1), "config": list(ft.gemm_config(m, n, k, False))})
        del weights, bf16
    return {"rows": rows, "tma_edges_bitwise": _tma_edges_bitwise(run)}


def _tma_edges_bitwise(run: Run) -> bool | None:
    """The TMA tiles against the pointer loads where every tile is partial (70 x 200 x 848, bias): bit for bit; None
    below sm_90."""
    from fp8engine.model_executor.kernels import fp8_triton as ft
    if not run.dry and torch.cuda.get_device_capability()[0] < 9:
        return None
    torch.manual_seed(0)
    w_q, w_s = ft.quantize_weight_blockwise_triton(torch.randn(200, 848, device="cuda") * 0.02)
    x_q, x_s = ft.per_token_group_quant_fp8(torch.randn(70, 848, device="cuda", dtype=torch.bfloat16))
    return _tma_same_bits(x_q, x_s, w_q, w_s, torch.randn(200, device="cuda", dtype=torch.bfloat16))


def _tma_same_bits(x_q, x_s, w_q, w_s, bias=None) -> bool:
    """Whether the GEMM gives the same bits with TMA tiles as with pointer loads."""
    from fp8engine.model_executor.kernels import fp8_triton as ft, pdl
    pointer = ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16, bias)
    with pdl.TMA_GEMM.forced(True):
        return torch.equal(ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16, bias), pointer)


def attention(run: Run) -> dict:
    from fp8engine.model_executor.kernels import attention_triton as at
    heads, kv_heads, dim, block = (4, 2, 32, 16) if run.dry else (32, 8, 128, 16)
    rows = []
    for context in ((32, 64) if run.dry else CONTEXTS):
        for batch in ((1, 2) if run.dry else (1, 64)):
            for cache in (torch.bfloat16, torch.float8_e4m3fn):
                pages = -(-context // block)
                k_cache = torch.randn(batch * pages, block, kv_heads, dim, device="cuda").to(cache)
                v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(cache)
                tables = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
                q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
                starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                us, bi_us = (run.time_us(lambda: at.paged_attention_triton(
                    q, k_cache, v_cache, tables, starts, lens, dim ** -0.5, 1.0, 1.0, batch_invariant=bi))
                    for bi in (False, True))
                kv_bytes = 2 * batch * context * kv_heads * dim * k_cache.element_size()
                floor_us = kv_bytes / run.read_gb_s / 1e3
                rows.append({"context": context, "batch": batch, "cache": str(cache).removeprefix("torch."),
                             "us": round(us, 2), "kv_floor_us": round(floor_us, 2),
                             "x_floor": float(f"{us / floor_us:.3g}"), "batch_invariant_us": round(bi_us, 2),
                             "bi_x_floor": float(f"{bi_us / floor_us:.3g}")})
    return {"rows": rows}


def hybrid(run: Run) -> dict:
    """The hybrid engine on CUDA: a small seeded Qwen3.5 through the engine checks of a Llama's (float32 logprobs
    against the CPU engine, decode steps from CUDA graphs against eager ones bit for bit; not in a dry run: minutes
    on the interpreter), then Qwen3.5-2B's shape (fp8engine/bench/model_shapes.py's qwen3.5-2b-shape; weights drawn
    on the device): decode ms a step at batch 1 and 64, BF16 and FP8, from CUDA graphs, and FP8 at batch 1 eager
    (what the graphs save)."""
    from fp8engine.bench import model_shapes
    checks = []
    if not run.dry:
        small, vocab = gpu_engine.hybrid_dir(run.root / "hybrid"), gpu_engine.HYBRID["vocab_size"]
        checks += [gpu_engine._guarded("logprobs_vs_cpu", gpu_engine.check_logprobs_vs_cpu, small, "cuda",
                                       contextlib.nullcontext, vocab, 512),
                   gpu_engine._guarded("cuda_graph_replay", gpu_engine.check_cuda_graphs, small, "cuda", vocab, 512,
                                       16, 8)]
        checks = [dict(row, model="small qwen3.5") for row in checks]
    _, sizes = model_shapes.SHAPES["qwen3.5-2b-shape"]
    shape = gpu_engine.HYBRID if run.dry else dict(sizes, vocab_size=151936)
    shape = {k: v for k, v in shape.items() if k != "architectures"}
    model = gpu_engine.hybrid_dir(run.root / "qwen3.5-2b", shape, weights=False)
    steps, prompt_len = (2, 16) if run.dry else (16, 128)
    runs = [(b, q, False) for q in (None, "fp8") for b in ((1,) if run.dry else (1, 64))] + [(1, "fp8", True)]
    rows = [gpu_engine.decode_speed(model, "cuda", b, q, steps, prompt_len, enforce_eager=eager) | {"eager": eager}
            for b, q, eager in runs]
    return {"checks": checks, "failures": [r["check"] for r in checks if not r.get("ok", True)],
            "shape": "qwen3.5-2b-shape", "rows": rows}


def profile(run: Run) -> dict:
    if run.dry:
        return {"skipped": "needs the CUDA profiler"}
    from benchmarks import gpu_profile
    return gpu_profile.profile(run.big, 1, "fp8", 20)


def peers(run: Run) -> dict:
    rows = {"vllm_triton_w8a8_block_fp8": f"not carried ({PEER_FILE} absent)" if not PEER_FILE.exists() else None}
    code = "import flashinfer.gemm as g; print(hasattr(g, 'fp8_blockscale_gemm_sm90'))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        rows["flashinfer_fp8_blockscale_gemm_sm90"] = (out.stdout.strip() or out.stderr.strip()[-300:]) \
            if out.returncode or out.stdout.strip() != "True" else None
    except subprocess.TimeoutExpired:
        rows["flashinfer_fp8_blockscale_gemm_sm90"] = "did not import and load within 30 s"
    # A peer that loads is timed on the gemm section's shapes; the code for that waits for the first device run that
    # has one (neither is installed on the lent machines so far).
    return {"peers": rows}


SECTIONS = {"checks": (checks, 110), "bandwidth": (bandwidth, 10), "engine": (engine, 175), "gemm": (gemm, 40),
            "attention": (attention, 20), "profile": (profile, 30), "peers": (peers, 30), "async": (async_ab, 60),
            "hybrid": (hybrid, 90)}  # estimated seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_results/gpu_perf")
    parser.add_argument("--budget-s", type=float, default=360.0)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--dry-run", action="store_true", help="the CPU, the stand-in device, tiny shapes")
    args = parser.parse_args(argv)
    names = [s for s in args.sections.split(",") if s]
    if unknown := set(names) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; known: {list(SECTIONS)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_perf: no CUDA device here, nothing ran (--dry-run runs it on the CPU)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    failed = []
    with tempfile.TemporaryDirectory() as root:
        run = Run(args.dry_run, Path(root))
        for name in names:
            fn, estimate = SECTIONS[name]
            elapsed = time.perf_counter() - started
            if elapsed + estimate > args.budget_s:
                report = {"skipped": f"budget: {elapsed:.0f} s spent, ~{estimate} s needed of {args.budget_s:.0f}"}
            else:
                section_start = time.perf_counter()
                try:
                    with run.device() if name != "checks" else contextlib.nullcontext():
                        report = fn(run)
                except Exception as exc:  # one broken section must not hide the others on a short device run
                    traceback.print_exc()
                    report = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                report["wall_s"] = round(time.perf_counter() - section_start, 1)
            if "error" in report or report.get("failures"):
                failed.append(name)
            report |= {"section": name, "dry_run": args.dry_run,
                       "device": "cpu (stand-in)" if args.dry_run else torch.cuda.get_device_name()}
            (out / f"{name}.json").write_text(json.dumps(report, indent=1))
            print(f"gpu_perf: {name} {'skipped' if 'skipped' in report else 'done'} "
                  f"({report.get('wall_s', 0)} s){' FAILED' if name in failed else ''}", flush=True)
    print(f"gpu_perf: {len(names) - len(failed)}/{len(names)} sections ok in {time.perf_counter() - started:.0f} s; "
          f"JSON in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
