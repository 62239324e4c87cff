"""Batch-B decode, ms a token, of engines built side by side in one process (each with its own FP8ENGINE_*
overrides, read when its kernel set is chosen) and timed in alternating rounds, medians.

    python benchmarks/decode_side_by_side.py --engine rows=fp8-linear:FP8ENGINE_NT16=0 --engine nt16=fp8-linear \\
        --engine bi=fp8-linear-bi [--batches 1,4,8,32] [--rounds 5] [--tokens 64] [--threads 2]

An engine is NAME=MODE[:VAR=VALUE,...] (MODE: a bench mode, fp8engine/bench/workloads.py); ratios are to
the first engine.
"""

import argparse
import os
import time

import torch

from fp8engine import EngineConfig, LLMEngine, SamplingParams
from fp8engine.bench.workloads import MODES


def parse(spec: str) -> tuple[str, str, dict[str, str]]:
    name, _, rest = spec.partition("=")
    mode, _, overrides = rest.partition(":")
    env = dict(item.split("=", 1) for item in overrides.split(",") if item)
    if mode not in MODES:
        raise SystemExit(f"--engine {spec!r}: mode {mode!r} is not one of {sorted(MODES)}")
    return name, mode, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", required=True, help="NAME=MODE[:VAR=VALUE,...]")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {}
    for name, mode, env in map(parse, args.engine):
        saved = {var: os.environ.get(var) for var in env}
        os.environ.update(env)
        try:
            engines[name] = LLMEngine(EngineConfig(num_kv_blocks=1024, **MODES[mode]))
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
        kernels = engines[name].get_stats().kernels
        print(name, mode, env, {k: v for k, v in kernels.items() if "weights" in k or "linear" in k}, flush=True)
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, ignore_eos=True, seed=1)
    for engine in engines.values():
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    for b in (int(b) for b in args.batches.split(",")):
        prompts = [[1 + (j * 7 + i) % 1000 for j in range(32)] for i in range(b)]
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                engine.flush_prefix_cache()
                start = time.perf_counter()
                engine.generate(prompts, params)
                times[name].append((time.perf_counter() - start) / args.tokens * 1e3)
        med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        first = next(iter(med.values()))
        print(f"B={b}: " + "  ".join(f"{name} {ms:.2f} ({ms / first:.3f}x)" for name, ms in med.items()), flush=True)


if __name__ == "__main__":
    main()
