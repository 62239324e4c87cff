"""What a draft row costs: the time of a decode step at B sequences, each with k draft tokens that are all
rejected (a test-double draft source), fp8-linear, beside k = 0. The cost rule of spec/drafter.py rests on it.

    python benchmarks/speculative_rows.py [--threads 2] [--batch 1,8,32] [--drafts 0,1,2,4] [--bi]
"""

import argparse
import time

import torch

from fp8engine import EngineConfig, LLMEngine, SamplingParams


def step_ms(batch: int, drafts: int, batch_invariant: bool) -> float:
    engine = LLMEngine(EngineConfig(quantization="fp8", batch_invariant=batch_invariant,
                                    speculative="ngram" if drafts else None, num_speculative_tokens=max(drafts, 1)))
    if drafts:
        engine.speculator.source = lambda seq, k: [7] * k  # never the sampled token at T=1 here: all rejected
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=0, logprobs=0)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8 + i] for i in range(batch)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    steps, start = engine.num_steps, time.perf_counter()
    engine.generate(prompts, params)
    return (time.perf_counter() - start) / (engine.num_steps - steps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--drafts", default="0,1,2,4")
    parser.add_argument("--bi", action="store_true", help="batch_invariant=True")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for batch in map(int, args.batch.split(",")):
        cells = [f"k={k}: {step_ms(batch, k, args.bi):.2f} ms" for k in map(int, args.drafts.split(","))]
        print(f"{batch:3d} sequences: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
