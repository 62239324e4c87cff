"""Engine behaviour on the default model: chat rendering, prefix sharing, preemption, seeds, bad input."""

import pytest
import torch

from fp8engine import EngineConfig, SamplingParams
from tests.conftest import make_engine
from tests.prompts import CHATS, PROMPTS, RAW

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_chat_renders_exactly_as_the_template(engine_bf16, tokenizer):
    for messages in CHATS[:4] + [[{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}]]:
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        assert engine_bf16.render_chat(messages) == list(expected)
        out = engine_bf16.generate([messages], SamplingParams(temperature=0, max_tokens=1))[0]
        assert out.prompt_token_ids == list(expected)


def test_n_samples_share_the_prompt_blocks():
    engine = make_engine(dtype="float32", num_kv_blocks=64)
    prompt = list(range(1000, 1200))  # 200 tokens: 12 full blocks of 16 and 8 tokens over
    engine.add_request(prompt, SamplingParams(n=8, temperature=1.0, max_tokens=4, seed=3))
    engine.step()
    bm = engine.block_manager
    seqs = next(iter(engine.requests.values())).seqs
    assert len(seqs) == 8
    assert bm.num_blocks - bm.num_free_blocks == 12 + 8  # prompt's full blocks once, 8 tails
    shared = seqs[0].block_table[:12]
    assert all(s.block_table[:12] == shared for s in seqs)
    assert [bm.blocks[b].ref_count for b in shared] == [8] * 12
    assert len({s.block_table[12] for s in seqs}) == 8
    engine.step()
    assert bm.num_blocks - bm.num_free_blocks == 20  # tokens 201 still fit the tail blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_keeps_float32_greedy_outputs(engine_fp32):
    prompts = RAW[:8]
    reference = engine_fp32.generate(prompts, GREEDY)
    small = make_engine(dtype="float32", num_kv_blocks=14, max_num_batched_tokens=64)
    outs = small.generate(prompts, GREEDY)
    stats = small.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    counts = [o.outputs[0].num_preemptions for o in outs]
    assert stats.num_preemptions_total > 0
    assert sum(counts) == stats.num_preemptions_total
    assert sum(c > 0 for c in counts) >= 2
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total == 14
    assert stats.num_running == stats.num_waiting == 0


def test_same_seed_same_tokens_and_different_seed_differs(engine_bf16):
    params = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=24, seed=11, ignore_eos=True)
    a = engine_bf16.generate(RAW[:3], params)
    b = engine_bf16.generate(RAW[:3], params)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert all(o.outputs[0].token_ids != o.outputs[1].token_ids for o in a)
    other = engine_bf16.generate(RAW[:3], SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=24,
                                                         seed=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in other] != [o.outputs[0].token_ids for o in a]


def test_greedy_float32_does_not_depend_on_batch(engine_fp32):
    alone = [engine_fp32.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS[:4]]
    batched = [o.outputs[0].token_ids for o in engine_fp32.generate(PROMPTS[:4] + RAW[4:10], GREEDY)[:4]]
    assert alone == batched


def test_stop_conditions(engine_fp32):
    base = engine_fp32.generate(["The capital of France is"], GREEDY)[0].outputs[0]
    text, tokens = base.text, base.token_ids
    stop_word = text.split()[2]
    out = engine_fp32.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=40, stop=[stop_word], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_word
    assert out.text == text[:text.index(stop_word)]
    out = engine_fp32.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=40, stop_token_ids=[tokens[5]], ignore_eos=True))[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(tokens[5]) + 1] and out.stop_reason == tokens[5]
    out = engine_fp32.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == tokens[:7] and out.finish_reason == "length"


def test_stop_string_late_in_a_long_output(engine_fp32):
    # The stop check decodes only the last tokens; a stop string completing far into the output must
    # cut the text exactly where a check of the whole text does.
    prompt = "Write a long story about a lighthouse keeper."
    base = engine_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))[0].outputs[0]
    words = base.text.split()
    late = next(w for w in reversed(words[len(words) // 2:]) if len(w) > 4 and base.text.index(w) > len(base.text) // 2)
    out = engine_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=120, stop=[late],
                                                        ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == late
    assert out.text == base.text[:base.text.index(late)]
    assert out.token_ids == base.token_ids[:len(out.token_ids)]
    assert len(out.token_ids) > 8 + 4 * len(late)  # past the window the check decodes


def test_eos_and_min_tokens(engine_fp32):
    chat = CHATS[0]
    out = engine_fp32.generate([chat], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine_fp32.eos_token_ids
    n = len(out.token_ids)
    longer = engine_fp32.generate([chat], SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 3))
    tokens = longer[0].outputs[0].token_ids
    assert len(tokens) >= n + 3 and not set(tokens[:n + 2]) & engine_fp32.eos_token_ids


def test_prompt_logprobs_match_teacher_forcing(engine_fp32, default_dir):
    from tests.hf_reference import hf_logprobs, load_hf
    out = engine_fp32.generate(["The capital of France is Paris"], SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    ref = hf_logprobs(load_hf(default_dir, torch.float32), ids[:1], ids[1:])
    assert max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], ref)) < 1e-3


@pytest.mark.parametrize("prompt,params,message", [
    ("", None, "prompt is empty"),
    ([], None, "non-empty"),
    (list(range(9000)), None, "max_model_len"),
    ([49152], None, "out of range"),
    ("hi", dict(temperature=-1.0), "temperature"),
    ("hi", dict(top_p=0.0), "top_p"),
    ("hi", dict(top_p=1.5), "top_p"),
    ("hi", dict(n=0), "n must be"),
    ("hi", dict(max_tokens=-1), "max_tokens"),
    ("hi", dict(top_k=-3), "top_k"),
])
def test_bad_requests_raise_and_engine_keeps_serving(engine_bf16, prompt, params, message):
    sampling = SamplingParams()
    for name, value in (params or {}).items():  # set after construction: add_request itself must validate
        setattr(sampling, name, value)
    with pytest.raises(ValueError, match=message):
        engine_bf16.add_request(prompt, sampling)
    assert not engine_bf16.has_unfinished_requests()
    out = engine_bf16.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_request_that_can_never_fit_raises():
    engine = make_engine(dtype="float32", num_kv_blocks=4)
    with pytest.raises(ValueError, match="can never fit"):
        engine.generate(["Hello there", list(range(100, 160))], SamplingParams(max_tokens=8))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 4
    assert len(engine.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
               .outputs[0].token_ids) == 4


def test_bad_config_raises():
    with pytest.raises(ValueError, match="not a directory"):
        EngineConfig(model="/nonexistent/model")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)


def test_abort_frees_blocks_and_stats_fields(engine_bf16):
    rid = engine_bf16.add_request("Tell me a story", SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine_bf16.step()
    engine_bf16.step()
    out = engine_bf16.abort_request(rid)
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    stats = engine_bf16.get_stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert stats.kv_cache_capacity_tokens == stats.num_kv_blocks_total * 16
    assert len(stats.kv_scales) == 30 and stats.weight_version == 0


def test_abort_before_the_samples_fork_finishes_the_request(engine_bf16):
    rid = engine_bf16.add_request(list(range(1000, 1300)), SamplingParams(n=4, max_tokens=5))
    out = engine_bf16.abort_request(rid)
    assert out.finished and len(out.outputs) == 1 and out.outputs[0].finish_reason == "abort"
    assert not engine_bf16.has_unfinished_requests()


def test_fork_without_free_blocks_defers_samples_instead_of_crashing():
    engine = make_engine(dtype="float32", num_kv_blocks=8)
    outs = engine.generate(["The capital of France is", "Once upon a time"],
                           SamplingParams(n=8, max_tokens=8, ignore_eos=True, seed=0))
    assert [len(o.outputs) for o in outs] == [8, 8]
    assert all(len(c.token_ids) == 8 for o in outs for c in o.outputs)
    stats = engine.get_stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total == 8
