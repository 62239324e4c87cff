"""Tensor parallelism (issue 65): a replica over T ranks on gloo, one thread a rank, against the T = 1 engine.

Float32 shows the sharding exact (T = 2 equals T = 1 to float32 rounding, so greedy tokens, n > 1 forks, prefix hits
and preemption give T = 1's tokens); BF16 and FP8 add one more rounding of each row-parallel layer's partial sums,
so they are compared teacher-forced: T = 2 is nearer T = 1 than float32 is. FP8 codes and scales are a slice of
T = 1's, so the weights read back equal T = 1's bit for bit.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from safetensors.torch import save_file

from benchmarks.gpu_engine import random_adapter
from checkpoints import perturbed_state, write_checkpoint
from conftest import make_engine
from fp8engine import SamplingParams
from fp8engine.model_executor.models import MODEL_REGISTRY
from fp8engine.model_executor.tensor_parallel import (MODEL_TYPES, check_shardable, fixed_order_sum, library_sum,
                                                      oversubscribed, vocab_rows)
from fp8engine.weights.dist_update import free_port, init_process_group, tensor_specs
from tiny_models import save_tiny

TP2_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
# T = 4 over 2 KV heads: each KV head replicated on two ranks
TP4_SHAPE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
PROMPTS = [[5, 17, 290, 1024, 33], [7, 7, 7, 400, 12, 9, 81], [1000, 2000, 3000], [44, 45, 46, 47, 48, 49]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, logprobs_mode="raw")


@pytest.fixture(scope="module")
def tp2_dir(tmp_path_factory, tokenizer):
    """Qwen2 (q/k/v biases: column-parallel, sliced) with 2 KV heads of 64 rows: rank 1's K and V shards start
    inside a 128-row FP8 block."""
    return save_tiny("qwen2", tmp_path_factory.mktemp("tp2"), tokenizer, **TP2_SHAPE)


@pytest.fixture(scope="module")
def fp32_pair(tp2_dir):
    """T = 1 and T = 2 in float32, a small KV cache (so a batch preempts)."""
    engines = [make_engine(tp2_dir, dtype="float32", num_kv_blocks=24, tensor_parallel_size=t) for t in (1, 2)]
    yield engines
    engines[1].shutdown()


@pytest.fixture(scope="module")
def fp8_pair(tp2_dir):
    """T = 1 and T = 2 with FP8 linears and an FP8 KV cache recalibrated by the first forward."""
    engines = [make_engine(tp2_dir, quantization="fp8", kv_cache_dtype="fp8_e4m3", num_kv_blocks=64,
                           tensor_parallel_size=t) for t in (1, 2)]
    yield engines
    engines[1].shutdown()


def _reloaded(*engines):
    """The engines on their checkpoint's weights, their FP8 KV scales measured again by the next forward (the tests
    of a module-scoped engine run in any order, some of them updating it)."""
    for engine in engines:
        engine.reload_weights()
    return engines


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_float32_greedy_forks_prefix_hits_and_preemption_equal_one_rank(fp32_pair):
    one, two = fp32_pair
    assert two.runner.kernel_names["tensor_parallel"] == "2 ranks, gloo all-reduce"
    assert two.runner.num_blocks == 24 and two.runner.attn_layers[0].num_kv_heads == 1
    outs = [e.generate(PROMPTS, GREEDY) for e in (one, two)]
    assert _tokens(outs[0]) == _tokens(outs[1])
    for a, b in zip(outs[0], outs[1]):
        assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 1e-4
    forks = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    shared = [PROMPTS[0] * 4 + [9], PROMPTS[0] * 4 + [10]]  # 21 shared tokens: a full block hits the prefix cache
    for e in (one, two):
        e.flush_prefix_cache()
    for prompt in shared:  # the second one's first block comes from the cache
        assert _tokens(one.generate([prompt], forks)) == _tokens(two.generate([prompt], forks))
    assert two.get_stats().prefix_cache_hit_rate > 0
    # 8 sequences of up to 68 tokens in 24 blocks of 16: some are preempted and recomputed
    crowd = [p + [i] for i in range(2) for p in PROMPTS]
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    before = [e.get_stats().num_preemptions_total for e in (one, two)]
    assert _tokens(one.generate(crowd, long)) == _tokens(two.generate(crowd, long))
    assert two.get_stats().num_preemptions_total > before[1]


def test_row_parallel_biases_are_added_once(tmp_path, tokenizer):
    """Llama with o_proj and down_proj biases: added after the all-reduce, by every rank, once."""
    model = save_tiny("llama-yarn", tmp_path / "biased", tokenizer, **TP2_SHAPE)
    engines = [make_engine(model, dtype="float32", num_kv_blocks=32, tensor_parallel_size=t) for t in (1, 2)]
    try:
        outs = [e.generate(PROMPTS, GREEDY) for e in engines]
        assert _tokens(outs[0]) == _tokens(outs[1])
        for a, b in zip(*outs):
            assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 1e-4
    finally:
        engines[1].shutdown()


def _adapters_match_one_rank(engines, adapter) -> list:
    """engines (T = 1, T = 2) take adapter(rank, seed) at rank 8, then a smaller one at rank 4: T = 2's greedy tokens
    are T = 1's and its logprobs within 1e-4 (float32), and the adapter changed them; returns the last outputs."""
    base = [o.outputs[0].logprobs for o in engines[1].generate(PROMPTS, GREEDY)]
    for rank, seed in ((8, 1), (4, 2)):
        outs = []
        for e in engines:
            e.update_lora(adapter(rank, seed), scaling=2.0)
            outs.append(e.generate(PROMPTS, GREEDY))
        assert _tokens(outs[0]) == _tokens(outs[1])
        for a, b, plain in zip(*outs, base):
            assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 1e-4
            assert b.outputs[0].logprobs != plain  # the adapter changed something
    return outs


def test_lora_on_column_and_row_parallel_layers(tp2_dir):
    """A's columns split on o_proj and down_proj (the adapter's part of the partial sums), B's rows on q/k/v and
    gate/up; float32 T = 2 equals T = 1, and a second, smaller adapter replaces the first on every rank."""
    engines = [make_engine(tp2_dir, dtype="float32", num_kv_blocks=32, max_lora_rank=8, tensor_parallel_size=t)
               for t in (1, 2)]
    try:
        _adapters_match_one_rank(engines, lambda rank, seed: random_adapter(dict(TP2_SHAPE, head_dim=64), rank, seed))
    finally:
        engines[1].shutdown()


def _float32_moe_matches_one_rank(model: str, **options) -> None:
    """A MoE model in float32 at T = 2 (options: how its experts are placed) gives T = 1's greedy tokens, its
    logprobs within 1e-4 and its routed experts."""
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, logprobs_mode="raw", return_routed_experts=True)
    outs = []
    for t in (1, 2):
        engine = make_engine(model, dtype="float32", num_kv_blocks=32, tensor_parallel_size=t, **options)
        outs.append(engine.generate(PROMPTS, params))
        engine.shutdown()
    assert _tokens(outs[0]) == _tokens(outs[1])
    for a, b in zip(*outs):
        assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 1e-4
        assert torch.equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)


def test_moe_experts_whole_on_each_rank(tmp_path, tokenizer):
    """Qwen3-MoE with expert parallelism: 8 of 16 experts a rank, the router on both, the partial sums (each rank's
    experts' weighted outputs) all-reduced. float32: T = 1's tokens, logprobs and routed experts; not bitwise (each
    rank sums its experts, then the ranks are added: another order than one rank's). FP8: an expert held by rank 1
    reads back as T = 1's, bit for bit."""
    model = save_tiny("qwen3_moe", tmp_path / "moe", tokenizer, **TP2_SHAPE, head_dim=64)
    with pytest.raises(ValueError, match=r"model\.layers\.\*\.mlp\.experts\.\*\.down_proj has 64 inputs, 32 per rank"):
        make_engine(model, quantization="fp8", tensor_parallel_size=2)
    _float32_moe_matches_one_rank(model, expert_parallel=True)
    fp8 = [make_engine(model, quantization="fp8", num_kv_blocks=32, tensor_parallel_size=t, expert_parallel=True)
           for t in (1, 2)]
    try:
        for name in ("model.layers.1.mlp.experts.15.down_proj.weight", "model.layers.2.mlp.experts.3.gate_proj.weight"):
            assert torch.equal(fp8[1].get_weights_by_name(name), fp8[0].get_weights_by_name(name))
        # rank 0 does not hold expert 15, so rank 1 refuses its NaN: the update fails, the group goes on
        name = "model.layers.1.mlp.experts.15.down_proj.weight"
        bad = torch.full(fp8[0].get_weights_by_name(name).shape, float("nan"), dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=f"rank 1 refused the update, nothing was written: weight '{name}'.*NaN"):
            fp8[1].update_weights({name: bad, "model.norm.weight": torch.ones(TP2_SHAPE["hidden_size"])})
        assert torch.equal(fp8[1].get_weights_by_name(name), fp8[0].get_weights_by_name(name))
        assert len(fp8[1].runner.weight_names) == len(fp8[0].runner.weight_names)  # every rank's experts
        assert fp8[1].generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    finally:
        fp8[1].shutdown()


def test_moe_experts_split_over_the_ranks(tmp_path, tokenizer):
    """Qwen3-MoE without expert parallelism: every expert's intermediate rows split over the ranks (gate and up
    column-parallel, down row-parallel), the router on both. float32: T = 1's tokens, logprobs and routed experts;
    FP8: per-expert and stacked weights read back as T = 1's bit for bit; an update from transformers' in-memory
    names (stacked experts) equals T = 1's, and a NaN in rank 1's rows of a stacked tensor changes nothing."""
    model = save_tiny("qwen3_moe", tmp_path / "moe", tokenizer, **TP2_SHAPE, head_dim=64, moe_intermediate_size=256)
    _float32_moe_matches_one_rank(model)
    fp8 = [make_engine(model, quantization="fp8", num_kv_blocks=32, tensor_parallel_size=t) for t in (1, 2)]
    try:
        experts = fp8[1].runner.model.model.layers[1].mlp.experts
        assert experts.tp_inter == (0, 256) and tuple(experts.down_proj.shape) == (16, 256, 128)
        names = ["model.layers.1.mlp.experts.15.down_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight",
                 "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
        for name in names:
            assert torch.equal(fp8[1].get_weights_by_name(name), fp8[0].get_weights_by_name(name)), name
        hf = {n: p.detach() * 1.5 for n, p in transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.bfloat16).named_parameters() if ".mlp.experts." in n}
        assert "model.layers.0.mlp.experts.gate_up_proj" in hf  # [E, 2I, H], no .weight
        before = fp8[1].get_weights_by_name(names[2])
        bad = hf[names[2]].clone()
        bad[3, 256 + 200, 7] = float("nan")  # expert 3's up row 200 of 256: rank 1's half
        with pytest.raises(ValueError, match="model.layers.0.mlp.experts.3.up_proj.weight.*NaN"):
            fp8[1].update_weights({**hf, names[2]: bad})
        assert torch.equal(fp8[1].get_weights_by_name(names[2]), before)
        for engine in fp8:
            engine.update_weights(hf)
        for name in names:
            assert torch.equal(fp8[1].get_weights_by_name(name), fp8[0].get_weights_by_name(name)), name
        assert not torch.equal(fp8[1].get_weights_by_name(names[2]), before)
        assert len(fp8[1].runner.weight_names) == len(fp8[0].runner.weight_names)
    finally:
        fp8[1].shutdown()


# a hybrid Qwen3.5 that two ranks split in FP8: 2 / 4 linear heads of 64 (out_proj's 256 inputs: 128 a rank)
HYBRID_TP2 = dict(TP2_SHAPE, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                  linear_value_head_dim=64)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_hybrid_models_split_their_gdn_heads_over_the_ranks(tmp_path, tokenizer, arch):
    """Qwen3.5 (GDN layers + gated attention; MoE with a shared expert) and Qwen3-Next (its GDN projections fused
    per key head; a dense MLP in layer 1): each rank holds whole key and value heads of every GDN layer (in_proj_qkv's
    q, k and v rows, the conv's channels, dt_bias / A_log sliced; out_proj row-parallel) and its state pool for them.
    float32: T = 1's tokens, logprobs and routed experts; the weights read back (gathered) equal T = 1's;
    update_weights from transformers' in-memory names equals T = 1's update."""
    moe = arch != "qwen3_5"
    extra = dict(moe_intermediate_size=256, shared_expert_intermediate_size=256) if moe else {}
    model = save_tiny(arch, tmp_path / arch, tokenizer, **HYBRID_TP2, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, logprobs_mode="raw",
                            return_routed_experts=moe)
    engines = [make_engine(model, dtype="float32", num_kv_blocks=32, tensor_parallel_size=t) for t in (1, 2)]
    try:
        one, two = engines
        stats = [e.get_stats() for e in engines]
        assert stats[1].num_state_slots_total == stats[0].num_state_slots_total
        assert stats[1].state_bytes_per_sequence * 2 == stats[0].state_bytes_per_sequence  # half the heads a rank
        outs = [e.generate(PROMPTS, params) for e in engines]
        assert _tokens(outs[0]) == _tokens(outs[1])
        for a, b in zip(*outs):
            assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 1e-4
            if moe:
                assert torch.equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)
        # greedy forks: each a copy of the prompt's state slot (sampled ones differ on this near-uniform random
        # model: a 1e-6 change of the logits moves the seeded draw)
        forks = SamplingParams(n=3, temperature=0.0, max_tokens=6)
        assert _tokens(one.generate(PROMPTS[:2], forks)) == _tokens(two.generate(PROMPTS[:2], forks))
        gdn = (["in_proj_qkvz.weight", "in_proj_ba.weight"] if arch == "qwen3_next" else
               ["in_proj_qkv.weight", "in_proj_b.weight"])
        names = [f"model.layers.0.linear_attn.{gdn[0]}", f"model.layers.2.linear_attn.{gdn[1]}",
                 "model.layers.1.linear_attn.conv1d.weight", "model.layers.2.linear_attn.A_log",
                 "model.layers.0.linear_attn.out_proj.weight", "model.layers.3.self_attn.q_proj.weight"]
        names += {"qwen3_5": ["model.layers.1.mlp.gate_proj.weight"],
                  "qwen3_5_moe": ["model.layers.1.mlp.shared_expert.down_proj.weight",
                                  "model.layers.2.mlp.experts.gate_up_proj"],
                  "qwen3_next": ["model.layers.1.mlp.gate_proj.weight", "model.layers.2.mlp.experts.gate_up_proj",
                                 "model.layers.0.mlp.shared_expert.up_proj.weight"]}[arch]
        for name in names:
            assert torch.equal(two.get_weights_by_name(name), one.get_weights_by_name(name)), name
        hf = {n: p.detach() * 1.25 for n, p in transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32).named_parameters()}
        for engine in engines:
            engine.update_weights(hf)
        for name in names:
            assert torch.equal(two.get_weights_by_name(name), one.get_weights_by_name(name)), name
        assert _tokens(one.generate(PROMPTS, params)) == _tokens(two.generate(PROMPTS, params))
    finally:
        engines[1].shutdown()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_an_fp8_hybrid_model_splits_in_whole_blocks_and_reads_back_as_one_rank(tmp_path, tokenizer, arch):
    extra = dict(moe_intermediate_size=256, shared_expert_intermediate_size=256) if arch == "qwen3_next" else {}
    model = save_tiny(arch, tmp_path / "hybrid", tokenizer, **HYBRID_TP2, **extra)
    engines = [make_engine(model, quantization="fp8", kv_cache_dtype="fp8_e4m3", num_kv_blocks=32,
                           tensor_parallel_size=t) for t in (1, 2)]
    gdn = ["in_proj_qkv.weight", "in_proj_z.weight", "in_proj_qkv.weight_scale_inv"]
    if arch == "qwen3_next":  # its fused names (their scales are the engine's own, never a checkpoint's)
        gdn = ["in_proj_qkvz.weight", "in_proj_ba.weight"]
    try:
        for name in [f"model.layers.{i}.linear_attn.{n}" for i, n in enumerate(gdn)] + [
                "model.layers.2.linear_attn.out_proj.weight", "model.layers.3.self_attn.o_proj.weight"]:
            assert torch.equal(engines[1].get_weights_by_name(name), engines[0].get_weights_by_name(name)), name
        outs = [e.generate(PROMPTS, GREEDY) for e in engines]  # the first forward calibrates the KV scales
        assert all(len(o.outputs[0].token_ids) == 10 for out in outs for o in out)
        scales = [e.get_stats().kv_scales for e in engines]
        assert list(scales[1]) == list(scales[0]) == ["model.layers.3.self_attn"]
    finally:
        engines[1].shutdown()


def _hybrid_adapter(rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT-named adapter on every projection of HYBRID_TP2's GDN layer 0, gated-attention layer 3 and their MLPs
    (q_proj's output rows are [q | gate] per head)."""
    hidden, inter, d = HYBRID_TP2["hidden_size"], HYBRID_TP2["intermediate_size"], HYBRID_TP2["head_dim"]
    keys, values = 2 * 64, 4 * 64
    q, kv = HYBRID_TP2["num_attention_heads"] * d, HYBRID_TP2["num_key_value_heads"] * d
    modules = {"0.linear_attn.in_proj_qkv": (hidden, 2 * keys + values), "0.linear_attn.in_proj_z": (hidden, values),
               "0.linear_attn.out_proj": (values, hidden), "3.self_attn.q_proj": (hidden, 2 * q),
               "3.self_attn.k_proj": (hidden, kv), "3.self_attn.v_proj": (hidden, kv),
               "3.self_attn.o_proj": (q, hidden), "0.mlp.gate_proj": (hidden, inter), "3.mlp.up_proj": (hidden, inter),
               "3.mlp.down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module, (k, n) in modules.items():
        prefix = f"base_model.model.model.layers.{module}"
        out[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * 0.05
        out[f"{prefix}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * 0.05
    return out


def test_lora_on_a_hybrid_model_splits_with_its_layers(tmp_path, tokenizer):
    """LoRA on a Qwen3.5 at two ranks: in_proj_qkv's one adapter feeds its q, k and v shards (its B's rows a shard
    each), in_proj_z column-parallel, out_proj row-parallel (its A's columns), gated attention and the MLP as in a
    dense model; float32 tokens and logprobs as T = 1's with the same adapter, then with a smaller one."""
    model = save_tiny("qwen3_5", tmp_path / "hybrid", tokenizer, **HYBRID_TP2)
    engines = [make_engine(model, dtype="float32", num_kv_blocks=32, max_lora_rank=8, tensor_parallel_size=t)
               for t in (1, 2)]
    try:
        outs = _adapters_match_one_rank(engines, _hybrid_adapter)
        with pytest.raises(ValueError, match=r"in_proj_qkv.lora_B.weight'.*shape \(511, 4\), expected \(512, 4\)"):
            engines[1].update_lora({**_hybrid_adapter(4, 3), "base_model.model.model.layers.0.linear_attn."
                                    "in_proj_qkv.lora_B.weight": torch.zeros(511, 4)})
        assert _tokens(engines[1].generate(PROMPTS, GREEDY)) == _tokens(outs[1])  # the refused one changed nothing
    finally:
        engines[1].shutdown()


def test_fp8_weights_kv_scales_and_logprobs_match_one_rank(fp8_pair, fp32_pair):
    one, two = _reloaded(*fp8_pair)
    outs = [e.generate(PROMPTS, GREEDY) for e in (one, two)]  # the first forward calibrates the KV scales
    # layer 0's K and V are column-parallel slices of T = 1's, so are its scales; later layers' inputs carry the
    # all-reduce's rounding
    scales = [e.get_stats().kv_scales for e in (one, two)]
    assert scales[1]["model.layers.0.self_attn"] == scales[0]["model.layers.0.self_attn"]
    for layer, (k, v) in scales[0].items():
        assert scales[1][layer] == pytest.approx((k, v), rel=0.03)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.v_proj.bias", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.gate_proj.weight"):
        assert torch.equal(two.get_weights_by_name(name), one.get_weights_by_name(name)), name
    # teacher-forced on T = 1's greedy tokens: T = 2 is nearer T = 1 than float32 is (the FP8 engine's own mismatch)
    responses = [o.outputs[0].token_ids for o in outs[0]]
    reported = [lp for o in outs[0] for lp in o.outputs[0].logprobs]
    gap = {name: [abs(x - y) for x, y in zip(reported, [lp for s in e.score(PROMPTS, responses, GREEDY) for lp in s])]
           for name, e in (("tp2", two), ("fp32", fp32_pair[0]))}
    assert max(gap["tp2"]) < max(gap["fp32"]) and sum(gap["tp2"]) < sum(gap["fp32"]) / 2


def test_the_lm_head_splits_the_vocabulary_and_gives_one_ranks_logits_bitwise(fp32_pair, fp8_pair, tmp_path,
                                                                               tokenizer):
    """Column-parallel LM head: each rank computes its half of the vocabulary's logits (an untied head holds only
    those rows; a tied one reads them from the embedding, and with lm_head_fp8 quantizes its own copy of them) and
    rank 0 gathers them; on the same hidden rows they equal T = 1's bit for bit, in float32, BF16 and FP8."""
    vocab = len(tokenizer)
    _reloaded(*fp8_pair)  # an update test may have run first (random order): both on the checkpoint's weights
    tied = save_tiny("qwen2-tied", tmp_path / "tied", tokenizer, **TP2_SHAPE)
    extra = [[make_engine(tied, num_kv_blocks=16, tensor_parallel_size=t, **options) for t in (1, 2)]
             for options in (dict(), dict(quantization="fp8", lm_head_fp8=True))]
    try:
        for one, two in [fp32_pair, fp8_pair, *extra]:
            assert two.runner.model.lm_head.vocab_rows == (0, vocab // 2, vocab)
            hidden = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(two.runner.dtype)
            logits = two.runner.head_logits(hidden)
            assert logits.shape == (5, vocab) and torch.equal(logits, one.runner.head_logits(hidden))
        for one, two in (fp8_pair, extra[1]):  # an untied BF16 head, a tied FP8 one: this rank's rows only
            assert tuple(two.runner.model.lm_head.weight.shape) == (vocab // 2, 256)
        (one, two) = fp8_pair
        assert torch.equal(two.get_weights_by_name("lm_head.weight"), one.get_weights_by_name("lm_head.weight"))
    finally:
        for _, two in extra:
            two.shutdown()


def test_fp8_update_equals_a_fresh_engine_and_a_bad_shard_changes_nothing(fp8_pair, tp2_dir, tmp_path):
    (two,) = _reloaded(fp8_pair[1])
    state = perturbed_state(tp2_dir, seed=3)
    name = "model.layers.1.self_attn.q_proj.weight"
    before = two.get_weights_by_name(name)
    bad = state[name].clone()
    bad[200, 5] = float("nan")  # row 200 of 256: rank 1's half of the heads
    with pytest.raises(ValueError, match=f"{name}.*NaN"):
        two.update_weights({**state, name: bad})
    assert torch.equal(two.get_weights_by_name(name), before)
    report = two.update_weights(state)
    assert report.num_tensors == len(state)
    fresh = make_engine(write_checkpoint(tp2_dir, tmp_path / "updated", state), quantization="fp8",
                        kv_cache_dtype="fp8_e4m3", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert torch.equal(two.get_weights_by_name(name), fresh.get_weights_by_name(name))
        a, b = two.generate(PROMPTS, GREEDY), fresh.generate(PROMPTS, GREEDY)
        assert _tokens(a) == _tokens(b)
        assert [o.outputs[0].logprobs for o in a] == [o.outputs[0].logprobs for o in b]
        assert two.get_stats().kv_scales == fresh.get_stats().kv_scales
    finally:
        fresh.shutdown()


def test_every_rank_joins_the_trainers_group_and_receives_its_broadcast(fp8_pair, tp2_dir, tmp_path):
    """A trainer's weight-update group of 3: the trainer (rank 0), the engine's rank 0 at rank_offset 1 and its
    worker at 1 + 1; the update equals the same tensors given to update_weights."""
    (two,) = _reloaded(fp8_pair[1])
    state = perturbed_state(tp2_dir, seed=5)
    path = tmp_path / "update.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-m", "tests.broadcast_trainer", str(port), "3", str(path)],
                               stdin=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        two.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=3)
        report = two.update_weights_from_distributed(*tensor_specs(sorted(state.items())), weight_version=11)
        assert (report.weight_version, report.num_tensors) == (11, len(state))
        names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"]
        received = [two.get_weights_by_name(n) for n in names]
        two.destroy_weights_update_group()
    finally:
        trainer.communicate(timeout=30)
    two.update_weights(state)
    assert all(torch.equal(r, two.get_weights_by_name(n)) for r, n in zip(received, names))
    # a join that fails on rank 0 (and on its worker) leaves every answer read: the next calls get their own
    with pytest.raises(ValueError, match="backend must be one of"):
        two.init_weights_update_group("127.0.0.1", free_port(), rank_offset=1, world_size=3, backend="bogus")
    assert torch.equal(two.get_weights_by_name(names[0]), received[0])
    assert two.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids


def test_sleep_and_wake_on_every_rank(fp8_pair):
    (two,) = _reloaded(fp8_pair[1])
    before = _tokens(two.generate(PROMPTS, GREEDY))
    awake = two.get_stats().resident_bytes
    report = two.sleep(level=1)
    assert report.num_bytes == sum(awake.values()) > two.runner._resident_bytes("weights") * 2
    with pytest.raises(RuntimeError, match="asleep"):
        two.generate(PROMPTS, GREEDY)
    two.wake_up()
    assert _tokens(two.generate(PROMPTS, GREEDY)) == before
    two.sleep(level=2)
    two.wake_up()
    two.reload_weights()
    assert _tokens(two.generate(PROMPTS, GREEDY)) == before


def test_four_ranks_batch_invariant_row_alone_equals_row_in_a_batch_of_64(tmp_path, tokenizer):
    model = save_tiny("qwen2", tmp_path / "tp4", tokenizer, **TP4_SHAPE)
    engine = make_engine(model, quantization="fp8", kv_cache_dtype="fp8_e4m3", batch_invariant=True,
                         num_kv_blocks=256, tensor_parallel_size=4)
    try:
        assert engine.runner.kernel_names["tensor_parallel"] == "4 ranks, fixed-order all-reduce"
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
        alone = engine.generate([PROMPTS[0]], params)[0].outputs[0]
        crowd = [[(i * 37 + j) % 3000 + 5 for j in range(3 + i % 9)] for i in range(63)]
        batch = engine.generate(crowd[:31] + [PROMPTS[0]] + crowd[31:], params)[31].outputs[0]
        assert batch.token_ids == alone.token_ids
        assert batch.logprobs == alone.logprobs
    finally:
        engine.shutdown()


def _sums(rank: int, port: int, size: int, out) -> None:
    torch.set_num_threads(1)
    group = init_process_group("127.0.0.1", port, rank, size, "tp-test")
    y = torch.randn(64, 512, generator=torch.Generator().manual_seed(100 + rank))
    diffs = [int((fn(y[:1].clone())[0] != fn(y.clone())[0]).sum())
             for fn in (lambda t: library_sum(group, t), lambda t: fixed_order_sum(group, size, t))]
    if rank == 0:
        out.put(diffs)
    torch.distributed.barrier(group=group)  # no rank leaves while another still talks to it
    torch.distributed.destroy_process_group(group)


def test_library_all_reduce_depends_on_the_batch_and_the_fixed_order_does_not():
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_sums, args=(free_port(), 4, out), nprocs=4)
    library, fixed = out.get()
    assert library > 0 and fixed == 0  # row 0's sums: alone vs the first of 64 rows


@pytest.fixture()
def doomed(tp2_dir):
    engine = make_engine(tp2_dir, num_kv_blocks=64, tensor_parallel_size=2)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("arch, quantization, order", [("qwen2", None, "library"), ("qwen2", "fp8", "fixed"),
                                                       ("qwen3_5", "fp8", "library")])
def test_every_rank_runs_the_cpp_decoder_plan_bit_for_bit_the_python_layers(tp2_dir, tmp_path, tokenizer, monkeypatch,
                                                                            arch, quantization, order):
    """Each rank runs its shard's layers as one C++ call (csrc/decoder.cpp; a hybrid's decode steps through
    csrc/hybrid_decoder.cpp), the row-parallel projections' partial sums (o_proj, down_proj, a GDN layer's out_proj)
    added over the ranks inside it by torch's functional collectives on the group (gloo's all-reduce, or gathered and
    added in rank order): tokens and logprobs bit for bit those of the ranks' Python layers (FP8ENGINE_FUSED_DECODER=
    0), BF16 and FP8; the plan's collective time counts in the group's."""
    model = tp2_dir if arch == "qwen2" else save_tiny(arch, tmp_path / arch, tokenizer, **HYBRID_TP2)
    plan_name = "cpp-plan" if arch == "qwen2" else "cpp-plan-decode"
    monkeypatch.setenv("FP8ENGINE_TP_ALL_REDUCE", order)
    outs, decoders = [], []
    for plan in ("1", "0"):
        monkeypatch.setenv("FP8ENGINE_FUSED_DECODER", plan)
        engine = make_engine(model, quantization=quantization, num_kv_blocks=64, tensor_parallel_size=2)
        try:
            outs.append([(c.token_ids, c.logprobs) for o in engine.generate(PROMPTS, GREEDY) for c in o.outputs])
            decoders.append([engine.runner.kernel_names["decoder"], *engine.runner.tp_leader.call("decoder")])
            assert engine.runner.tp.seconds > 0
        finally:
            engine.shutdown()
    assert decoders == [[plan_name, plan_name], ["python", "python"]]
    assert outs[0] == outs[1]


def test_killed_rank_fails_the_call_in_progress_and_every_later_one(doomed):
    proc = doomed.runner.tp_leader.procs[0]
    threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)  # runs for seconds
    with pytest.raises(RuntimeError, match=r"rank 1 exited with status -9 \(SIGKILL\)"):
        doomed.generate(PROMPTS, long)
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        doomed.generate(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        doomed.update_weights({})
    assert proc.poll() is not None


def test_a_worker_that_dies_while_rank_0_waits_on_the_device_fails_the_step_within_seconds(doomed, monkeypatch):
    """The NCCL case, played on gloo: rank 0's forward has ended (its collectives enqueued) and it waits for its
    device when rank 1 dies; such a wait ends only when the watcher, seeing the exit, aborts the device group. The
    step then fails naming the rank and its status (its logits never reach the sampler), within seconds, and so does
    every later call; the group aborted is the device group (on CUDA the forward's NCCL one), nothing else."""
    from fp8engine.model_executor import tensor_parallel
    leader = doomed.runner.tp_leader
    proc, aborted, device_group = leader.procs[0], [], object()  # on CPU both groups are one: a stand-in
    monkeypatch.setattr(leader.group, "device_group", device_group)
    monkeypatch.setattr(tensor_parallel, "_abort", aborted.append)
    waits = []

    def hung_sync():  # as a device sync behind an NCCL collective whose peer is gone: only the abort ends it
        if len(waits) == 1:
            os.kill(proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10  # (a test without the watcher fails, not hangs)
            while not aborted and time.monotonic() < deadline:
                time.sleep(0.01)
        waits.append(time.monotonic())
    leader.device_sync = hung_sync
    doomed.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    [first] = doomed.step()  # the prefill step: its wait ended, its token drawn
    assert len(waits) == 1 and len(first.outputs[0].token_ids) == 1
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 exited with status -9 \(SIGKILL\)"):
        doomed.step()
    assert time.monotonic() - start < 5 and aborted == [device_group] and len(waits) == 2
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        doomed.generate(PROMPTS, GREEDY)


def test_the_watcher_ends_with_the_engine_and_keeps_nothing_alive(tp2_dir, monkeypatch):
    """A shut-down engine's watcher thread ends (its workers were stopped on purpose: no abort, nothing lost), and
    an engine dropped without shutdown is collected (the watcher holds no reference to it) and its workers stop."""
    import gc
    import weakref
    from fp8engine.model_executor import tensor_parallel
    aborted = []
    monkeypatch.setattr(tensor_parallel, "_abort", aborted.append)
    before = set(threading.enumerate())  # (other tests' engines may be alive, with their own watchers)
    engine = make_engine(tp2_dir, num_kv_blocks=16, tensor_parallel_size=2)
    leader = engine.runner.tp_leader
    watchers = [t for t in set(threading.enumerate()) - before if t.name == "fp8engine-tp-watch"]
    assert len(watchers) == 1
    engine.shutdown()
    watchers[0].join(timeout=2)
    assert not watchers[0].is_alive() and not leader.lost and aborted == []
    del leader
    engine = make_engine(tp2_dir, num_kv_blocks=16, tensor_parallel_size=2)
    leader, procs = weakref.ref(engine.runner.tp_leader), list(engine.runner.tp_leader.procs)
    del engine
    gc.collect()
    assert leader() is None
    assert all(p.wait(timeout=10) is not None for p in procs)


def test_a_rank_exception_reaches_the_caller(doomed):
    with pytest.raises(RuntimeError, match="(?s)rank 1 exited with status 1: Traceback.*AttributeError"):
        doomed.runner.tp_leader.call("no_such_op")
    assert all(p.poll() is not None for p in doomed.runner.tp_leader.procs)


WORKERS_OF_A_DEAD_PARENT = """
import sys
from fp8engine import EngineConfig, LLMEngine
engine = LLMEngine(EngineConfig(model=sys.argv[1], num_kv_blocks=16, tensor_parallel_size=2))
print(*[p.pid for p in engine.runner.tp_leader.procs], flush=True)
sys.stdin.read()
"""


def test_workers_exit_when_the_engine_process_dies(tp2_dir):
    parent = subprocess.Popen([sys.executable, "-c", WORKERS_OF_A_DEAD_PARENT, tp2_dir], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 1
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pids[0]):
        time.sleep(0.1)
    assert not _alive(pids[0])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=2), r"tensor_parallel_size=2 does not divide num_attention_heads=9: "
                                   r"model\.layers\.\*\.self_attn\.qkv_proj"),
    (dict(tensor_parallel_size=3, quantization="fp8"), r"model\.layers\.\*\.self_attn\.o_proj has 576 inputs, 192 per "
                                                       r"rank, not whole 128-wide FP8 blocks"),
])
def test_a_shape_the_ranks_cannot_split_names_the_layer(options, message):
    with pytest.raises(ValueError, match=message):
        make_engine(**options)


def test_the_vocabulary_splits_in_whole_blocks_and_every_rank_gets_rows():
    from transformers import Qwen2Config
    assert [vocab_rows(151936, 8, r) for r in (0, 1, 7)] == [(0, 19072), (19072, 38144), (133504, 151936)]
    assert [vocab_rows(49152, 2, r) for r in (0, 1)] == [(0, 24576), (24576, 49152)]
    cfg = Qwen2Config(vocab_size=300, **TP2_SHAPE)
    check_shardable(cfg, 2, fp8=True, expert_parallel=False)  # 256 + 44 rows
    with pytest.raises(ValueError, match="tensor_parallel_size=4 with vocab_size=300: lm_head splits the vocabulary "
                                         "in whole 128-row blocks, 128 a rank, and rank 3 would hold none"):
        check_shardable(Qwen2Config(vocab_size=300, **TP4_SHAPE), 4, fp8=False, expert_parallel=False)


def test_a_model_type_not_sharded_yet_is_named():
    """Every type the registry loads is sharded; a new one must be sharded before a replica can split it."""
    from transformers import OlmoeConfig
    assert set(MODEL_REGISTRY) - set(MODEL_TYPES) == {"qwen3_5", "qwen3_5_moe"}  # these load as their text configs
    with pytest.raises(ValueError, match=r"model_type 'olmoe' is not sharded yet \(tensor parallelism covers "
                                         r"\['llama', 'qwen2', 'qwen3', 'qwen3_moe', 'qwen3_5_text', "
                                         r"'qwen3_5_moe_text', 'qwen3_next'\]"):
        check_shardable(OlmoeConfig(), 2, fp8=False, expert_parallel=False)


def test_ranks_that_would_share_cores_are_told_how_many_threads_to_take():
    assert oversubscribed(1, 2, cores=2) is None
    assert oversubscribed(2, 2, cores=2) == ("tensor_parallel_size=2: 2 ranks x 2 threads on 2 cores; ranks that share "
                                             "cores stall each other in every all-reduce: torch.set_num_threads(1) "
                                             "before the engine starts gives each rank its own (the workers take "
                                             "rank 0's count)")


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer, got 0"),
    (dict(tensor_parallel_size=2, device="cpu", batch_invariant=True, dtype="float32"), "batch_invariant=True needs"),
])
def test_options_it_cannot_honour_are_refused(options, message):
    from fp8engine import EngineConfig
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_a_replica_asks_ray_for_a_gpu_a_rank_on_cuda():
    from types import SimpleNamespace

    from fp8engine.rl.cluster import replica_resources
    cuda = SimpleNamespace(device="cuda", tensor_parallel_size=4)  # an EngineConfig("cuda") needs a device here
    assert replica_resources(cuda, 8) == {"num_cpus": 1, "num_gpus": 4}
    assert replica_resources(SimpleNamespace(device="cpu", tensor_parallel_size=2), 8) == {"num_cpus": 8,
                                                                                            "num_gpus": 0}


def test_a_cluster_replica_of_two_ranks_rolls_out_and_syncs_every_rank(tp2_dir):
    """RolloutCluster: one replica of 2 ranks on 2 Ray CPUs (1 thread a rank), synced over the weight-update group
    (world size 3: this process, the replica's rank 0 at 1, its worker at 2); float32 rollouts equal a local
    T = 1 engine's before and after the sync."""
    ray = pytest.importorskip("ray")
    from fp8engine.rl import RolloutCluster
    config = dict(model=tp2_dir, dtype="float32", num_kv_blocks=32)
    local = make_engine(**config)
    state = perturbed_state(tp2_dir, seed=9)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        from fp8engine import EngineConfig
        cluster = RolloutCluster(EngineConfig(**config, tensor_parallel_size=2), num_replicas=1,
                                 num_cpus_per_replica=2, sync_method="distributed")
        try:
            for step in range(2):
                batch = cluster.rollout(PROMPTS, n=1, sampling_params=GREEDY)
                expected = _tokens(local.generate(PROMPTS, GREEDY))
                assert [row[mask.bool()].tolist() for row, mask in zip(batch.response_ids, batch.response_mask)] \
                    == [t[0] for t in expected]
                if step == 0:
                    cluster.sync_weights(state, weight_version=1)
                    local.update_weights(state)
            assert cluster.get_stats().weight_version == 1
        finally:
            cluster.shutdown()
    finally:
        ray.shutdown()


def test_the_server_runs_a_replica_of_two_ranks(fp32_pair, tp2_dir):
    """`fp8engine serve --tensor-parallel-size 2`: its completions are the T = 1 engine's (float32), its metrics come
    from rank 0 (no round trip to the workers), and stopping it stops its worker."""
    import httpx
    from fp8engine.bench.serve_load import server_process
    flags = ["--model", tp2_dir, "--dtype", "float32", "--num-kv-blocks", "32", "--tensor-parallel-size", "2"]
    expected = _tokens(fp32_pair[0].generate(PROMPTS[:2], GREEDY))
    with server_process(flags) as (url, server):
        workers = [p for p in _children(server.pid) if "tp_worker" in _cmdline(p)]
        assert len(workers) == 1
        for prompt, tokens in zip(PROMPTS[:2], expected):
            body = httpx.post(f"{url}/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 10,
                                                              "temperature": 0.0, "return_token_ids": True},
                              timeout=120).json()
            assert body["choices"][0]["token_ids"] == tokens[0]
        assert "fp8engine_num_preemptions_total" in httpx.get(f"{url}/metrics", timeout=60).text
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(workers[0]):
        time.sleep(0.1)
    assert not _alive(workers[0])


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()
