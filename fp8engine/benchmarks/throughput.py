"""Throughput benchmarks behind `fp8engine bench`: engine modes side by side in one run.

Every mode runs the same prompts with the same sampling params in the same process, one after the
other, so the ratios (mode / first mode, engine / Hugging Face) are what to read: these machines are
noisy and absolute figures move between runs.
"""

import json
import platform
import time
from dataclasses import asdict, dataclass

import torch

from fp8engine.config import EngineConfig
from fp8engine.engine import LLMEngine
from fp8engine.sampling_params import SamplingParams

_BASE_MODES = {
    "bf16": dict(),
    "fp8-linear": dict(quantization="fp8"),
    "fp8-kv": dict(kv_cache_dtype="fp8_e4m3"),
    "full-fp8": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_attention=True),
}
# Each mode also batch invariant ("-bi") and with the float32 LM head ("-fp32head"), to measure what they cost.
MODES = {**_BASE_MODES, **{f"{name}-bi": dict(options, batch_invariant=True) for name, options in _BASE_MODES.items()},
         "bf16-fp32head": dict(lm_head_fp32=True), "bf16-bi-fp32head": dict(batch_invariant=True, lm_head_fp32=True)}


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    n: int
    max_tokens: int
    temperature: float = 1.0
    kv_cache_tokens: int | None = None  # KV budget in tokens of a BF16 cache (memory pressure)
    max_num_seqs: int = 256
    model: str | None = None  # the workload's own model (MODELS) when --model is the default


WORKLOADS = {
    "quick": Workload("quick", 8, 2, 32),
    "decode": Workload("decode", 1, 1, 256, temperature=0.0),
    "rl-short": Workload("rl-short", 32, 4, 128),
    # 128 sequences of ~430 tokens need ~55k KV slots: a BF16 cache of 30k tokens must preempt,
    # an FP8 cache of the same bytes (60k tokens) holds them all.
    "rl-long": Workload("rl-long", 16, 8, 384, kv_cache_tokens=30_000),
    # a small random Qwen3-MoE, 64 experts and top-8: the expert path (router, grouping, FP8 expert GEMMs)
    "moe": Workload("moe", 16, 4, 64, model="tiny-qwen3-moe"),
}


def workload_model(spec: Workload, model: str) -> str:
    """The directory a workload runs on: --model, or the workload's own model when that is the default."""
    if model != "default" or spec.model is None:
        return model
    from fp8engine.benchmarks.moe_model import tiny_moe_path
    return {"tiny-qwen3-moe": tiny_moe_path}[spec.model]()


def prompts_for(tokenizer, count: int) -> list:
    """rl_prompts as chat messages, or as their plain text for a model whose tokenizer has no chat template."""
    prompts = rl_prompts(count)
    return prompts if tokenizer.chat_template else [p[0]["content"] for p in prompts]


def rl_prompts(count: int) -> list[list[dict]]:
    """Deterministic arithmetic word problems as chat messages, the shape of an RL math batch."""
    prompts = []
    for i in range(count):
        a, b = 17 + 7 * i, 5 + 3 * i
        prompts.append([{"role": "user", "content": f"Sam has {a} apples and buys {b} more. How many "
                                                    f"apples does Sam have now? Think step by step."}])
    return prompts


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def engine_config(mode: str, workload: Workload, model: str, dtype: str, device: str) -> EngineConfig:
    options = dict(MODES[mode])
    if workload.kv_cache_tokens is not None:
        options["kv_cache_memory_bytes"] = _bf16_kv_bytes(model, workload.kv_cache_tokens)
    return EngineConfig(model=model, dtype=dtype, device=device, max_num_seqs=workload.max_num_seqs,
                        **options)


def _bf16_kv_bytes(model: str, tokens: int) -> int:
    from transformers import AutoConfig

    from fp8engine.weights.default_model import default_model_path
    cfg = AutoConfig.from_pretrained(default_model_path() if model == "default" else model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return tokens * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2


def run_engine(mode: str, workload: Workload, model: str, dtype: str, device: str, progress: bool) -> dict:
    engine = LLMEngine(engine_config(mode, workload, model, dtype, device))
    prompts = prompts_for(engine.tokenizer, workload.num_prompts)
    params = SamplingParams(n=workload.n, temperature=workload.temperature, max_tokens=workload.max_tokens,
                            ignore_eos=True, seed=0, logprobs=0)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up: kernels built, caches touched
    engine.update_weights({})  # a new weight version, as after an RL sync: KV scales recalibrate
    recal_before = engine.kv_scales.seconds_total
    preempt_before = engine.get_stats().num_preemptions_total
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=progress)
    seconds = time.perf_counter() - start
    stats = engine.get_stats()
    per_seq = [c.num_preemptions for o in outs for c in o.outputs]
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"mode": mode, "output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "preemptions_total": stats.num_preemptions_total - preempt_before,
            "preemptions_per_seq_mean": sum(per_seq) / len(per_seq), "preemptions_per_seq_max": max(per_seq),
            "kv_capacity_tokens": stats.kv_cache_capacity_tokens,
            "recalibration_share": (engine.kv_scales.seconds_total - recal_before) / seconds,
            "linear_backend": stats.linear_backend, "attention_backend": stats.attention_backend}


def run_hf(workload: Workload, model: str, dtype: str, progress: bool) -> dict:
    """Hugging Face `generate` on the same prompts, left-padded into one batch, n samples each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp8engine.weights.default_model import default_model_path
    path = default_model_path() if model == "default" else model
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    texts = [p if isinstance(p, str) else
             tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
             for p in prompts_for(tokenizer, workload.num_prompts)]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    sample = workload.temperature > 0
    kwargs = dict(do_sample=sample, temperature=workload.temperature if sample else None, top_p=None, top_k=None,
                  max_new_tokens=workload.max_tokens, min_new_tokens=workload.max_tokens,
                  num_return_sequences=workload.n, pad_token_id=tokenizer.pad_token_id or 0)
    with torch.inference_mode():
        hf.generate(**tokenizer(texts[:1], return_tensors="pt", add_special_tokens=False), max_new_tokens=2)
        start = time.perf_counter()
        out = hf.generate(**batch, **kwargs)
        seconds = time.perf_counter() - start
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return {"mode": "hf", "output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds}


def run(workload: str, modes: list[str], baseline: str | None = None, model: str = "default",
        dtype: str = "bfloat16", device: str = "auto", progress: bool = True, rounds: int = 1) -> dict:
    """Every mode once per round; rounds alternate the order (first to last, then last to first), and
    each mode reports its median round, so a slow spell of the machine does not land on one mode."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {sorted(WORKLOADS)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    spec = WORKLOADS[workload]
    model = workload_model(spec, model)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(rounds):
        for m in modes if i % 2 == 0 else modes[::-1]:
            runs[m].append(run_engine(m, spec, model, dtype, device, progress))
    results = [_median_run(runs[m]) for m in modes]
    if baseline == "hf":
        results.append(run_hf(spec, model, dtype, progress))
    elif baseline is not None:
        raise ValueError(f"unknown baseline {baseline!r}; the only baseline is 'hf'")
    first = results[0]["output_tok_s"]
    for r in results:
        r["ratio_vs_first"] = r["output_tok_s"] / first
    return {"workload": asdict(spec), "model": model, "dtype": dtype, "rounds": rounds, "machine": machine_info(),
            "results": results}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count), with every round's."""
    ordered = sorted(runs, key=lambda r: r["output_tok_s"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["output_tok_s_rounds"] = [r["output_tok_s"] for r in runs]
    return median


def format_table(report: dict) -> str:
    cols = [("mode", "{}"), ("output_tok_s", "{:.1f}"), ("ratio_vs_first", "{:.2f}x"),
            ("preemptions_total", "{}"), ("preemptions_per_seq_mean", "{:.2f}"),
            ("preemptions_per_seq_max", "{}"), ("kv_capacity_tokens", "{}"), ("recalibration_share", "{:.2%}"),
            ("seconds", "{:.1f}")]
    rows = [[fmt.format(r[c]) if c in r else "-" for c, fmt in cols] for r in report["results"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, (c, _) in enumerate(cols)]
    line = lambda cells: "  ".join(cell.rjust(w) for cell, w in zip(cells, widths))  # noqa: E731
    w = report["workload"]
    head = (f"workload {w['name']}: {w['num_prompts']} prompts x n={w['n']} x {w['max_tokens']} tokens, "
            f"{report['dtype']}, torch {report['machine']['torch']}, {report['machine']['processor']}")
    rounds = report.get("rounds", 1)
    if rounds > 1:
        head += f"; median of {rounds} rounds in alternating order"
        per_round = [f"{r['mode']} " + "/".join(f"{x:.0f}" for x in r["output_tok_s_rounds"])
                     for r in report["results"] if "output_tok_s_rounds" in r]
        head += "\ntok/s per round: " + ", ".join(per_round)
    return "\n".join([head, line([c for c, _ in cols])] + [line(r) for r in rows])


def save_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
