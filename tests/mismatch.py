"""Mismatch of an engine mode against BF16: teacher-forced k3 on BF16 samples, greedy agreement."""

from dataclasses import dataclass

import torch

from fp8engine import SamplingParams
from fp8engine.rl.correction import mismatch_metrics

SAMPLE = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@dataclass
class Reference:
    prompt_ids: list[list[int]]
    samples: list[list[int]]
    logprobs: torch.Tensor  # [prompts, 32] teacher-forced on the samples
    greedy: list[list[int]]


def teacher_forced(engine, prompt_ids: list[int], completion: list[int]) -> list[float]:
    """Raw logprobs of `completion` after `prompt_ids`, from one prefill (prompt_logprobs)."""
    out = engine.generate([prompt_ids + completion], SamplingParams(temperature=0, max_tokens=1,
                                                                    prompt_logprobs=0))[0]
    return out.prompt_logprobs[len(prompt_ids):]


def reference(engine, prompts) -> Reference:
    outs = engine.generate(prompts, SAMPLE)
    ids = [o.prompt_token_ids for o in outs]
    samples = [o.outputs[0].token_ids for o in outs]
    lp = torch.tensor([teacher_forced(engine, p, s) for p, s in zip(ids, samples)])
    greedy = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    return Reference(ids, samples, lp, greedy)


def k3_against(ref: Reference, engine) -> float:
    """Per-token k3 estimate of KL(reference || engine) on the reference's own samples.

    The samples come from the reference, so it plays the sampling ("rollout") role in
    mismatch_metrics and r = p_engine / p_reference.
    """
    lp = torch.tensor([teacher_forced(engine, p, s) for p, s in zip(ref.prompt_ids, ref.samples)])
    return mismatch_metrics(lp, ref.logprobs, torch.ones_like(lp))["k3"]


def greedy_agreement(ref: Reference, engine) -> tuple[int, float]:
    """(prompts whose 32 greedy tokens are identical, mean fraction of tokens before divergence)."""
    got = [o.outputs[0].token_ids for o in engine.generate(ref.prompt_ids, GREEDY)]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref.greedy, got)]
    return sum(a == b for a, b in zip(ref.greedy, got)), sum(prefix) / (32 * len(prefix))
