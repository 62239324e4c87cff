"""Structured outputs (xgrammar): every sample follows its JSON schema / regex / grammar at T=1 across seeds;
processed logprobs are under the masked distribution with the mask's share in log_kept_mass; a masked row is
batch invariant and teacher-forced scoring of it is bitwise its sampled logprobs; preemption and speculative
decoding change nothing; bad schemas are a clear error that leaves the engine as it was."""

import json
import re

import jsonschema
import pytest
import torch

from fp8engine import SamplingParams
from fp8engine.model_executor.layers.sampler import SampleRow, processed_logprobs, sample
from tests.conftest import make_engine
from tests.prompts import CHATS, RAW

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with name and age."}]
PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def engine():
    return make_engine(dtype="bfloat16", batch_invariant=True, num_kv_blocks=256)


def person(seed: int, **kw) -> SamplingParams:
    return SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=64, json_schema=PERSON, logprobs=2, **kw)


def test_json_schema_and_regex_samples_follow_them_at_t1_across_seeds(engine):
    outs = engine.generate([ASK] * 3, [person(seed) for seed in range(3)])
    texts = [c.text for o in outs for c in o.outputs]
    assert len(set(texts)) > 4  # the samples differ: the mask shapes them, it does not fix them
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop" and c.token_ids[-1] in engine.eos_token_ids, c.text
            jsonschema.validate(json.loads(c.text), PERSON)
    phones = engine.generate([RAW[0]] * 2, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, regex=PHONE))
    for c in (c for o in phones for c in o.outputs):
        assert re.fullmatch(PHONE, c.text) and c.finish_reason == "stop", c.text
    anything = engine.generate([ASK], SamplingParams(temperature=1.0, seed=1, max_tokens=48,
                                                     json_schema={"type": "object"}))[0].outputs[0]
    assert anything.finish_reason != "stop" or isinstance(json.loads(anything.text), dict)


def test_processed_logprobs_are_under_the_mask_and_kept_mass_counts_it(engine):
    processed = engine.generate([ASK], person(7))[0].outputs
    raw = engine.generate([ASK], person(7, logprobs_mode="raw"))[0].outputs
    for p, r in zip(processed, raw):
        assert p.token_ids == r.token_ids
        kept = torch.tensor(p.log_kept_mass)
        assert (kept <= 0).all() and (kept < -1e-3).any()  # the mask removed mass at some positions
        # T=1, no truncation: processed = raw - log(mass the grammar allows)
        torch.testing.assert_close(torch.tensor(p.logprobs), torch.tensor(r.logprobs) - kept, atol=2e-5, rtol=0)
        for top in p.top_logprobs:  # alternatives come from the masked distribution: disallowed ones are -inf
            assert all(lp <= 0 for lp in top.values())


def test_a_masked_row_is_batch_invariant_and_scores_bitwise(engine):
    params = person(3)
    alone = engine.generate([ASK], params)[0].outputs
    mixed = engine.generate([RAW[1], ASK, CHATS[2]], [SamplingParams(max_tokens=20, seed=1), params,
                                                      SamplingParams(n=2, temperature=0.7, seed=2, max_tokens=12)])
    assert [(c.token_ids, c.logprobs, c.log_kept_mass, c.top_logprobs) for c in alone] == \
        [(c.token_ids, c.logprobs, c.log_kept_mass, c.top_logprobs) for c in mixed[1].outputs]
    prompt = engine.tokenize(ASK)
    scored = engine.score([prompt] * len(alone), [c.token_ids for c in alone],
                          SamplingParams(temperature=1.0, json_schema=PERSON))
    assert scored == [c.logprobs for c in alone]
    greedy = engine.generate([ASK], SamplingParams(temperature=0.0, max_tokens=64, json_schema=PERSON))
    jsonschema.validate(json.loads(greedy[0].outputs[0].text), PERSON)


def test_scoring_a_response_outside_the_grammar_is_refused(engine):
    prompt = engine.tokenize(ASK)
    with pytest.raises(ValueError, match="response 0 leaves the structured output.*token 0"):
        engine.score([prompt], [engine.tokenizer("hello", add_special_tokens=False)["input_ids"]],
                     SamplingParams(temperature=1.0, json_schema=PERSON))
    assert not engine.requests


def test_preemption_and_speculation_change_nothing():
    params = SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=48, json_schema=PERSON, logprobs=0)
    prompts = [ASK, [{"role": "user", "content": "A JSON person, please: a pilot from Lima."}]]

    def run(engine):
        return [(c.token_ids, c.logprobs, c.num_preemptions) for o in engine.generate(prompts, params)
                for c in o.outputs]
    expected = run(make_engine(dtype="bfloat16", batch_invariant=True, num_kv_blocks=256))
    got = run(make_engine(dtype="bfloat16", batch_invariant=True, num_kv_blocks=10, max_num_batched_tokens=32))
    assert sum(p for _, _, p in got) > 0
    assert [r[:2] for r in got] == [r[:2] for r in expected]
    spec = make_engine(dtype="bfloat16", batch_invariant=True, num_kv_blocks=256, speculative="ngram")
    assert run(spec) == expected
    assert spec.get_stats().spec_draft_tokens == 0  # a constrained sample never drafts


@pytest.mark.parametrize("kwargs,match", [
    (dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "json_schema cannot be compiled"),
    (dict(regex="([a-"), "regex cannot be compiled"),
    (dict(grammar="root ::= undefined_rule"), "grammar cannot be compiled"),
])
def test_a_grammar_that_does_not_compile_is_a_clear_error_and_changes_nothing(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([ASK], SamplingParams(max_tokens=4, **kwargs))
    assert not engine.requests
    assert engine.generate([RAW[0]], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs,match", [
    (dict(json_schema="{not json"), "json_schema must be a JSON schema"),
    (dict(json_schema=[1]), "json_schema must be a dict or its JSON text"),
    (dict(regex="a", grammar="root ::= \"a\""), "at most one of json_schema, regex, grammar"),
    (dict(regex="a", ignore_eos=True), "regex must be used without ignore_eos and min_tokens"),
    (dict(json_schema={}, min_tokens=2, max_tokens=4), "json_schema must be used without"),
    (dict(regex=""), "regex must be a non-empty string"),
])
def test_structured_params_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_the_sampler_keeps_only_allowed_tokens_and_other_rows_bitwise():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[3, 7, 11, 40]] = True
    plain = SamplingParams(temperature=0.8, top_p=0.9, logprobs=3)
    masked = [SampleRow(plain, 1, i, 5, allowed=allowed if i == 1 else None) for i in range(3)]
    got = sample(logits, masked)
    ref = sample(logits, [SampleRow(plain, 1, i, 5) for i in range(3)])
    for i in (0, 2):  # rows without a grammar: bitwise as in a batch without one
        assert (got.token_ids[i], got.logprobs[i], got.log_kept_mass[i], got.top_logprobs[i]) == \
            (ref.token_ids[i], ref.logprobs[i], ref.log_kept_mass[i], ref.top_logprobs[i])
    assert got.token_ids[1] in (3, 7, 11, 40)
    proc, kept = processed_logprobs(logits[1:2], torch.tensor([0.8]), torch.tensor([50]), torch.tensor([0.9]),
                                    torch.tensor([0.0]), allowed[None], torch.tensor([True]))
    p = torch.softmax(logits[1] / 0.8, dim=-1)
    q = torch.where(allowed, p, 0.0) / p[allowed].sum()  # top-p acts on the masked, renormalised distribution
    order = q.argsort(descending=True)
    before = torch.cumsum(q[order], 0) - q[order]
    keep = torch.zeros(50, dtype=torch.bool)
    keep[order[before < 0.9]] = True
    torch.testing.assert_close(kept[0], p[keep].sum().log())
    assert torch.isinf(proc[0, ~keep]).all() and torch.isfinite(proc[0, keep]).all()
    greedy = sample(logits, [SampleRow(SamplingParams(temperature=0.0), 0, 0, 0, allowed=allowed)])
    assert greedy.token_ids[0] == int(torch.where(allowed, logits[0], float("-inf")).argmax())
