"""Tensor parallelism on CPU (issue 65): T = 2, one thread a rank, against T = 1 with two threads in one process (the
same cores), on the bench's `--model qwen3-0.6b-shape` (Qwen3-0.6B's sizes, seeded random weights: load_format dummy),
`--model tiny-qwen3-moe` (the moe workload's model: 64 experts, top-8) or `--model qwen3.5-2b-shape` (a hybrid: its
GDN heads split too).

Per configuration, rounds alternating (each engine warmed up on every batch it is timed on): decode tok/s at each
batch (random prompts of --input-len tokens, --output-len greedy tokens), the rl-short workload (32 chat prompts x 4
samples x 128 tokens, temperature 1; --rl-prompts / --rl-tokens shrink it), the share of rank 0's time inside the
collectives (the row-parallel all-reduces and the LM head's gather), and one update_weights of every weight (BF16,
the model's shapes). Two T = 2 rows: partial sums added by gloo's all-reduce (library) and gathered and added in rank
order (fixed: what batch_invariant uses), the same kernels otherwise, so their ratio is the fixed-order reduction's
cost; and T = 1 and T = 2 on the Python decoder layers (FP8ENGINE_FUSED_DECODER=0; by default every rank runs its
layers as one C++ call, the all-reduces inside it), which gives the C++ plan's share. `--configs` picks rows, among
them "T=2 expert-parallel" (a MoE's experts whole, half a rank, against "T=2 library"'s split experts) and "T=2
python" (the ranks on their Python layers; not among the defaults).

    python benchmarks/tensor_parallel.py [--quantization fp8] [--batches 1,32] [--rounds 2] [--json F]
    python benchmarks/tensor_parallel.py --model tiny-qwen3-moe --configs "T=1,T=2 library,T=2 expert-parallel"
    python benchmarks/tensor_parallel.py --updates-only   # 3 updates a configuration, one engine resident at a time
"""

import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoTokenizer

from fp8engine import EngineConfig, LLMEngine, SamplingParams
from fp8engine.bench import model_shapes
from fp8engine.bench.moe_model import tiny_moe_path
from fp8engine.bench.throughput import machine_info, machine_words, prompt_ids, sampling_params
from fp8engine.bench.workloads import shaped
from fp8engine.weights.loader import expected_names, resolve

MODELS = {  # --model: its directory, and whether it is a shape (load_format dummy) or a checkpoint
    "qwen3-0.6b-shape": (lambda: model_shapes.shape_path("qwen3-0.6b-shape"), "dummy"),
    "tiny-qwen3-moe": (tiny_moe_path, "auto"),  # the bench's MoE: 64 experts, top-8, I = 256 (split: 128 a rank)
    "qwen3.5-2b-shape": (lambda: model_shapes.shape_path("qwen3.5-2b-shape"), "dummy"),  # GDN heads split
}
CONFIGS = {  # name: (tensor_parallel_size, threads of each rank, FP8ENGINE_TP_ALL_REDUCE, FP8ENGINE_FUSED_DECODER,
    #                expert_parallel)
    "T=1": (1, 2, "auto", "1", False),
    "T=1 python": (1, 2, "auto", "0", False),  # the Python decoder layers tensor-parallel ranks run (no C++ plan)
    "T=2 python": (2, 1, "library", "0", False),  # the ranks on their Python decoder layers (no C++ plan)
    "T=2 library": (2, 1, "library", "1", False),  # a MoE's experts split over the ranks
    "T=2 fixed": (2, 1, "fixed", "1", False),
    "T=2 expert-parallel": (2, 1, "library", "1", True),  # a MoE's experts whole, half a rank
}
DEFAULT_CONFIGS = ("T=1", "T=1 python", "T=2 library", "T=2 fixed")


def build(name: str, model: str, quantization: str | None) -> LLMEngine:
    size, threads, reduce, plan, expert_parallel = CONFIGS[name]
    torch.set_num_threads(threads)  # the workers take rank 0's count
    os.environ["FP8ENGINE_TP_ALL_REDUCE"], os.environ["FP8ENGINE_FUSED_DECODER"] = reduce, plan
    path, load_format = MODELS[model]
    return LLMEngine(EngineConfig(model=path(), load_format=load_format, quantization=quantization,
                                  tensor_parallel_size=size, expert_parallel=expert_parallel,
                                  kv_cache_memory_bytes=1 << 30, max_num_seqs=128))


def timed(engine: LLMEngine, name: str, prompts, params: SamplingParams) -> dict:
    """One generate's output tok/s and the share of rank 0's time spent in the all-reduces."""
    torch.set_num_threads(CONFIGS[name][1])
    tp = engine.runner.tp
    reduce_before = tp.seconds if tp is not None else 0.0
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    reduce = (tp.seconds - reduce_before) if tp is not None else 0.0
    return {"tok_s": tokens / seconds, "collective_share": reduce / seconds}


def update_seconds(engine: LLMEngine, name: str) -> float:
    torch.set_num_threads(CONFIGS[name][1])
    model = engine.runner.model
    gen = torch.Generator().manual_seed(1)
    shapes = {n: resolve(model, n).shape for n in expected_names(model)}
    for n in engine.runner.weight_names:  # every rank's: another expert-parallel rank's experts too
        shapes.setdefault(n, engine.get_weights_by_name(n).shape)
    state = {n: torch.randn(shape, generator=gen).to(torch.bfloat16) * 0.02 for n, shape in shapes.items()}
    start = time.perf_counter()
    engine.update_weights(state)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="fp8", choices=["fp8", "none"])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rl-prompts", type=int, default=32, help="rl-short's prompts (32: the workload's own)")
    parser.add_argument("--rl-tokens", type=int, default=128, help="rl-short's tokens a sample (128: its own)")
    parser.add_argument("--model", default="qwen3-0.6b-shape", choices=list(MODELS))
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"some of {', '.join(CONFIGS)}")
    parser.add_argument("--json")
    parser.add_argument("--updates-only", action="store_true")
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    names = args.configs.split(",")
    if unknown := set(names) - set(CONFIGS):
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    if args.updates_only:
        for name in names:
            engine = build(name, args.model, quantization)
            print(f"{name:20} update_weights s: " + " ".join(f"{update_seconds(engine, name):.2f}" for _ in range(3)))
            engine.shutdown()
        return
    batches = [int(b) for b in args.batches.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(MODELS[args.model][0]())
    gen = torch.Generator().manual_seed(0)
    decode = {b: torch.randint(100, 40_000, (b, args.input_len), generator=gen).tolist() for b in batches}
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rl = shaped("rl-short", num_prompts=args.rl_prompts, output_len=args.rl_tokens)
    rl_prompts = prompt_ids(rl, tokenizer)
    jobs = {f"decode b{b}": (decode[b], greedy) for b in batches} | {"rl-short": (rl_prompts, sampling_params(rl))}
    engines = {name: build(name, args.model, quantization) for name in names}
    for name, engine in engines.items():  # warm-up on every timed shape
        for prompts, params in jobs.values():
            timed(engine, name, prompts, params)
    results = {name: {job: [] for job in jobs} for name in names}
    for _ in range(args.rounds):
        for job, (prompts, params) in jobs.items():
            for name, engine in engines.items():
                results[name][job].append(timed(engine, name, prompts, params))
    updates = {name: update_seconds(engine, name) for name, engine in engines.items()}
    report = {"machine": machine_info(), "model": args.model, "quantization": args.quantization, "rows": {}}
    print(f"{args.model}, {args.quantization}, on {machine_words(report['machine'])}, {args.rounds} rounds (median)")
    print(f"{'':20}" + "".join(f"{job:>22}" for job in jobs) + f"{'update_weights s':>18}")
    for name in names:
        row = {job: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for job, runs in results[name].items()}
        report["rows"][name] = row | {"update_weights_seconds": updates[name]}
        cells = "".join(f"{row[job]['tok_s']:>10.1f} tok/s {row[job]['collective_share']:>4.0%} ar" for job in jobs)
        print(f"{name:20}{cells}{updates[name]:>18.2f}")
    for engine in engines.values():
        engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
