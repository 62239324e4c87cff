"""FP8 KV cache: scale modes (recompute / external / static), capacity and preemptions."""

import pytest
import torch

from fp8engine import SamplingParams
from fp8engine.weights.quant import FP8_MAX
from tests.conftest import make_engine
from tests.prompts import PROMPTS, RAW

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BATCH = PROMPTS[:8]
LAYER0 = "model.layers.0.self_attn"


def kv_times_8(engine) -> dict:
    """k_proj and v_proj x 8, with q_proj and o_proj / 8 so the model computes the same function.

    Powers of two are exact in any float format, so every layer's k and v grow exactly 8x.
    """
    factor = {"k": 8.0, "v": 8.0, "q": 0.125, "o": 0.125}
    return {f"model.layers.{i}.self_attn.{p}_proj.weight": engine.get_weights_by_name(
        f"model.layers.{i}.self_attn.{p}_proj.weight") * f for i in range(30) for p, f in factor.items()}


def greedy(engine):
    return [o.outputs[0].token_ids for o in engine.generate(BATCH, GREEDY)]


def agreement(a, b) -> float:
    same = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
    return sum(same) / sum(len(p) for p in a)


def test_recompute_follows_weights_and_stale_scales_do_worse():
    bf16_kv = make_engine(dtype="bfloat16")
    fp8 = make_engine(dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    greedy(fp8)
    before = fp8.get_stats().kv_scales
    update = kv_times_8(bf16_kv)
    bf16_kv.update_weights(update)
    fp8.update_weights(update)
    expected = greedy(bf16_kv)
    recomputed = greedy(fp8)
    after = fp8.get_stats().kv_scales
    for name in before:
        assert after[name][0] / before[name][0] == pytest.approx(8.0, rel=1e-6)
        assert after[name][1] / before[name][1] == pytest.approx(8.0, rel=1e-6)
    stale = make_engine(dtype="bfloat16", kv_cache_dtype="fp8_e4m3", kv_scale_mode="external")
    stale.update_weights(update, kv_scales={name: pair for name, pair in before.items()})
    stale_out = greedy(stale)
    good, bad = agreement(expected, recomputed), agreement(expected, stale_out)
    assert good >= 0.5 and good >= bad + 0.25, (good, bad)


def test_external_scales_are_used_exactly():
    engine = make_engine(dtype="bfloat16", kv_cache_dtype="fp8_e4m3", kv_scale_mode="external", num_kv_blocks=32)
    engine.update_weights({"model.layers.1.self_attn.k_scale": torch.tensor(0.0371),
                           "model.layers.1.self_attn.v_scale": torch.tensor([0.0123])},
                          kv_scales={0: (0.5, 0.25), "model.layers.2.self_attn": (0.125, 0.0625)})
    prompt = list(range(2000, 2050))
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    scales = engine.get_stats().kv_scales
    assert scales[LAYER0] == (0.5, 0.25)
    assert scales["model.layers.1.self_attn"] == (float(torch.tensor(0.0371)), float(torch.tensor(0.0123)))
    assert scales["model.layers.2.self_attn"] == (0.125, 0.0625)
    assert scales["model.layers.3.self_attn"] == (1.0, 1.0)
    # and the cache holds E4M3(k / k_scale), E4M3(v / v_scale): layer 0's k and v depend on no cache, so
    # they are the BF16-cache engine's, bit for bit
    bf16_kv = make_engine(dtype="bfloat16", num_kv_blocks=32)
    bf16_kv.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    for cache, want, scale in ((engine.runner.attn_layers[0].k_cache, bf16_kv.runner.attn_layers[0].k_cache, 0.5),
                               (engine.runner.attn_layers[0].v_cache, bf16_kv.runner.attn_layers[0].v_cache, 0.25)):
        expected = (want.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
        assert int((cache.view(torch.uint8) != 0).sum()) > 0.9 * 50 * cache.shape[-2] * cache.shape[-1]


@pytest.mark.parametrize("bad,match", [
    ({99: (1.0, 1.0)}, "unknown layer"), ({0: (0.0, 1.0)}, "finite and > 0"), ({0: (1.0,)}, "k_scale, v_scale")])
def test_bad_external_scales_raise_and_change_nothing(bad, match):
    engine = make_engine(dtype="bfloat16", kv_cache_dtype="fp8_e4m3", kv_scale_mode="external")
    with pytest.raises(ValueError, match=match):
        engine.update_weights({}, kv_scales=bad)
    assert engine.weight_version == 0 and engine.get_stats().kv_scales[LAYER0] == (1.0, 1.0)


def test_scales_rejected_outside_external_mode(engine_bf16):
    with pytest.raises(ValueError, match="kv_scale_mode"):
        engine_bf16.update_weights({}, kv_scales={0: (1.0, 1.0)})


def test_static_scales_never_move_and_recompute_is_idempotent():
    static = make_engine(dtype="bfloat16", kv_cache_dtype="fp8_e4m3", kv_scale_mode="static")
    recompute = make_engine(dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    same = {n: p.detach().clone() for n, p in recompute.named_parameters()
            if n.endswith("o_proj.weight")}
    greedy(recompute)
    seen = []
    for _ in range(3):
        static.update_weights(same)
        recompute.update_weights(same)
        greedy(static)
        greedy(recompute)
        seen.append(recompute.get_stats().kv_scales)
        assert set(static.get_stats().kv_scales.values()) == {(1.0, 1.0)}
    assert seen[0] == seen[1] == seen[2]
    assert recompute.kv_scales.num_calibrations == 4


def test_fp8_kv_doubles_capacity_and_preempts_less():
    budget = 40 * 16 * 23040  # 40 BF16 blocks of 16 tokens for the default model
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    runs = {}
    for dtype in ("auto", "fp8_e4m3"):
        engine = make_engine(dtype="bfloat16", kv_cache_dtype=dtype, kv_cache_memory_bytes=budget)
        engine.generate(RAW[:12], params)
        runs[dtype] = engine.get_stats()
    assert runs["auto"].num_kv_blocks_total == 40
    assert runs["fp8_e4m3"].num_kv_blocks_total == 80
    assert runs["fp8_e4m3"].kv_cache_capacity_tokens == 2 * runs["auto"].kv_cache_capacity_tokens
    assert runs["auto"].num_preemptions_total > 0
    assert runs["fp8_e4m3"].num_preemptions_total < runs["auto"].num_preemptions_total
