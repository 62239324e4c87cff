"""The engine against Hugging Face transformers: greedy tokens and teacher-forced logprobs."""

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


@pytest.mark.parametrize("dtype,bound", [("bfloat16", 0.02), ("float32", 1e-3)])
def test_default_model_matches_hf(dtype, bound, default_dir, request):
    engine = request.getfixturevalue("engine_bf16" if dtype == "bfloat16" else "engine_fp32")
    hf = load_hf(default_dir, getattr(torch, dtype))
    same, mean_diff = compare(engine, hf, PROMPTS)
    assert same >= 22, f"only {same}/24 greedy continuations identical"
    assert mean_diff <= bound, mean_diff


@pytest.mark.parametrize("dtype,bound", [("bfloat16", 0.02), ("float32", 1e-3)])
def test_tiny_qwen3_matches_hf(dtype, bound, tiny_qwen3_dir):
    engine = make_engine(tiny_qwen3_dir, dtype=dtype)
    hf = load_hf(tiny_qwen3_dir, getattr(torch, dtype))
    same, mean_diff = compare(engine, hf, PROMPTS)
    assert same >= 22, f"only {same}/24 greedy continuations identical"
    assert mean_diff <= bound, mean_diff
