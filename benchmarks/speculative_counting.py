"""Speculative decoding where drafts are right: greedy on a prompt whose answer repeats itself (count to 60),
one sequence, each draft source beside plain decoding, in plain and batch-invariant fp8-linear.

    python benchmarks/speculative_counting.py [--threads 2] [--tokens 96]
"""

import argparse
import time

import torch

from fp8engine import EngineConfig, LLMEngine, SamplingParams

PROMPT = [{"role": "user", "content": "Write the numbers from 1 to 60 separated by commas."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0)
    for bi in (False, True):
        base = None
        for spec in (None, "ngram", "suffix"):
            engine = LLMEngine(EngineConfig(quantization="fp8", batch_invariant=bi, speculative=spec))
            engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            before = engine.get_stats()
            start = time.perf_counter()
            out = engine.generate([PROMPT], params)[0].outputs[0]
            seconds = time.perf_counter() - start
            after = engine.get_stats()
            rate = len(out.token_ids) / seconds
            base = base or rate
            drafted = after.spec_draft_tokens - before.spec_draft_tokens
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            print(f"fp8-linear{'-bi' if bi else ''}{'' if spec is None else '+' + spec:8s} {rate:7.1f} tok/s "
                  f"{rate / base:5.2f}x  steps {after.num_steps_total - before.num_steps_total:3d}  "
                  f"drafted {drafted:3d} accepted {accepted:3d}  {out.text[:40]!r}")


if __name__ == "__main__":
    main()
