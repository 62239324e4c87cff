"""Hybrid models (issue 63): Qwen3.5 dense and MoE and Qwen3-Next, tiny random models from `transformers` configs
(tests/tiny_models.py: 3 GDN layers then 1 gated-attention layer, partial RoPE). Float32 equal to HF is in
test_models.py (the ARCHS loop); here: BF16 against HF's own BF16 error, the state pool (slots in the KV budget,
taken and given back with a sequence, forks copying the state, preemption recomputing it), exact rollouts
(batch invariance in BF16 and FP8, chunked prefill, trainer replay), weights from a transformers model's
`named_parameters()` equal a checkpoint load, FP8 refit in place, a checkpoint laid out as released, prefix caching
through state snapshots (a 3-turn episode), LoRA, KV-scale names, and speculative decoding's state roll-back.

Measured (this Xeon, 8 prompts x 16 greedy tokens, mean |teacher-forced logprob - HF float32's|): BF16 engine vs
HF BF16's own distance to float32, qwen3_5 0.032 vs 0.023, qwen3_5_moe 0.090 vs 0.140, qwen3_next 0.088 vs 0.199
(random tiny MoE models route near ties differently in BF16)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8engine import SamplingParams
from tests.conftest import make_engine
from tests.hf_reference import hf_logprobs, load_hf
from tests.prompts import CHATS, PROMPTS, QUESTIONS, RAW
from tests.tiny_models import tiny_dir  # noqa: F401 (a fixture)

HYBRID = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, logprobs_mode="raw")
MODES = {"bf16": {}, "fp8-linear": dict(quantization="fp8"),
         "full-fp8": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_attention=True)}
TARGETS = [CHATS[0], CHATS[3], RAW[1], RAW[6]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, logprobs_mode="raw"),
          SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3, logprobs=0),
          SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=4, logprobs=0),
          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)]


def results(outs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def mean_abs(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) for x, y in zip(a, b)]


@pytest.mark.parametrize("arch", HYBRID)
def test_bfloat16_within_hf_bfloat16s_own_error(arch, tiny_dir):
    """BF16 against float32 HF: no further from it than 1.5x HF's own BF16 model is (0.5x-1.4x measured)."""
    engine = make_engine(tiny_dir(arch), dtype="bfloat16")
    hf32, hf16 = load_hf(tiny_dir(arch), torch.float32), load_hf(tiny_dir(arch), torch.bfloat16)
    ours, theirs = [], []
    for out in engine.generate(PROMPTS[::3], GREEDY):
        tokens = out.outputs[0].token_ids
        ref = hf_logprobs(hf32, out.prompt_token_ids, tokens)
        ours += mean_abs(out.outputs[0].logprobs, ref)
        theirs += mean_abs(hf_logprobs(hf16, out.prompt_token_ids, tokens), ref)
    ours, theirs = sum(ours) / len(ours), sum(theirs) / len(theirs)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


def test_state_pool_is_counted_in_the_kv_budget_and_given_back(tiny_dir):
    engine = make_engine(tiny_dir("qwen3_5"), dtype="bfloat16", max_num_seqs=8,
                         kv_cache_memory_bytes=4 << 20)
    stats = engine.get_stats()
    # 3 GDN layers: conv [conv_dim 2 * 64 + 128, 3] BF16 + recurrent [4, 32, 32] float32 = 1,536 + 16,384 bytes
    assert stats.state_bytes_per_sequence == 3 * (256 * 3 * 2 + 4 * 32 * 32 * 4) == 53760
    assert stats.num_state_slots_total == stats.num_state_slots_free == 8
    assert engine.runner.num_state_snapshots == 8  # as many as sequences, within an eighth of the budget
    kv_block = engine.runner.kv_bytes_per_block()
    assert stats.num_kv_blocks_total == ((4 << 20) - 16 * 53760) // kv_block
    engine.add_request(RAW[0], SamplingParams(max_tokens=4, n=3, seed=1))
    engine.step()  # the prompt, then its fork into 3 samples
    assert engine.get_stats().num_state_slots_free == 5
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_state_slots_free == 8
    # a budget of one state: one running sequence (max_num_seqs wait for slots), no snapshot, no KV block left
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=53760 leaves less than one KV block .*after 1 state"):
        make_engine(tiny_dir("qwen3_5"), dtype="bfloat16", kv_cache_memory_bytes=53760)
    # speculative decoding: num_speculative_tokens more slots a running sequence, in the same budget
    spec = make_engine(tiny_dir("qwen3_5"), dtype="bfloat16", max_num_seqs=8, kv_cache_memory_bytes=4 << 20,
                       speculative="suffix", num_speculative_tokens=2)
    assert spec.get_stats().num_kv_blocks_total == ((4 << 20) - (8 * 3 + 8) * 53760) // kv_block


@pytest.mark.parametrize("fraction, running", [(0.25, 4), (0.5, 9), (0.75, 14)])
def test_the_share_of_the_budget_for_running_states_is_an_option(tiny_dir, fraction, running):
    """state_memory_fraction of a 1 MiB budget in 53,760-byte states: that many sequences run at once; snapshots
    (an eighth: 2) and KV blocks share the rest."""
    engine = make_engine(tiny_dir("qwen3_5"), dtype="bfloat16", max_num_seqs=64, kv_cache_memory_bytes=1 << 20,
                         state_memory_fraction=fraction)
    stats = engine.get_stats()
    assert (stats.num_state_slots_total, engine.runner.num_state_snapshots) == (running, 2)
    assert stats.num_kv_blocks_total == ((1 << 20) - (running + 2) * 53760) // engine.runner.kv_bytes_per_block()


@pytest.mark.parametrize("fraction", [0, 0.8, -0.5, True, "half"])
def test_a_state_share_outside_its_range_is_refused(tiny_dir, fraction):
    with pytest.raises(ValueError, match=r"state_memory_fraction must be a number in \(0, 0.75\]"):
        make_engine(tiny_dir("qwen3_5"), dtype="bfloat16", state_memory_fraction=fraction)


@pytest.mark.parametrize("arch,mode", [("qwen3_5", "bf16"), ("qwen3_5", "full-fp8"), ("qwen3_5_moe", "fp8-linear"),
                                       ("qwen3_next", "fp8-linear")])
def test_a_request_does_not_depend_on_its_batch_chunking_or_preemption(arch, mode, tiny_dir):
    engine = make_engine(tiny_dir(arch), batch_invariant=True, **MODES[mode])
    alone = [results(engine.generate([p], q))[0] for p, q in zip(TARGETS, PARAMS)]
    fillers = [[{"role": "user", "content": f"{q} Answer in {w} words."}] for w in range(3) for q in QUESTIONS]
    filler = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=9)
    outs = engine.generate(TARGETS + fillers + RAW[:12], PARAMS + [filler] * (len(fillers) + 12))
    assert results(outs[:4]) == alone
    hit = engine.generate(TARGETS, PARAMS)  # the prompts' KV and their states at block boundaries are cached now
    assert min(o.num_cached_tokens for o in hit[:2]) >= 16 and results(hit) == alone
    for chunk in (7, 32):  # prefill chunks off and on the block grid
        chunked = make_engine(tiny_dir(arch), batch_invariant=True, max_num_batched_tokens=chunk, **MODES[mode])
        assert results(chunked.generate(TARGETS, PARAMS)) == alone
    tight = make_engine(tiny_dir(arch), batch_invariant=True, num_kv_blocks=9, **MODES[mode])
    long_filler = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=9)
    outs = tight.generate(RAW[4:8] + TARGETS, [long_filler] * 4 + PARAMS)[4:]
    assert sum(o.outputs[0].num_preemptions for o in outs) > 0 and results(outs) == alone
    # the trainer's replay (one teacher-forced prefill of prompt + response) gives the sampled logprobs' bits
    scored = engine.score([o.prompt_token_ids for o in outs[:1]], [alone[0][0]], PARAMS[0])
    assert scored[0] == alone[0][1]


def test_n_samples_fork_the_prompts_state(tiny_dir):
    """Greedy n=4: every sample continues from a copy of the prompt's state, so all four are the n=1 output; a
    sample forked without its state (a zeroed slot) would go elsewhere."""
    engine = make_engine(tiny_dir("qwen3_5"), batch_invariant=True)
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    one = results(engine.generate([RAW[2]], SamplingParams(**greedy)))[0]
    four = engine.generate([RAW[2]], SamplingParams(n=4, **greedy))[0]
    assert [(c.token_ids, c.logprobs) for c in four.outputs] == [one] * 4


def test_float32_chunked_prefill_state_within_rounding(tiny_dir):
    """Without batch invariance prefill takes the chunked form: any chunking gives the same tokens, and logprobs
    within float32 rounding of one whole prefill."""
    whole = make_engine(tiny_dir("qwen3_5"), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, logprobs_mode="raw")
    ref = results(whole.generate(TARGETS, [params] * 4))
    for chunk in (16, 48):
        got = results(make_engine(tiny_dir("qwen3_5"), dtype="float32", max_num_batched_tokens=chunk)
                      .generate(TARGETS, [params] * 4))
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert max(d for (_, a), (_, b) in zip(got, ref) for d in mean_abs(a, b)) < 1e-4


@pytest.mark.parametrize("arch", HYBRID)
def test_update_from_a_transformers_model_equals_a_checkpoint_load(arch, tiny_dir):
    """In-memory names (stacked experts, Qwen3-Next's fused projections) into an FP8 engine built with other
    weights: every parameter bitwise a fresh load of the saved checkpoint, and the same tokens."""
    hf = load_hf(tiny_dir(arch), torch.bfloat16)
    fresh = make_engine(tiny_dir(arch), quantization="fp8")
    engine = make_engine(tiny_dir(arch), quantization="fp8", load_format="dummy")
    engine.update_weights(hf.named_parameters())
    theirs = dict(fresh.runner.model.named_parameters())
    for name, param in engine.runner.model.named_parameters():
        assert torch.equal(param.view(torch.uint8) if param.dtype.itemsize == 1 else param, theirs[name].view(
            torch.uint8) if param.dtype.itemsize == 1 else theirs[name]), name
    assert results(engine.generate(TARGETS[:2], PARAMS[:1] * 2)) == results(fresh.generate(TARGETS[:2], PARAMS[:1] * 2))
    with pytest.raises(ValueError, match=r"unknown weight name 'model\.layers\.0\.linear_attn\.foo\.weight'"):
        engine.update_weights({"model.layers.0.linear_attn.foo.weight": torch.zeros(2)})


def test_in_flight_update_recomputes_the_state(tiny_dir):
    """The same weights sent mid-rollout with kv_on_update="recompute": KV and state recomputed, outputs the plain
    run's bit for bit (batch invariant)."""
    engine = make_engine(tiny_dir("qwen3_5"), batch_invariant=True)
    plain = results(engine.generate(TARGETS, PARAMS))
    ids = [engine.add_request(p, q) for p, q in zip(TARGETS, PARAMS)]
    for _ in range(5):
        engine.step()
    weights = list(load_hf(tiny_dir("qwen3_5"), torch.bfloat16).named_parameters())
    engine.update_weights(weights, in_flight="keep", kv_on_update="recompute")
    done = {}
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    outs = [done[i] for i in ids]
    assert min(o.outputs[0].num_kv_recomputes for o in outs) == 1 and results(outs) == plain


def test_a_checkpoint_laid_out_as_released_loads(tiny_dir, tmp_path, caplog):
    """The vision-language layout: text weights under model.language_model., vision and MTP tensors beside them
    (skipped, said once), config `qwen3_5` with a text_config: the same engine as the text checkpoint's."""
    src = tiny_dir("qwen3_5")
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    tensors["mtp.fc.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    out = tmp_path / "vl"
    shutil.copytree(src, out)
    save_file(tensors, out / "model.safetensors")
    with open(out / "config.json") as f:
        text = json.load(f)
    text["model_type"] = "qwen3_5_text"
    vl = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
          "vision_config": {"depth": 1, "hidden_size": 8, "intermediate_size": 8, "num_heads": 1},
          "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    with open(out / "config.json", "w") as f:
        json.dump(vl, f)
    with caplog.at_level("INFO", logger="fp8engine.weights.loader"):
        engine = make_engine(str(out), dtype="bfloat16")
    assert "skipped the checkpoint's model.visual.*, mtp.* tensors" in caplog.text
    text_engine = make_engine(src, dtype="bfloat16")
    assert results(engine.generate(TARGETS, PARAMS)) == results(text_engine.generate(TARGETS, PARAMS))
    # a trainer holding the vision-language class sends its prefix (and its vision tower): both accepted
    name = "model.language_model.layers.0.linear_attn.A_log"
    engine.update_weights({name: tensors[name] * 0 + 1, "model.visual.blocks.0.attn.qkv.weight": torch.ones(8, 8)})
    assert torch.equal(engine.get_weights_by_name("model.layers.0.linear_attn.A_log"), torch.ones(4))


def test_a_three_turn_episode_prefills_only_each_turns_new_tokens(tiny_dir):
    """Each turn's history hits the prefix cache up to the previous turn's last full block (its state snapshot):
    only the new tokens (the last sampled token, the observation, the rest of that block) are prefilled, and the
    episodes are bitwise those of an engine without the cache (measured: 142 / 118 / 94 prefill tokens of
    142 / 246 / 350 sent)."""
    from fp8engine import EngineConfig
    from fp8engine.rl import RolloutEngine
    from fp8engine.rl.episodes import rollout_episodes
    from tests.test_episodes import Chatter
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=2, ignore_eos=True)
    prompts = ["Tell me about owls.", "Why is the sky blue?"]
    runs = {}
    for caching in (True, False):
        rollouts = RolloutEngine(EngineConfig(model=tiny_dir("qwen3_5"), batch_invariant=True,
                                              enable_prefix_caching=caching))
        runs[caching] = rollout_episodes(rollouts, Chatter, prompts, n=2, sampling_params=params, max_turns=3)
    cached, plain = runs[True], runs[False]
    assert torch.equal(cached.response_ids, plain.response_ids)
    assert torch.equal(cached.rollout_logprobs, plain.rollout_logprobs)
    sent, prefilled = cached.stats["prompt_tokens_by_turn"], cached.stats["prefill_tokens_by_turn"]
    assert plain.stats["prefill_tokens_by_turn"] == sent
    episodes, block = 4, 16
    for turn in (1, 2):  # new: the observation + the previous turn's last token, + at most a block's remainder
        new = sent[turn] - sent[turn - 1] - episodes * params.max_tokens + episodes
        assert prefilled[turn] <= new + episodes * (block - 1) < sent[turn]


def test_kv_scales_name_the_decoder_layer_of_an_attention_layer(tiny_dir):
    """Layer 3 is the one attention layer: its scales by the checkpoint's name (either prefix); a GDN layer's
    index is refused by name, nothing changed."""
    engine = make_engine(tiny_dir("qwen3_5"), kv_cache_dtype="fp8_e4m3", kv_scale_mode="external")
    engine.update_weights({"model.language_model.layers.3.self_attn.k_scale": torch.tensor(0.5),
                           "model.layers.3.self_attn.v_scale": torch.tensor(0.25)})
    assert engine.get_stats().kv_scales == {"model.layers.3.self_attn": (0.5, 0.25)}
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_scale': the model has no attention layer 0 "
                                         r"\(its attention layers: \[3\]\)"):
        engine.update_weights({"model.layers.0.self_attn.k_scale": torch.tensor(2.0)})
    assert engine.get_stats().kv_scales == {"model.layers.3.self_attn": (0.5, 0.25)}


def test_lora_on_gdn_and_attention_projections_equals_merged_weights(tiny_dir):
    """A PEFT-named adapter (the vision-language prefix on one module) on a GDN layer's in_proj_qkv and out_proj,
    the gated attention's q_proj and an MLP: float32 logprobs within 1e-4 of an engine whose weights are merged
    (W + scaling * B A); removing it gives the base model's bits back. Routed experts come back per token."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.language_model.layers.0.linear_attn.in_proj_qkv": (128, 256),
              "model.layers.1.linear_attn.out_proj": (128, 128), "model.layers.3.self_attn.q_proj": (128, 256),
              "model.layers.2.mlp.down_proj": (256, 128)}
    adapter = {}
    for module, (k, n) in shapes.items():
        adapter[f"base_model.model.{module}.lora_A.weight"] = torch.randn(4, k, generator=gen) * 0.2
        adapter[f"base_model.model.{module}.lora_B.weight"] = torch.randn(n, 4, generator=gen) * 0.2
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, logprobs_mode="raw")
    engine = make_engine(tiny_dir("qwen3_5"), dtype="float32", max_lora_rank=4)
    base = results(engine.generate(TARGETS[:2], [params] * 2))
    engine.update_lora(adapter, scaling=2.0)
    with_lora = results(engine.generate(TARGETS[:2], [params] * 2))
    merged = make_engine(tiny_dir("qwen3_5"), dtype="float32")
    update = {}
    for module in shapes:
        name = merged.runner.model.hf_alias(module) + ".weight"
        delta = 2.0 * adapter[f"base_model.model.{module}.lora_B.weight"] @ adapter[
            f"base_model.model.{module}.lora_A.weight"]
        update[name] = merged.get_weights_by_name(name) + delta
    merged.update_weights(update)
    reference = results(merged.generate(TARGETS[:2], [params] * 2))
    assert with_lora != base and [t for t, _ in with_lora] == [t for t, _ in reference]
    assert max(d for (_, a), (_, b) in zip(with_lora, reference) for d in mean_abs(a, b)) < 1e-4
    engine.update_lora({})
    assert results(engine.generate(TARGETS[:2], [params] * 2)) == base
    moe = make_engine(tiny_dir("qwen3_5_moe"), dtype="bfloat16")
    out = moe.generate([RAW[0]], SamplingParams(temperature=0.0, max_tokens=6, return_routed_experts=True))[0]
    routed = out.outputs[0].routed_experts
    assert routed.shape == (len(out.prompt_token_ids) + 5, 4, 2) and 0 <= routed.min() and routed.max() < 8


def test_speculative_decoding_rolls_the_state_back_bitwise(tiny_dir):
    """Verification keeps the state after each of its tokens (num_speculative_tokens more slots a sequence) and
    rolls back to the last accepted one: with drafts that are the plain run's tokens with every third one wrong, or
    random, every output is the plain run's bit for bit (n=4 seeded samples, FP8, batch invariant)."""
    import random

    from tests.test_speculative import SEEDED, by_prompt, oracle, run
    options = dict(batch_invariant=True, quantization="fp8", max_num_seqs=8)
    prompts = [RAW[3], CHATS[1]]
    plain = make_engine(tiny_dir("qwen3_5"), **options)
    expected = run(plain, prompts, SEEDED)
    spec = make_engine(tiny_dir("qwen3_5"), speculative="ngram", num_speculative_tokens=3, **options)
    assert spec.runner.spec_states_per_slot == 3
    spec.speculator.source = oracle(by_prompt(plain, prompts, SEEDED), wrong_every=3)
    assert run(spec, prompts, SEEDED) == expected
    stats = spec.get_stats()
    assert stats.spec_accepted_tokens > 20 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    rng = random.Random(0)
    spec.speculator.source = lambda seq, k: [rng.randrange(spec.vocab_size) for _ in range(k)]
    assert run(spec, prompts, SEEDED) == expected
    assert spec.get_stats().num_state_slots_free == stats.num_state_slots_total


def test_an_aborted_request_resubmitted_prefills_from_its_last_block(tiny_dir):
    """Abort after 25 tokens, resubmit prompt + partial output: the snapshot at its last full block (48 of 63
    tokens) spares all but 15 tokens of prefill (all 63 without the prefix cache)."""
    prefilled = {}
    for caching in (True, False):
        engine = make_engine(tiny_dir("qwen3_5"), batch_invariant=True, enable_prefix_caching=caching)
        request = engine.add_request(CHATS[2], SamplingParams(temperature=1.0, max_tokens=40, seed=1, ignore_eos=True))
        for _ in range(25):
            engine.step()
        partial = engine.abort_request(request)
        ids = partial.prompt_token_ids + partial.outputs[0].token_ids
        before = engine.get_stats().num_prompt_tokens_total
        out = engine.generate([ids], SamplingParams(temperature=1.0, max_tokens=10, seed=2, ignore_eos=True))[0]
        prefilled[caching] = (len(ids), engine.get_stats().num_prompt_tokens_total - before, out.outputs[0].token_ids)
    (n, with_cache, tokens), (_, without, plain) = prefilled[True], prefilled[False]
    assert without == n and with_cache == n % 16 + 16 * (n % 16 == 0) < n and tokens == plain
