"""The engine against Hugging Face transformers: greedy tokens and teacher-forced logprobs.

float32: the engine and HF agree to float rounding (measured: 24/24 identical, mean |dlp| 6e-6 on the
default model, 2e-7 on the tiny Qwen3).
bfloat16: the bar is HF's own self-consistency. Measured on this CPU over these 24 prompts, HF
generate with its KV cache and without it agree on 19, and HF's decode-time logprobs differ from
its teacher-forced logprobs by 0.0274 on average (`python -m tests.hf_self_consistency`; bf16 logits
have a 0.125 quantum at the default model's logit magnitudes, the lm_head rounding alone accounts
for 0.015). From a fresh engine (empty prefix cache) the engine measures 13/24 identical and 0.0293 on
the default model (batch_invariant=True: 7/24 and 0.0276), and 12/24 and 0.0011 on the tiny random
Qwen3, whose near-flat logits make greedy ties common. The 19/24 and 0.0270 recorded before came from a
session engine whose prefix cache held blocks from earlier tests, so they depended on test order; the
greedy count moves with every near-tie, the mean |dlogprob| is the figure to watch. The bounds sit just
outside the fresh-engine figures.
"""

import pytest
import torch

from fp8engine import SamplingParams
from tests.conftest import make_engine
from tests.hf_reference import hf_greedy, hf_logprobs, load_hf
from tests.prompts import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, logprobs=0, logprobs_mode="raw")


def compare(engine, hf_model, prompts):
    outs = engine.generate(prompts, GREEDY)
    same, diffs = 0, []
    for out in outs:
        tokens = out.outputs[0].token_ids
        ref = hf_greedy(hf_model, out.prompt_token_ids, 32, engine.eos_token_ids)
        same += tokens == ref
        ref_lp = hf_logprobs(hf_model, out.prompt_token_ids, tokens)
        diffs += [abs(a - b) for a, b in zip(out.outputs[0].logprobs, ref_lp)]
    return same, sum(diffs) / len(diffs)


# (model, dtype) -> (min identical greedy continuations of 24, max mean |engine - HF logprob|)
BOUNDS = {("default", "float32"): (22, 1e-3), ("default", "bfloat16"): (11, 0.031),
          ("qwen3", "float32"): (22, 1e-3), ("qwen3", "bfloat16"): (10, 0.0015)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_model_matches_hf(dtype, default_dir, request):
    engine = request.getfixturevalue("engine_bf16" if dtype == "bfloat16" else "engine_fp32")
    min_same, bound = BOUNDS["default", dtype]
    same, mean_diff = compare(engine, load_hf(default_dir, getattr(torch, dtype)), PROMPTS)
    assert same >= min_same, f"only {same}/24 greedy continuations identical"
    assert mean_diff <= bound, mean_diff


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tiny_qwen3_matches_hf(dtype, tiny_qwen3_dir):
    min_same, bound = BOUNDS["qwen3", dtype]
    engine = make_engine(tiny_qwen3_dir, dtype=dtype)
    same, mean_diff = compare(engine, load_hf(tiny_qwen3_dir, getattr(torch, dtype)), PROMPTS)
    assert same >= min_same, f"only {same}/24 greedy continuations identical"
    assert mean_diff <= bound, mean_diff
