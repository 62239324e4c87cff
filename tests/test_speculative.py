"""Exact speculative decoding: with batch_invariant=True every token id, raw and processed logprob, kept mass and
top-k alternative is bitwise a plain run's, in every precision mode, through preemption, chunked prefill, n > 1,
stop strings and max_tokens inside accepted drafts, MoE routing and in-flight weight updates; drafts that are
garbage change no bit; rejected drafts leave no KV block behind."""

import dataclasses
import random

import pytest
import torch

from fp8engine import EngineConfig, SamplingParams
from fp8engine.spec.drafter import TokenIndex
from tests.conftest import make_engine
from tests.prompts import CHATS, RAW
from tests.tiny_models import tiny_dir  # noqa: F401 (a fixture)

COUNT = [{"role": "user", "content": "Write the numbers from 1 to 60 separated by commas."}]
MODES = {"bf16": {}, "fp8-linear": dict(quantization="fp8"), "fp8-kv": dict(kv_cache_dtype="fp8_e4m3"),
         "full-fp8": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_attention=True)}
SEEDED = SamplingParams(n=4, temperature=1.0, top_p=0.9, top_k=40, max_tokens=20, seed=11, logprobs=2)


def run(engine, prompts, params):
    return [[(c.token_ids, c.logprobs, c.top_logprobs, c.log_kept_mass, c.finish_reason, c.stop_reason, c.text)
             for c in o.outputs] for o in engine.generate(prompts, params)]


def oracle(reference, wrong_every: int = 0):
    """A draft source that proposes the plain run's own next tokens (so drafts are accepted and stops land
    inside them), every wrong_every-th draft token replaced by a wrong one."""
    def source(seq, k):
        target = reference[tuple(seq.request.prompt_token_ids)][seq.index]
        done = seq.num_output_tokens
        draft = list(target[done:done + k])
        if wrong_every:
            draft = [(t + 1) % 1000 if (done + i) % wrong_every == 0 else t for i, t in enumerate(draft)]
        return draft
    return source


def every_lookup(speculator):
    """The speculator's own lookup (its n-gram index) without the cost rule, whose choices follow step timings: a
    draft wherever the index has one, so what a test counts does not depend on the machine's speed."""
    return lambda seq, k: speculator._lookup(speculator._state(seq), seq)[0][:k]


def by_prompt(engine, prompts, params):
    return {tuple(o.prompt_token_ids): [c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)}


def assert_no_block_held(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("mode", list(MODES))
def test_bitwise_equal_to_plain_decoding_in_every_mode(mode):
    """Greedy on a counting prompt (lookup drafts accepted) and seeded T=1 with top-p/top-k at n=4 (drafts
    mostly rejected), through preemption (tiny KV: 8 samples of 3 blocks each never fit 14 blocks, whatever tokens
    a CPU's numerics give) and chunked prefill (32-token steps)."""
    options = dict(batch_invariant=True, num_kv_blocks=14, max_num_batched_tokens=32, **MODES[mode])
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    seeded = dataclasses.replace(SEEDED, ignore_eos=True, max_tokens=30)
    prompts = [COUNT, RAW[1], RAW[2]]
    plain = make_engine(**options)
    expected = run(plain, prompts, greedy), run(plain, prompts[1:], seeded)
    method = "ngram" if mode in ("bf16", "fp8-kv") else "suffix"
    spec = make_engine(speculative=method, num_speculative_tokens=4, **options)
    spec.speculator.source = every_lookup(spec.speculator)
    assert spec.get_stats().decoder_backend == "cpp-plan"
    assert (run(spec, prompts, greedy), run(spec, prompts[1:], seeded)) == expected
    stats = spec.get_stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.num_preemptions_total > 0 and stats.num_steps_total < plain.get_stats().num_steps_total
    assert_no_block_held(spec)


def test_stops_and_max_tokens_inside_accepted_drafts_are_as_without_drafts():
    """Drafts from an oracle (the plain run's own tokens, so whole drafts are accepted): a stop string, a stop
    token, EOS and max_tokens that land inside an accepted draft end the sample exactly where plain decoding does,
    and the tokens after them are neither emitted nor counted."""
    plain = make_engine(batch_invariant=True, num_kv_blocks=64)
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    text = plain.generate([COUNT], base)[0].outputs[0]
    stop_token = text.token_ids[13]
    cases = [SamplingParams(temperature=0.0, max_tokens=30, stop=["8,9"], logprobs=0),
             SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token], logprobs=0),
             SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=0),
             SamplingParams(temperature=1.0, max_tokens=30, seed=5, min_tokens=4, logprobs=0)]
    spec = make_engine(batch_invariant=True, num_kv_blocks=64, speculative="ngram", num_speculative_tokens=6)
    for params in cases:
        expected = run(plain, [COUNT, RAW[0]], params)
        spec.speculator.source = oracle(by_prompt(plain, [COUNT, RAW[0]], params))
        before = spec.get_stats().num_generation_tokens_total
        assert run(spec, [COUNT, RAW[0]], params) == expected
        generated = spec.get_stats().num_generation_tokens_total - before
        assert generated == sum(len(c[0]) for o in expected for c in o)
    assert expected[0][0][4] in ("stop", "length")
    assert spec.get_stats().spec_accepted_tokens > 40
    assert_no_block_held(spec)


def test_garbage_drafts_change_no_bit_and_leak_no_block():
    """A draft source proposing random tokens, or the right ones with every third wrong: the outputs are the plain
    run's bit for bit, nothing accepted beyond the right tokens, and every block comes back."""
    options = dict(batch_invariant=True, num_kv_blocks=24, quantization="fp8")
    plain = make_engine(**options)
    prompts = [RAW[3], CHATS[1]]
    expected = run(plain, prompts, SEEDED)
    spec = make_engine(speculative="ngram", num_speculative_tokens=5, **options)
    rng = random.Random(0)
    spec.speculator.source = lambda seq, k: [rng.randrange(spec.vocab_size) for _ in range(k)]
    assert run(spec, prompts, SEEDED) == expected
    assert spec.get_stats().spec_draft_tokens > 100
    assert_no_block_held(spec)
    spec.speculator.source = oracle(by_prompt(plain, prompts, SEEDED), wrong_every=3)
    accepted = spec.get_stats().spec_accepted_tokens
    outs = spec.generate(prompts, SEEDED)
    assert [[(c.token_ids, c.logprobs, c.top_logprobs, c.log_kept_mass, c.finish_reason, c.stop_reason, c.text)
             for c in o.outputs] for o in outs] == expected
    samples = [c for o in outs for c in o.outputs]
    assert sum(c.spec_accepted_tokens for c in samples) == spec.get_stats().spec_accepted_tokens - accepted > 20
    assert all(c.spec_accepted_tokens <= c.spec_draft_tokens for c in samples)
    assert_no_block_held(spec)


def test_routed_experts_and_in_flight_updates_with_drafts(tiny_dir):  # noqa: F811
    """MoE: the experts of every position fed are the plain run's (rejected drafts routed nothing that stays);
    an in-flight weight update (an empty one: version 2, the same weights) mid-run keeps every bit."""
    model = tiny_dir("qwen3_moe")
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, ignore_eos=True, seed=3, logprobs=0,
                            return_routed_experts=True)
    plain = make_engine(model, batch_invariant=True, num_kv_blocks=32)
    expected = plain.generate([CHATS[0], RAW[2]], params)
    spec = make_engine(model, batch_invariant=True, num_kv_blocks=32, speculative="suffix")
    spec.speculator.source = oracle(by_prompt(plain, [CHATS[0], RAW[2]], params), wrong_every=4)
    ids = [spec.add_request(p, params) for p in (CHATS[0], RAW[2])]
    finished = {}
    for step in range(200):
        if step == 4:
            report = spec.update_weights({}, weight_version=2, in_flight="keep")
            assert report.num_aborted == 0
        for out in spec.step():
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == 2:
            break
    got = [finished[i] for i in ids]
    for want, have in zip(expected, got):
        for a, b in zip(want.outputs, have.outputs):
            assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
            assert torch.equal(a.routed_experts, b.routed_experts)
            assert set(b.token_weight_versions) == {0, 2}
    assert spec.get_stats().spec_accepted_tokens > 0
    assert_no_block_held(spec)


def test_token_index_finds_the_longest_latest_ngram():
    index = TokenIndex()
    tokens = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    index.update(index.add(tokens))
    assert index.draft(tokens, 3) == ([4, 7, 1], 2)  # "1 2" last continued by 4 (position 6), not by 3
    tokens.append(4)
    index.update(0)
    assert index.draft(tokens, 2) == ([7, 1], 3)  # "1 2 4" continued by 7
    assert index.draft([8, 8], 2) == ([], 0)


def test_speculative_options_are_validated():
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens must be at most 16"):
        EngineConfig(speculative="ngram", num_speculative_tokens=17)


def test_counters_reach_prometheus_and_the_cli_flags_reach_the_config():
    from fp8engine.entrypoints import cli, options
    from fp8engine.entrypoints.server import _EngineStatsCollector
    args = cli.build_parser().parse_args(["serve", "--speculative", "suffix", "--num-speculative-tokens", "3",
                                          "--speculative-forget-on-update"])
    config = options.engine_config(args)
    assert (config.speculative, config.num_speculative_tokens, config.speculative_forget_on_update) == ("suffix", 3,
                                                                                                        True)
    engine = make_engine(speculative="ngram", num_kv_blocks=32)
    engine.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    stats = engine.get_stats()
    assert stats.speculative == "ngram" and 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    collector = _EngineStatsCollector()
    collector.latest = stats
    values = {m.name: m.samples[0].value for m in collector.collect() if m.name.startswith("fp8engine_spec")}
    assert values == {"fp8engine_spec_draft_tokens": stats.spec_draft_tokens,
                      "fp8engine_spec_accepted_tokens": stats.spec_accepted_tokens}


def test_suffix_history_is_bounded_and_forgotten(monkeypatch):
    """Rollouts of the same prompt draft for later ones; the remembered tokens stay under their bounds, and
    forget() (an update with speculative_forget_on_update) drops them."""
    from fp8engine.request import Request, Sequence
    from fp8engine.sampling_params import SamplingParams as Params
    from fp8engine.spec import drafter
    monkeypatch.setattr(drafter, "MAX_REMEMBERED_TOKENS", 300)
    spec = drafter.Speculator("suffix", 4, 4096)

    def rollout(prompt, tokens):
        request = Request("r", prompt, Params(max_tokens=64), 0)
        seq = Sequence(request, 0, list(prompt) + tokens)
        request.seqs.append(seq)
        spec._lookup(spec._state(seq), seq)  # registers and indexes it, as a draft does
        return seq

    earlier = rollout([1, 2, 3], [10, 11, 12, 13, 14, 15])
    later = rollout([1, 2, 3], [10, 11])  # the same prompt: the earlier rollout's continuation
    assert later.draft_state.index is earlier.draft_state.index
    assert spec._lookup(later.draft_state, later) == ([12, 13, 14, 15], 3)
    for p in range(40):  # other prompts push the oldest out
        rollout([100 + p, 5], list(range(20)))
    assert sum(i.num_tokens for i in spec.prompts.values()) <= 300 + 21
    assert (1, 2, 3) not in spec.prompts and not earlier.draft_state.index.alive
    spec.forget()
    assert not spec.prompts


def test_step_cost_fit_recovers_rho_and_stays_near_its_prior():
    from fp8engine.spec.drafter import RHO_RANGE, StepCost
    cost = StepCost(10.0)
    assert cost.rho == 10.0  # no steps yet
    for i in range(64):
        rows = 1 + i % 6
        cost.record(rows, 6.0 + 0.3 * rows)  # W = 6 ms, c = 0.3 ms: rho 20
    assert abs(cost.rho - 20.0) < 1e-6
    flat = StepCost(10.0)
    for i in range(64):
        flat.record(1 + i % 6, 6.0)  # rows cost nothing (noise would say so): capped, not infinite
    assert flat.rho == 10.0 * RHO_RANGE


def test_penalties_and_logit_bias_see_the_accepted_drafts_as_tokens():
    """Penalties read the tokens before each row, drafts included: the same bits as plain decoding."""
    params = SamplingParams(n=2, temperature=0.9, top_k=30, max_tokens=24, seed=4, logprobs=1, presence_penalty=0.4,
                            frequency_penalty=0.3, repetition_penalty=1.15, logit_bias={11: 2.0})
    plain = make_engine(batch_invariant=True, num_kv_blocks=32)
    expected = run(plain, [COUNT, RAW[5]], params)
    spec = make_engine(batch_invariant=True, num_kv_blocks=32, speculative="ngram")
    spec.speculator.source = oracle(by_prompt(plain, [COUNT, RAW[5]], params), wrong_every=5)
    assert run(spec, [COUNT, RAW[5]], params) == expected
    assert spec.get_stats().spec_accepted_tokens > 30
    assert_no_block_held(spec)


def test_without_batch_invariance_the_tokens_are_the_models_own():
    """float32, not batch invariant: verification runs other shapes than plain decoding, so logits differ in
    rounding only; greedy tokens on a clear-cut prompt are the same, logprobs within float32 rounding."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0, logprobs_mode="raw")
    plain = make_engine(dtype="float32", num_kv_blocks=32).generate([COUNT], greedy)[0].outputs[0]
    spec = make_engine(dtype="float32", num_kv_blocks=32, speculative="ngram")
    spec.speculator.source = every_lookup(spec.speculator)
    got = spec.generate([COUNT], greedy)[0].outputs[0]
    assert got.token_ids == plain.token_ids and got.spec_accepted_tokens > 10
    assert max(abs(a - b) for a, b in zip(got.logprobs, plain.logprobs)) < 1e-3


def test_rollout_batches_and_exact_replay_are_the_same_with_drafts():
    """Through the trainer adapter: a speculative rollout batch is the plain one (ids, logprobs, masks, versions),
    and the engine's exact replay (LLMEngine.score) gives back its logprobs bit for bit."""
    from fp8engine.rl import RolloutEngine
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=9, logprobs=0)
    plain = RolloutEngine(EngineConfig(batch_invariant=True, quantization="fp8", num_kv_blocks=48))
    spec = RolloutEngine(EngineConfig(batch_invariant=True, quantization="fp8", num_kv_blocks=48, speculative="suffix"))
    spec.engine.speculator.source = every_lookup(spec.engine.speculator)
    a = plain.rollout([COUNT, RAW[6]], n=3, sampling_params=params)
    b = spec.rollout([COUNT, RAW[6]], n=3, sampling_params=params)
    for name in ("input_ids", "response_ids", "response_mask", "rollout_logprobs", "token_weight_versions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert spec.engine.get_stats().spec_draft_tokens > 0
    prompts = [list(p) for p in (spec.engine.tokenize(COUNT), spec.engine.tokenize(RAW[6])) for _ in range(3)]
    outs = [c for o in spec.engine.generate([COUNT, RAW[6]], dataclasses.replace(params, n=3)) for c in o.outputs]
    assert spec.engine.score(prompts, [c.token_ids for c in outs], params) == [c.logprobs for c in outs]
