"""What a draft row costs: every decode gets K draft tokens that are always rejected (a draft source proposing the
vocabulary's last id, which these prompts never sample), so each step has B (1 + K) rows; the step times the
speculator records, medians over the steps of a round and over rounds, engines side by side.

    python benchmarks/speculative_step_cost.py [--modes fp8-linear,fp8-linear-bi] [--batches 1,4] [--k 0,1,2,4]
"""

import argparse

import torch

from fp8engine import EngineConfig, LLMEngine, SamplingParams
from fp8engine.bench.workloads import MODES


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fp8-linear,fp8-linear-bi")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--k", default="0,1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes, ks = args.modes.split(","), [int(k) for k in args.k.split(",")]
    engines, steps = {}, {}
    for mode in modes:
        engine = LLMEngine(EngineConfig(num_kv_blocks=512, speculative="ngram", num_speculative_tokens=max(ks),
                                        **MODES[mode]))
        record, log = engine.speculator.record_step, steps.setdefault(mode, [])

        def timed(scheduled, seconds, record=record, log=log):
            if all(item.num_new_tokens == 1 for item in scheduled):  # decode steps only
                log.append(seconds)
            record(scheduled, seconds)
        engine.speculator.record_step = timed
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        engines[mode] = engine
    never = engines[modes[0]].vocab_size - 1
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, ignore_eos=True, seed=1)
    for b in (int(b) for b in args.batches.split(",")):
        prompts = [[1 + (j * 7 + i) % 1000 for j in range(32)] for i in range(b)]
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for k in ks:
                for mode, engine in engines.items():
                    engine.speculator.source = lambda seq, allowed, k=k: [never] * min(k, allowed)
                    steps[mode].clear()
                    engine.flush_prefix_cache()
                    engine.generate(prompts, params)
                    times.setdefault((mode, k), []).append(median(steps[mode][4:]) * 1e3)
        for mode in modes:
            base = median(times[mode, 0])
            print(f"B={b} {mode}: " + "  ".join(f"K={k} {median(times[mode, k]):.2f} ms "
                                                f"({median(times[mode, k]) / base:.2f}x)" for k in ks), flush=True)


if __name__ == "__main__":
    main()
