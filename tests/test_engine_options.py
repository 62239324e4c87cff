"""Public options and surface of LLMEngine that the behaviour tests do not reach: the prefix cache and its
counters, request ids, per-prompt params, top-k / min-p, power-of-two FP8 scales, KV-scale margin and
checkpoint scales, max_model_len, max_num_seqs and block sizes other than 16."""

import os

import pytest
import torch

from fp8engine import SamplingParams
from fp8engine.kvcache.kv_scales import KVScaleManager
from fp8engine.weights.loader import iter_safetensors
from fp8engine.weights.quant import FP8_MAX, dequantize_weight_blockwise, quantize_weight_blockwise
from tests.checkpoints import write_checkpoint
from tests.conftest import make_engine
from tests.prompts import RAW

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 can be shared, the tail cannot


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


# ------------------------------------------------------------------ prefix cache
@pytest.mark.parametrize("enabled", [True, False])
def test_prefix_cache_hits_count_tokens_and_keep_outputs(enabled):
    engine = make_engine(dtype="float32", num_kv_blocks=64, enable_prefix_caching=enabled)
    first = engine.generate([PROMPT], GREEDY)[0]
    second = engine.generate([PROMPT], GREEDY)[0]
    other = engine.generate([[7] + PROMPT[1:]], GREEDY)[0]  # first block differs: no hit at all
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert second.num_cached_tokens == (32 if enabled else 0)
    assert engine.get_stats().prefix_cache_hit_rate == pytest.approx(2 / 6 if enabled else 0.0)
    assert tokens([second]) == tokens([first])


@pytest.mark.parametrize("flush_cache,cached", [(False, 32), (True, 0)])
def test_update_weights_flushes_the_prefix_cache_unless_told_not_to(flush_cache, cached):
    engine = make_engine(dtype="float32", num_kv_blocks=64)
    engine.generate([PROMPT], GREEDY)
    norm = "model.norm.weight"
    engine.update_weights({norm: engine.get_weights_by_name(norm)}, flush_cache=flush_cache)
    assert engine.generate([PROMPT], GREEDY)[0].num_cached_tokens == cached
    engine.flush_prefix_cache()
    assert engine.generate([PROMPT], GREEDY)[0].num_cached_tokens == 0


# ---------------------------------------------------------------- requests and params
def test_custom_request_id_and_its_duplicate():
    engine = make_engine(dtype="float32", num_kv_blocks=64)
    assert engine.add_request(PROMPT, GREEDY, request_id="rollout-7") == "rollout-7"
    with pytest.raises(ValueError, match="request_id 'rollout-7' is already in use"):
        engine.add_request(RAW[0], GREEDY, request_id="rollout-7")
    assert list(engine.requests) == ["rollout-7"]
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["rollout-7"]
    assert tokens(outs) == tokens(engine.generate([PROMPT], GREEDY))


def test_generate_takes_one_params_per_prompt(engine_fp32):
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=4, ignore_eos=True)]
    together = engine_fp32.generate(RAW[:2], params)
    alone = [engine_fp32.generate([p], q)[0] for p, q in zip(RAW[:2], params)]
    assert [len(c.token_ids) for o in together for c in o.outputs] == [3, 5, 5]
    assert tokens(together) == tokens(alone)
    with pytest.raises(ValueError, match="got 2 sampling params for 3 prompts"):
        engine_fp32.generate(RAW[:3], params)
    assert not engine_fp32.has_unfinished_requests()


def test_top_k_one_and_min_p_one_sample_the_argmax(engine_fp32):
    greedy = engine_fp32.generate(RAW[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                          logprobs=0, logprobs_mode="raw"))
    for extra in (dict(top_k=1), dict(min_p=1.0)):
        sampled = engine_fp32.generate(RAW[:3], SamplingParams(
            temperature=1.0, max_tokens=8, ignore_eos=True, seed=5, logprobs=0, logprobs_mode="processed", **extra))
        assert tokens(sampled) == tokens(greedy), extra
        for s, g in zip(sampled, greedy):
            # the truncated distribution is a point mass; the kept mass is the argmax's raw probability
            assert s.outputs[0].logprobs == [0.0] * 8
            assert s.outputs[0].log_kept_mass == pytest.approx(g.outputs[0].logprobs, abs=5e-5)


def test_top_k_keeps_samples_inside_the_k_most_likely(engine_fp32):
    out = engine_fp32.generate([RAW[1]], SamplingParams(n=4, temperature=1.5, top_k=3, max_tokens=6, seed=2,
                                                        ignore_eos=True, logprobs=3, logprobs_mode="raw"))[0]
    for c in out.outputs:
        for token, top in zip(c.token_ids, c.top_logprobs):
            best3 = sorted(top, key=top.get, reverse=True)[:3]
            assert token in best3


# --------------------------------------------------------------------- FP8 options
def test_ue8m0_scales_are_powers_of_two_on_load_and_update(default_dir):
    engine = make_engine(quantization="fp8", fp8_scale_fmt="ue8m0", num_kv_blocks=32)
    scales = [p for n, p in engine.named_parameters() if n.endswith("weight_scale_inv")]
    assert len(scales) == 30 * 4 and all(torch.equal(torch.frexp(s)[0], torch.full_like(s, 0.5)) for s in scales)
    name = "model.layers.3.mlp.down_proj.weight"
    hf = dict(iter_safetensors(default_dir, lambda n: n == name))[name]
    assert torch.equal(engine.get_weights_by_name(name),
                       dequantize_weight_blockwise(*quantize_weight_blockwise(hf, scale_fmt="ue8m0"), hf.dtype))
    before = tokens(engine.generate(RAW[:2], GREEDY))
    engine.update_weights({name: hf * 3})
    q, s = quantize_weight_blockwise(hf * 3, scale_fmt="ue8m0")
    assert torch.equal(engine.get_weights_by_name(name), dequantize_weight_blockwise(q, s, hf.dtype))
    engine.update_weights({name: hf})
    assert tokens(engine.generate(RAW[:2], GREEDY)) == before


def test_recomputed_kv_scale_is_amax_times_margin_over_448(monkeypatch):
    seen: dict[float, dict[str, tuple[float, float]]] = {}
    observe = KVScaleManager._observe

    def spy(self, layer, q, k, v):
        seen.setdefault(self.margin, {})[layer.name] = (float(k.abs().amax()), float(v.abs().amax()))
        observe(self, layer, q, k, v)

    monkeypatch.setattr(KVScaleManager, "_observe", spy)
    for margin in (1.0, 1.5):
        engine = make_engine(kv_cache_dtype="fp8_e4m3", kv_scale_margin=margin, num_kv_blocks=32)
        engine.generate(RAW[:2], GREEDY)
        scales = engine.get_stats().kv_scales
        assert len(seen[margin]) == 30
        for name, (k_amax, v_amax) in seen[margin].items():
            assert scales[name] == (k_amax * margin / FP8_MAX, v_amax * margin / FP8_MAX)
    # layer 0's k and v depend on no cache, so its amax is the same whatever the margin
    layer0 = "model.layers.0.self_attn"
    assert seen[1.0][layer0] == seen[1.5][layer0] and min(seen[1.0][layer0]) > 0.1


def test_static_scales_come_from_the_checkpoint(default_dir, tmp_path):
    state = dict(iter_safetensors(default_dir))
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0625)
    state["model.layers.0.self_attn.v_scale"] = torch.tensor([0.03125])
    state["model.layers.29.self_attn.k_scale"] = torch.tensor(0.5, dtype=torch.bfloat16)
    model = write_checkpoint(default_dir, tmp_path / "with_scales", state)
    engine = make_engine(model, kv_cache_dtype="fp8_e4m3", kv_scale_mode="static", num_kv_blocks=32)
    bf16_kv = make_engine(model, num_kv_blocks=32)
    for e in (engine, bf16_kv):
        e.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1))
    scales = engine.get_stats().kv_scales
    assert scales["model.layers.0.self_attn"] == (0.0625, 0.03125)
    assert scales["model.layers.29.self_attn"] == (0.5, 1.0)
    assert scales["model.layers.1.self_attn"] == (1.0, 1.0)
    # the cache holds E4M3(k / k_scale): layer 0's k does not depend on any cache, so it equals the BF16 run's
    k_bf16 = bf16_kv.runner.attn_layers[0].k_cache.float()
    k_fp8 = engine.runner.attn_layers[0].k_cache
    assert torch.equal(k_fp8.view(torch.uint8), (k_bf16 / 0.0625).clamp(-FP8_MAX, FP8_MAX).to(k_fp8.dtype).view(torch.uint8))


# ------------------------------------------------------------------- limits and sizes
def test_max_model_len_caps_generation_and_rejects_longer_prompts():
    engine = make_engine(dtype="float32", num_kv_blocks=32, max_model_len=48)
    out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="prompt has 48 tokens; max_model_len is 48"):
        engine.add_request(PROMPT + PROMPT[:8], GREEDY)
    assert not engine.has_unfinished_requests()


def test_max_num_seqs_bounds_the_running_batch():
    engine = make_engine(dtype="float32", num_kv_blocks=64, max_num_seqs=2)
    for p in RAW[:5]:
        engine.add_request(p, GREEDY)
    running, done = [], 0
    while engine.has_unfinished_requests():
        done += sum(o.finished for o in engine.step())
        running.append(engine.get_stats().num_running)
    assert max(running) == 2 and done == 5
    assert engine.get_stats().num_requests_finished == 5


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes_give_the_same_greedy_tokens(block_size, engine_fp32):
    engine = make_engine(dtype="float32", num_kv_blocks=48, block_size=block_size)
    assert engine.get_stats().kv_cache_capacity_tokens == 48 * block_size
    prompts = [PROMPT, RAW[3], RAW[4]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert tokens(engine.generate(prompts, params)) == tokens(engine_fp32.generate(prompts, params))
    again = engine.generate([PROMPT], params)[0]
    assert again.num_cached_tokens == (40 - 1) // block_size * block_size


def test_dummy_weights_need_only_the_config_and_repeat_with_the_seed(tiny_qwen3_dir, tmp_path):
    """load_format="dummy": a model of a config's shape with seeded random weights (benchmarks of an 8B shape
    without its checkpoint); the checkpoint path still needs its safetensors."""
    import shutil
    for name in os.listdir(tiny_qwen3_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_qwen3_dir, name), tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = [make_engine(str(tmp_path), load_format="dummy", quantization=q, seed=3, num_kv_blocks=16).generate(
        [[5, 6, 7, 8]], greedy)[0].outputs[0] for q in (None, None, "fp8")]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs
    assert len(outs[2].token_ids) == 6
    engine = make_engine(str(tmp_path), load_format="dummy", seed=3, num_kv_blocks=16)
    assert torch.equal(engine.get_weights_by_name("model.norm.weight"), torch.ones(128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        make_engine(str(tmp_path), num_kv_blocks=16)
