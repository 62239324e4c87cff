"""Throughput benchmarks behind `fp8engine bench`: engine modes side by side in one run.

Every mode runs the same prompts with the same sampling params in the same process, one after the
other, so the ratios (mode / first mode, engine / Hugging Face, llama.cpp or vLLM) are what to read: these
machines are noisy and absolute figures move between runs. Every runner gets the same prompt token ids.
"""

import contextlib
import functools
import json
import platform
import time
from dataclasses import asdict

import torch

from fp8engine.bench import model_shapes
from fp8engine.bench.workloads import (  # noqa: F401
    BASELINES,
    MEANING,
    MODES,
    SPECULATIVE_RUNS,
    WORKLOADS,
    Workload,
    check_positive,
    shaped,
)
from fp8engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from fp8engine.engine import LLMEngine
from fp8engine.model_executor.kernels.cpu_ops import cpu_flags, cpu_name
from fp8engine.sampling_params import SamplingParams


def workload_model(spec: Workload, model: str) -> str:
    """The directory a workload runs on: --model, or the workload's own model when that is the default."""
    if model != "default" or spec.model is None:
        return model
    from fp8engine.bench.moe_model import tiny_moe_path
    return {"tiny-qwen3-moe": tiny_moe_path}[spec.model]()


def prompts_for(tokenizer, count: int) -> list:
    """rl_prompts as chat messages, or as their plain text for a model whose tokenizer has no chat template."""
    prompts = rl_prompts(count)
    return prompts if tokenizer.chat_template else [p[0]["content"] for p in prompts]


def prompt_ids(spec: Workload, tokenizer) -> list[list[int]]:
    """The workload's prompts as the token ids every runner is given (the chat ones as the engine renders them)."""
    from fp8engine.rl.client import prompt_token_ids  # not at the top: the CLI imports this module to start
    if spec.prompts == "random":
        return random_prompt_ids(tokenizer, spec.num_prompts, spec.input_len)
    return [prompt_token_ids(tokenizer, p) for p in prompts_for(tokenizer, spec.num_prompts)]


def random_prompt_ids(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` seeded random token ids. Special and added tokens are left out: an EOS
    or a chat marker inside a prompt would make it a different kind of input."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    allowed = torch.tensor([t for t in range(len(tokenizer)) if t not in excluded])
    picks = torch.randint(len(allowed), (count, length), generator=torch.Generator().manual_seed(seed))
    return allowed[picks].tolist()


def shape_of(spec: Workload, prompts: list[list[int]], threads: int) -> dict:
    """The shape that ran: prompt lengths in tokens as given to the engine, output tokens per sample, threads."""
    lengths = [len(p) for p in prompts]
    return {"prompts": spec.prompts, "num_prompts": spec.num_prompts, "n": spec.n,
            "input_len": sum(lengths) / len(lengths), "input_len_min": min(lengths), "input_len_max": max(lengths),
            "output_len": spec.max_tokens, "threads": threads}


def shape_words(shape: dict) -> str:
    """"8 chat prompts of 45-52 tokens x n=2 x 32 output tokens, 2 threads" """
    low, high = shape["input_len_min"], shape["input_len_max"]
    length = f"{low}" if low == high else f"{low}-{high} (mean {shape['input_len']:.1f})"
    return (f"{shape['num_prompts']} {shape['prompts']} prompts of {length} tokens x n={shape['n']} x "
            f"{shape['output_len']} output tokens, {shape['threads']} thread{'s' * (shape['threads'] > 1)}")


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op threads set to `threads` (None: left as they are) for the block; yields the count."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_positive("--threads", threads))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def rl_prompts(count: int) -> list[list[dict]]:
    """Deterministic arithmetic word problems as chat messages, the shape of an RL math batch."""
    prompts = []
    for i in range(count):
        a, b = 17 + 7 * i, 5 + 3 * i
        prompts.append([{"role": "user", "content": f"Sam has {a} apples and buys {b} more. How many "
                                                    f"apples does Sam have now? Think step by step."}])
    return prompts


# The instruction sets the CPU kernels choose between, as /proc/cpuinfo names them: tables from machines that differ
# here are not comparable (AMX tiles listed may still be refused by the OS; the rows' linear_backend says which ran).
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def machine_info() -> dict:
    flags = cpu_flags()
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_name(), "cpu_features": [f for f in CPU_FEATURES if f in flags],
            "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def machine_words(machine: dict) -> str:
    """The CPU as a table header names it: model and kernel instruction sets, or the processor where unknown."""
    features = machine.get("cpu_features")
    return (machine.get("cpu") or machine["processor"]) + (f" ({' '.join(features)})" if features else "")


def engine_config(mode: str, workload: Workload, model: str, dtype: str, device: str,
                  speculative: str = "off", num_speculative_tokens: int = 4) -> EngineConfig:
    options = dict(MODES[mode])
    if speculative != "off":
        options.update(speculative=speculative, num_speculative_tokens=num_speculative_tokens)
    if workload.kv_cache_tokens is not None:
        options["kv_cache_memory_bytes"] = _bf16_kv_bytes(model, workload.kv_cache_tokens)
    if model_shapes.is_shape(model):
        options["load_format"] = "dummy"
    return EngineConfig(model=model_dir(model), dtype=dtype, device=device, max_num_seqs=workload.max_num_seqs,
                        **options)


def model_dir(model: str) -> str:
    """The Hugging Face directory of --model ("default": the prepared default model; a name of
    bench/model_shapes.py: that shape's config, its weights drawn at start-up)."""
    from fp8engine.weights.default_model import default_model_path
    if model_shapes.is_shape(model):
        return model_shapes.shape_path(model)
    return default_model_path() if model == "default" else model


def _bf16_kv_bytes(model: str, tokens: int) -> int:
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model_dir(model))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layer_types = getattr(cfg, "layer_types", None)  # a hybrid model's KV is its full-attention layers'
    layers = cfg.num_hidden_layers if not layer_types else sum(t == "full_attention" for t in layer_types)
    return tokens * 2 * layers * cfg.num_key_value_heads * head_dim * 2


def sampling_params(workload: Workload) -> SamplingParams:
    return SamplingParams(n=workload.n, temperature=workload.temperature, max_tokens=workload.max_tokens,
                          ignore_eos=True, seed=0, logprobs=0)


def run_engine(mode: str, workload: Workload, prompts: list[list[int]], model: str, dtype: str, device: str,
               progress: bool, speculative: str = "off", num_speculative_tokens: int = 4,
               engines: dict | None = None) -> dict:
    """One timed generate of the workload on the mode's engine (see TimedRun), whole."""
    return TimedRun(mode, workload, prompts, model, dtype, device, speculative, num_speculative_tokens,
                    engines).run(progress)


class TimedRun:
    """One timed run of the workload on a mode's engine: built, and warmed up on the exact batch it is then timed on
    (every shape its kernels and caches see), on its first run; kept in `engines` for the next rounds. Before the
    timed run a new weight version, as after an RL sync (KV scales recalibrate, prefix cache flushed).

    `run` times one generate; `start` + `advance` time it in slices of engine steps, so that several modes' runs can
    take turns on the machine (run_interleaved). Only the calls into the engine count."""

    def __init__(self, mode: str, workload: Workload, prompts: list[list[int]], model: str, dtype: str, device: str,
                 speculative: str = "off", num_speculative_tokens: int = 4, engines: dict | None = None):
        engines = {} if engines is None else engines
        self.name, self.prompts, self.speculative = run_name(mode, speculative), prompts, speculative
        self.params = sampling_params(workload)
        engine = engines.get(self.name)
        if engine is None:
            engine = LLMEngine(engine_config(mode, workload, model, dtype, device, speculative,
                                             num_speculative_tokens))
            engine.generate(prompts, self.params, use_tqdm=False)  # warm-up on the timed shape
            engines[self.name] = engine
        self.engine = engine
        engine.update_weights({})
        self.recal_before = engine.kv_scales.seconds_total
        self.before = engine.get_stats()
        self.seconds = 0.0
        self.ids: list[str] = []
        self.finished: dict = {}

    def run(self, progress: bool) -> dict:
        start = time.perf_counter()
        outs = self.engine.generate(self.prompts, self.params, use_tqdm=progress)
        self.seconds += time.perf_counter() - start
        return self.result(outs)

    def start(self) -> None:
        start = time.perf_counter()
        self.ids = [self.engine.add_request(p, self.params) for p in self.prompts]
        self.seconds += time.perf_counter() - start

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.ids)

    def advance(self, steps: int) -> None:
        """Up to `steps` engine steps, fewer when the last request finishes."""
        start = time.perf_counter()
        for _ in range(steps):
            for out in self.engine.step(finished_only=True):
                if out.finished:
                    self.finished[out.request_id] = out
            if self.done:
                break
        self.seconds += time.perf_counter() - start

    def result(self, outs: list | None = None) -> dict:
        outs = [self.finished[i] for i in self.ids] if outs is None else outs
        engine, seconds = self.engine, self.seconds
        stats = engine.get_stats()
        per_seq = [c.num_preemptions for o in outs for c in o.outputs]
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"mode": self.name, "output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
                "preemptions_total": stats.num_preemptions_total - self.before.num_preemptions_total,
                "preemptions_per_seq_mean": sum(per_seq) / len(per_seq), "preemptions_per_seq_max": max(per_seq),
                "kv_capacity_tokens": stats.kv_cache_capacity_tokens,
                "recalibration_share": (engine.kv_scales.seconds_total - self.recal_before) / seconds,
                "linear_backend": stats.linear_backend, "attention_backend": stats.attention_backend,
                "decoder_backend": stats.decoder_backend, **_spec_figures(self.speculative, self.before, stats)}


def run_interleaved(runs: list[TimedRun], steps: int) -> list[dict]:
    """The runs' timed generates taking turns: each in turn runs `steps` engine steps, the order reversing every
    turn, until all are done; a slow spell of the machine then lands on every run alike (one generate after the
    other leaves it to land on one). Results in the order given."""
    for r in runs:
        r.start()
    pending, turn = list(runs), 0
    while pending:
        for r in pending if turn % 2 == 0 else pending[::-1]:
            r.advance(steps)
        pending, turn = [r for r in pending if not r.done], turn + 1
    return [r.result() for r in runs]


def run_name(mode: str, speculative: str) -> str:
    """A run's row: the mode, with "+source" when it speculates."""
    return mode if speculative == "off" else f"{mode}+{speculative}"


def _spec_figures(speculative: str, before, after) -> dict:
    """Drafted and accepted tokens of the timed run, the acceptance rate and the tokens a verification emits."""
    if speculative == "off":
        return {}
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    verifications = after.spec_verifications - before.spec_verifications
    return {"speculative": speculative, "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance": accepted / drafted if drafted else 0.0,
            "spec_tokens_per_verification": 1 + accepted / verifications if verifications else 1.0}


def run_hf(workload: Workload, prompts: list[list[int]], model: str, dtype: str) -> dict:
    """Hugging Face `generate` on the same prompt ids, left-padded into one batch, n samples each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = model_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if model_shapes.is_shape(model):  # the shape's config only: transformers' seeded random init
        from transformers import AutoConfig
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).to(getattr(torch, dtype)).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    sample = workload.temperature > 0
    kwargs = dict(do_sample=sample, temperature=workload.temperature if sample else None, top_p=None, top_k=None,
                  max_new_tokens=workload.max_tokens, min_new_tokens=workload.max_tokens,
                  num_return_sequences=workload.n, pad_token_id=tokenizer.pad_token_id or 0)
    with torch.inference_mode():
        hf.generate(**{k: v[:1] for k, v in batch.items()}, max_new_tokens=2, pad_token_id=kwargs["pad_token_id"])
        start = time.perf_counter()
        out = hf.generate(**batch, **kwargs)
        seconds = time.perf_counter() - start
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return {"mode": "hf", "output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds}


def run(workload: str | Workload, modes: list[str], baseline: str | list[str] | None = None, model: str = "default",
        dtype: str = "bfloat16", device: str = "auto", progress: bool = True, rounds: int = 1,
        threads: int | None = None, gguf: str | None = None, llama_bin: str | None = None,
        vllm_python: str | None = None, speculative: list[str] | tuple[str, ...] = ("off",),
        num_speculative_tokens: int = 4, interleave: int = 0) -> dict:
    """Every mode once per round; rounds alternate the order (first to last, then last to first), and
    each mode reports its median round, so a slow spell of the machine does not land on one mode; its ratio to the
    first mode is the median of the rounds' ratios (each round's two runs side by side).

    workload: a WORKLOADS name or a Workload (see `shaped`). threads: torch threads for every run (None:
    as set). baseline, one or a list: "hf" adds Hugging Face generate, "llama.cpp" llama-batched-bench from
    `llama_bin` on `gguf` (see bench/llama_cpp.py), "vllm" vLLM through the python of its venv,
    `vllm_python` (see bench/vllm_baseline.py); each in every round after the modes like one more mode
    (memory-bound decode on a shared machine drifts by tens of percent within minutes); ratios are against
    the first mode. Every mode and baseline is warmed up on the exact batch it is then timed on. speculative: each mode once per entry, "off" (plain decoding; the row is the mode's name)
    or a draft source ("ngram", "suffix"; the row is "mode+source"). interleave: N > 0 times the modes of a round
    together, N engine steps each in turn (run_interleaved), the baselines before or after them as one more run;
    0 runs each mode's generate whole."""
    spec = WORKLOADS.get(workload) if isinstance(workload, str) else workload
    if spec is None:
        raise ValueError(f"unknown workload {workload!r}; choose from {sorted(WORKLOADS)}")
    bad = [s for s in speculative if s not in SPECULATIVE_RUNS]
    if bad or not speculative:
        raise ValueError(f"unknown --speculative {bad or speculative}; choose from {', '.join(SPECULATIVE_RUNS)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown modes {unknown or modes}; choose from {list(MODES)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if interleave < 0:
        raise ValueError(f"interleave must be >= 0 engine steps, got {interleave}")
    if threads is not None:
        check_positive("--threads", threads)
    baselines = [baseline] if isinstance(baseline, str) else list(baseline or [])
    # a missing binary or a python without vllm fails here, before the modes run
    checked = _checked_baselines(baselines, gguf, llama_bin, vllm_python,
                                 torch.get_num_threads() if threads is None else threads)
    model = workload_model(spec, model)
    with torch_threads(threads) as threads:
        from transformers import AutoTokenizer
        prompts = prompt_ids(spec, AutoTokenizer.from_pretrained(model_dir(model)))
        shape = shape_of(spec, prompts, threads)
        engines: dict = {}
        spec_kw = {s: {} if s == "off" else dict(speculative=s, num_speculative_tokens=num_speculative_tokens)
                   for s in speculative}
        runners = {run_name(m, s): functools.partial(
            run_engine, m, spec, prompts, model, dtype, device, progress, engines=engines, **spec_kw[s])
            for m in modes for s in speculative}
        timed = {run_name(m, s): functools.partial(TimedRun, m, spec, prompts, model, dtype, device,
                                                   engines=engines, **spec_kw[s]) for m in modes for s in speculative}
        for name in baselines:
            runners[name] = _baseline_run(name, checked.get(name), spec, prompts, shape, model, dtype)
        order = list(runners)
        runs: dict[str, list[dict]] = {m: [] for m in order}
        for i in range(rounds):
            turn = order if i % 2 == 0 else order[::-1]
            if interleave:  # the modes as one run where the first of them comes in this round's order
                together = [m for m in turn if m in timed]
                at = turn.index(together[0])
                turn = turn[:at] + [tuple(together)] + [m for m in turn[at:] if m not in timed]
            for m in turn:
                if isinstance(m, tuple):
                    for name, result in zip(m, run_interleaved([timed[name]() for name in m], interleave)):
                        runs[name].append(result)
                else:
                    runs[m].append(runners[m]())
        results = [median_run(runs[m]) for m in order]
        machine = machine_info()
    for name, r in zip(order, results):  # paired: each round's ratio to the first mode in the same round, the median
        r["ratio_vs_first"] = _median([a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs[name], runs[order[0]])])
    report = {"workload": asdict(spec), "shape": shape, "model": model, "dtype": dtype, "rounds": rounds,
              "interleave": interleave, "machine": machine, "results": results}
    if baselines:
        report["versus_best_peer"] = versus_best_peer(runs, [m for m in order if m not in baselines], baselines)
    return report


def versus_best_peer(runs: dict[str, list[dict]], modes: list[str], peers: list[str]) -> dict:
    """Round by round, the fastest mode's output tok/s over the fastest peer's in the same round: the side-by-side
    ratio, which the per-row medians (each row's own middle round) do not give when rounds drift. `median` is the
    middle round's ratio (the lower middle for an even count, as the rows)."""
    rounds = []
    for i in range(len(runs[modes[0]])):
        mode = max(modes, key=lambda m: runs[m][i]["output_tok_s"])
        peer = max(peers, key=lambda p: runs[p][i]["output_tok_s"])
        best, rival = runs[mode][i], runs[peer][i]
        rounds.append({"mode": best["mode"], "peer": rival["mode"],
                       "ratio": best["output_tok_s"] / rival["output_tok_s"]})
    return {"rounds": rounds, "median": _median([r["ratio"] for r in rounds])}


def _median(values: list[float]) -> float:
    """The middle value (the lower middle one for an even count, as the rows' medians)."""
    return sorted(values)[(len(values) - 1) // 2]


def _checked_baselines(baselines: list[str], gguf: str | None, llama_bin: str | None, vllm_python: str | None,
                       threads: int) -> dict:
    """The subprocess baselines' runners with what they run checked: llama.cpp's binary and GGUF, vLLM's python."""
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown or len(set(baselines)) < len(baselines):
        raise ValueError(f"baselines {baselines}: choose each at most once from {', '.join(BASELINES)}")
    if "llama.cpp" not in baselines and (gguf is not None or llama_bin is not None):
        raise ValueError("--gguf and --llama-bin are for --baseline llama.cpp")
    if "vllm" not in baselines and vllm_python is not None:
        raise ValueError("--vllm-python is for --baseline vllm")
    checked = {}
    if "llama.cpp" in baselines:
        from fp8engine.bench import llama_cpp
        checked["llama.cpp"] = llama_cpp.runner(gguf, llama_bin)
    if "vllm" in baselines:
        from fp8engine.bench import vllm_baseline
        checked["vllm"] = vllm_baseline.runner(vllm_python, threads)
    return checked


def _baseline_run(name: str, checked, spec: Workload, prompts: list[list[int]], shape: dict, model: str,
                  dtype: str):
    """One round's run of baseline `name` on the shape, as a call without arguments."""
    if name == "hf":
        return functools.partial(run_hf, spec, prompts, model, dtype)
    if name == "llama.cpp":
        return functools.partial(checked, round(shape["input_len"]), spec.max_tokens, spec.num_prompts * spec.n,
                                 shape["threads"], shared_prompt=spec.num_prompts == 1)
    kv_bytes = DEFAULT_CPU_KV_BYTES if spec.kv_cache_tokens is None else _bf16_kv_bytes(model, spec.kv_cache_tokens)
    return functools.partial(checked, prompts, spec, model_dir(model), dtype, shape["threads"], kv_bytes)


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count), with every round's."""
    ordered = sorted(runs, key=lambda r: r["output_tok_s"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["output_tok_s_rounds"] = [r["output_tok_s"] for r in runs]
    median["spread"] = (ordered[-1]["output_tok_s"] - ordered[0]["output_tok_s"]) / median["output_tok_s"]
    return median


def table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    """Right-aligned columns: a header line, then a line per row ("-" where a row lacks a column)."""
    cells = [[fmt.format(r[c]) if c in r else "-" for c, fmt in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, (c, _) in enumerate(cols)]
    return ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [[c for c, _ in cols], *cells]]


def format_table(report: dict) -> str:
    cols = [("mode", "{}"), ("output_tok_s", "{:.1f}"), ("ratio_vs_first", "{:.2f}x"),
            ("preemptions_total", "{}"), ("preemptions_per_seq_mean", "{:.2f}"),
            ("preemptions_per_seq_max", "{}"), ("kv_capacity_tokens", "{}"), ("recalibration_share", "{:.2%}"),
            ("seconds", "{:.1f}")]
    if any("speculative" in r for r in report["results"]):
        cols[3:3] = [("spec_acceptance", "{:.1%}"), ("spec_tokens_per_verification", "{:.2f}")]
    if report.get("rounds", 1) > 1:  # (max - min) / median of the mode's rounds
        cols[3:3] = [("spread", "{:.1%}")]
    head = (f"workload {report['workload']['name']}: {shape_words(report['shape'])}, {report['dtype']}, "
            f"torch {report['machine']['torch']}, {machine_words(report['machine'])}")
    rounds = report.get("rounds", 1)
    if report.get("interleave"):
        head += f"; the modes taking turns every {report['interleave']} engine steps"
    if rounds > 1:
        head += f"; median of {rounds} rounds in alternating order"
        per_round = [f"{r['mode']} " + "/".join(f"{x:.0f}" for x in r["output_tok_s_rounds"])
                     for r in report["results"] if "output_tok_s_rounds" in r]
        head += "\ntok/s per round: " + ", ".join(per_round)
        versus = report.get("versus_best_peer")
        if versus:
            head += "\nbest mode / best peer, round by round: " + ", ".join(
                f"{r['ratio']:.2f}x ({r['mode']} / {r['peer']})" for r in versus["rounds"])
    notes = [f"what it means: {MEANING[report['workload']['name']]}"] if report["workload"]["name"] in MEANING else []
    notes += [_llama_cpp_note(r["llama_cpp"]) for r in report["results"] if "llama_cpp" in r]
    notes += [_vllm_note(r["vllm"]) for r in report["results"] if "vllm" in r]
    return "\n".join([head, *table(report["results"], cols), *notes])


def _llama_cpp_note(run: dict) -> str:
    prefill = f"{run['pp']} tokens" + (" shared by all" if run["prompt_shared"] else " each")
    return (f"llama.cpp: llama-batched-bench, {run['pl']} sequences, prompt {prefill}, {run['tg']} generated each, "
            f"{run['n_threads']} threads; its own speeds: prefill {run['speed_pp']:.1f} tok/s ({run['t_pp']:.2f} s), "
            f"decode {run['speed_tg']:.1f} tok/s ({run['t_tg']:.2f} s); output tok/s = B*TG / (T_PP + T_TG), "
            f"no sampling")


def _vllm_note(own: dict) -> str:
    return (f"vllm: {own['vllm']} on torch {own['torch']} ({own['platform']}), {own['sequences']} sequences of "
            f"{own['output_tokens'] // own['sequences']} tokens, compilation {own['compilation_mode']} "
            f"({own['compilation_backend']}), its processes and OpenMP threads on CPUs {own['omp_threads_bind']}, "
            f"KV cache {own['kv_cache_bytes'] / 2**30:.2f} GiB, LD_PRELOAD {own.get('ld_preload') or 'none (no tcmalloc)'}, "
            f"warmed up on the timed batch; "
            f"output tok/s = "
            f"output tokens / one generate's seconds, prefill and sampling included")


def save_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
