"""Trainer adapter: logprob semantics aligned with the trainer, weight sync, batch layout, GRPO example."""

import dataclasses
import json
import math
import queue
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fp8engine import EngineConfig, SamplingParams
from fp8engine.outputs import RequestOutput
from fp8engine.rl import RolloutBatch, RolloutClient, RolloutEngine, response_logprobs
from fp8engine.rl.batch import Sample, collate, micro_batches
from fp8engine.rl.sync import buckets, named_tensors, synced_dtype
from tests.checkpoints import perturbed_state, prequantized_items

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPTS = [[{"role": "user", "content": "Name a color."}], "The capital of France is",
           [1, 504, 3458, 282, 6687, 314]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SMALL_KV = 64 << 20
API_KEY = "rl-key"
FP32 = dict(dtype="float32", kv_cache_memory_bytes=SMALL_KV)

# Measured on this CPU (BF16 engine vs float32 trainer, processed logprobs at T=0.7, top_p=0.9,
# 3 prompts x n=3 x 16 tokens, seeds 0-3): |diff| mean 0.036-0.040, max 0.196; a trainer using
# plain log_softmax without temperature: mean 0.42-0.44; 0-1 of ~140 tokens at the top-p
# boundary kept by the engine and cut by the trainer. Bounds leave about 2x headroom.
ALIGNED_MEAN, ALIGNED_MAX, MAX_BOUNDARY_TOKENS = 0.08, 0.4, 2


def hf_policy(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def bf16_rollouts() -> RolloutEngine:
    """Prefix caching off, so that a rerun of the same prompts is computed the same way."""
    return RolloutEngine(EngineConfig(dtype="bfloat16", kv_cache_memory_bytes=SMALL_KV,
                                      enable_prefix_caching=False))


def test_processed_logprobs_match_trainer_helper(bf16_rollouts, default_dir):
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, seed=3)
    batch = bf16_rollouts.rollout(PROMPTS, n=3, sampling_params=params)
    policy = hf_policy(default_dir)
    with torch.no_grad():
        aligned = response_logprobs(policy, batch, params)
        plain = response_logprobs(policy, batch, SamplingParams(logprobs_mode="raw"))
    real = batch.response_mask.bool()
    # A token at the top-p boundary may be kept by the BF16 engine and cut by the FP32 trainer.
    boundary = real & aligned.isinf()
    compared = real & ~boundary
    diff = (aligned - batch.rollout_logprobs)[compared].abs()
    plain_diff = (plain - batch.rollout_logprobs)[compared].abs()
    print(f"{int(compared.sum())} tokens: aligned mean {diff.mean():.4f} max {diff.max():.4f}; plain "
          f"log_softmax mean {plain_diff.mean():.4f} max {plain_diff.max():.4f}; "
          f"{int(boundary.sum())} cut by the trainer's top-p")
    assert boundary.sum() <= MAX_BOUNDARY_TOKENS
    assert diff.mean() < ALIGNED_MEAN and diff.max() < ALIGNED_MAX
    assert plain_diff.mean() > 5 * diff.mean()
    assert (aligned[~real] == 0).all()


def test_response_logprobs_and_their_gradient_equal_a_direct_computation(bf16_rollouts, default_dir):
    """Against the same loss computed row by row, without padding, from the model's logits."""
    params = SamplingParams(temperature=0.8, max_tokens=4, seed=0)
    batch = bf16_rollouts.rollout(PROMPTS[1:], n=1, sampling_params=params)
    policy = hf_policy(default_dir)
    weight = policy.get_parameter("model.layers.0.mlp.down_proj.weight")
    got = response_logprobs(policy, batch, params)
    (grad,) = torch.autograd.grad(got.sum(), weight)

    width = batch.prompt_ids.shape[1]
    prompt_lens = batch.attention_mask[:, :width].sum(1).tolist()
    assert len(set(prompt_lens)) == 2  # one prompt is left-padded
    direct = []
    for row, prompt_len in enumerate(prompt_lens):
        prompt = batch.prompt_ids[row, width - prompt_len:]
        response = batch.response_ids[row, :batch.response_lengths[row]]
        logits = policy(input_ids=torch.cat([prompt, response])[None]).logits[0, prompt_len - 1:-1]
        direct.append(torch.log_softmax(logits / params.temperature, -1).gather(-1, response[:, None])[:, 0])
    (direct_grad,) = torch.autograd.grad(sum(d.sum() for d in direct), weight)

    for row, values in enumerate(direct):
        assert got[row, :len(values)].tolist() == pytest.approx(values.tolist(), abs=1e-4)
        assert (got[row, len(values):] == 0).all()
        assert (values - batch.rollout_logprobs[row, :len(values)]).abs().max() < ALIGNED_MAX
    assert direct_grad.abs().max() > 1e-3
    assert torch.allclose(grad, direct_grad, rtol=1e-3, atol=1e-4 * direct_grad.abs().max().item())


@pytest.fixture(scope="module")
def fp32_rollouts() -> RolloutEngine:
    return RolloutEngine(EngineConfig(**FP32), bucket_bytes=64 << 20)


def test_sync_after_optimizer_step_equals_fresh_engine(fp32_rollouts, default_dir, tmp_path):
    rollouts = fp32_rollouts
    before = rollouts.rollout(PROMPTS, sampling_params=GREEDY).response_ids
    policy = hf_policy(default_dir)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    text = torch.tensor([[1, 504, 3458, 282, 6687, 314, 9690, 30]])
    policy(input_ids=text, labels=text).loss.backward()
    optimizer.step()

    report = rollouts.sync_weights(policy, weight_version=1)
    synced = rollouts.rollout(PROMPTS, sampling_params=GREEDY)
    policy.save_pretrained(tmp_path)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(default_dir) / name, tmp_path / name)
    fresh = RolloutEngine(EngineConfig(model=str(tmp_path), **FP32))

    num_params = sum(p.numel() for p in policy.parameters())
    assert report.num_tensors == len(policy.state_dict()) - 1  # the tied lm_head is skipped
    assert report.num_bytes == 4 * num_params
    assert report.num_buckets == 8  # 513 MiB in 64 MiB buckets; the 108 MiB embedding is one alone
    assert synced.weight_version == 1
    assert not torch.equal(synced.response_ids, before)
    assert torch.equal(synced.response_ids, fresh.rollout(PROMPTS, sampling_params=GREEDY).response_ids)
    q_proj = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(rollouts.engine.get_weights_by_name(q_proj), policy.get_parameter(q_proj))


def test_named_tensors_unwraps_and_skips_the_tied_head():
    embed = torch.ones(4, 2)
    wrapped = {"module._orig_mod.model.embed_tokens.weight": embed, "module.lm_head.weight": embed,
               "model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight": torch.zeros(3, 2)}
    assert [name for name, _ in named_tensors(wrapped)] == [
        "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
    untied = {"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()}
    assert [name for name, _ in named_tensors(untied)] == list(untied)
    ddp_like = torch.nn.Module()
    ddp_like.module = torch.nn.Sequential(torch.nn.Linear(2, 3))
    assert [name for name, _ in named_tensors(ddp_like)] == ["0.weight", "0.bias"]


def test_buckets_respect_the_byte_size_and_cast():
    items = [(f"w{i}", torch.ones(10, dtype=torch.float32)) for i in range(5)]
    items.append(("steps", torch.tensor([3], dtype=torch.int64)))
    out = list(buckets(items, bucket_bytes=45, dtype=torch.bfloat16))
    assert [[name for name, _ in b] for b in out] == [["w0", "w1"], ["w2", "w3"], ["w4", "steps"]]
    assert out[0][0][1].dtype == torch.bfloat16 and out[2][1][1].dtype == torch.int64


def test_a_sync_casts_floats_but_not_fp8_codes_or_scales():
    codes = torch.tensor([[0x38, 0xB8]], dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1.0, -1.0
    scales = torch.tensor([[1 / 3]], dtype=torch.float32)
    items = [("model.layers.0.mlp.up_proj.weight", codes), ("model.layers.0.mlp.up_proj.weight_scale_inv", scales),
             ("model.layers.0.self_attn.k_scale", torch.tensor(0.1)), ("model.norm.weight", torch.ones(2)),
             ("steps", torch.tensor([3]))]
    (out,) = buckets(items, bucket_bytes=1 << 20, dtype=torch.bfloat16, device=None)
    assert [t.dtype for _, t in out] == [torch.float8_e4m3fn, torch.float32, torch.float32, torch.bfloat16,
                                         torch.int64]
    assert [synced_dtype(name, t, torch.bfloat16) for name, t in items] == [t.dtype for _, t in out]
    assert torch.equal(out[0][1].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(out[1][1], scales)
    assert [t.dtype for _, t in next(buckets(items, 1 << 20, None))] == [t.dtype for _, t in items]


def test_a_pre_quantized_fp8_state_syncs_as_it_is_with_a_sync_dtype(tiny_qwen3_dir):
    """A trainer that holds its weights as FP8 (E4M3 codes + float32 block scales) syncs them with the default
    sync dtype: they arrive as they are, as a direct update_weights copies them (cast to bfloat16 the codes read as
    their unscaled values and the update was refused: a `_scale_inv` without its float8 weight)."""
    items = prequantized_items(perturbed_state(tiny_qwen3_dir, seed=3))
    config = EngineConfig(model=tiny_qwen3_dir, quantization="fp8", kv_cache_memory_bytes=SMALL_KV)
    synced, direct = RolloutEngine(config, sync_dtype=torch.bfloat16), RolloutEngine(config)
    report = synced.sync_weights(dict(items), weight_version=1)
    direct.engine.update_weights(items)
    assert report.num_tensors == len(items) == 2 * (7 * 2 + 4) + 3  # 2 layers of 7 pre-quantized projections
    assert report.num_bytes == sum(t.nbytes for _, t in items)  # every tensor in its own dtype: none is float32
    ours, theirs = dict(synced.engine.named_parameters()), dict(direct.engine.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert torch.equal(param.reshape(-1).view(torch.uint8), theirs[name].reshape(-1).view(torch.uint8)), name


def test_collate_pads_exactly():
    samples = [Sample([5, 6, 7], [1, 2], [-0.5, -1.0], [-0.1, 0.0], "length", 1, 4, "ab"),
               Sample([5, 6, 7], [3], [-2.0], [-0.2], "stop", 0, 4, "c"),
               Sample([8], [4, 5, 6], [-0.1, -0.2, -0.3], [0.0, 0.0, 0.0], "length", 2, 4, "def"),
               Sample([8], [], [], [], "abort", 0, 4, "")]
    batch = collate(samples, n=2, pad_token_id=0)
    assert batch.prompt_ids.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 8], [0, 0, 8]]
    assert batch.response_ids.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6], [0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0],
                                             [0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]]
    assert batch.position_ids[2].tolist() == [0, 0, 0, 1, 2, 3]
    assert batch.rollout_logprobs.tolist() == [[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0],
                                               pytest.approx([-0.1, -0.2, -0.3]), [0.0, 0.0, 0.0]]
    assert batch.log_kept_mass[1].tolist() == pytest.approx([-0.2, 0.0, 0.0])
    assert batch.num_preemptions.tolist() == [1, 0, 2, 0] and batch.weight_version == 4
    assert batch.response_lengths.tolist() == [2, 1, 3, 0]
    assert batch.finish_reasons == ["length", "stop", "length", "abort"]


def _four_samples():
    return [Sample([5, 6, 7], [1, 2], [-0.5, -1.0], [-0.1, 0.0], "length", 1, 4, "ab"),
            Sample([5, 6, 7], [3], [-2.0], [-0.2], "stop", 0, 4, "c"),
            Sample([8], [4, 5, 6], [-0.1, -0.2, -0.3], [0.0, 0.0, 0.0], "length", 2, 4, "def"),
            Sample([8], [], [], [], "abort", 0, 4, "")]


def test_select_keeps_whole_groups_and_trims_padding():
    batch = collate(_four_samples(), n=2, pad_token_id=0)
    batch.group_prompts = ["p0", "p1"]
    second = batch.select([2, 3])  # the second group alone: the first group's longer prompt padding goes
    assert second.n == 2 and second.group_prompts == ["p1"]
    assert second.prompt_ids.tolist() == [[8], [8]] and second.response_ids.tolist() == [[4, 5, 6], [0, 0, 0]]
    assert second.attention_mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert second.token_weight_versions.tolist() == [[4, 4, 4], [-1, -1, -1]]
    rows = batch.select([1, 2])  # not whole groups: n=1, each row's own prompt
    assert rows.n == 1 and rows.group_prompts == ["p0", "p1"] and rows.finish_reasons == ["stop", "length"]
    assert rows.prompt_ids.tolist() == [[5, 6, 7], [0, 0, 8]] and rows.response_ids.tolist() == [[3, 0, 0], [4, 5, 6]]
    assert rows.rollout_logprobs.tolist() == [[-2.0, 0.0, 0.0], pytest.approx([-0.1, -0.2, -0.3])]
    assert rows.log_kept_mass.tolist()[0] == pytest.approx([-0.2, 0.0, 0.0])
    assert rows.num_preemptions.tolist() == [0, 2]
    first = batch.select([0])
    assert first.response_ids.tolist() == [[1, 2]] and first.attention_mask.tolist() == [[1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 4\); got \[0, 4\]"):
        batch.select([0, 4])


def test_micro_batches_group_rows_by_length_within_the_budget():
    batch = collate(_four_samples(), n=2, pad_token_id=0)
    parts = [(rows.tolist(), part.input_ids.shape) for rows, part in micro_batches(batch, max_tokens=8)]
    # longest response first; a part holds rows x (longest prompt + longest response) <= 8 positions
    assert parts == [([2], (1, 4)), ([0], (1, 5)), ([1, 3], (2, 4))]
    assert [rows.tolist() for rows, _ in micro_batches(batch, 100, rows=[3, 0])] == [[0, 3]]
    assert [rows.tolist() for rows, _ in micro_batches(batch, 1)] == [[2], [0], [1], [3]]  # too long: alone
    with pytest.raises(ValueError, match="max_tokens must be >= 1; got 0"):
        next(micro_batches(batch, 0))


def test_micro_batched_loss_gradient_equals_the_whole_batch(bf16_rollouts, default_dir):
    """Summing the loss over micro-batches (gradients accumulated) gives the whole batch's gradient."""
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
    batch = bf16_rollouts.rollout(PROMPTS[:2], n=3, sampling_params=params)
    policy = hf_policy(default_dir)
    weight = policy.model.layers[0].mlp.down_proj.weight
    advantages = torch.linspace(-1.0, 1.0, batch.batch_size)
    (advantages[:, None] * response_logprobs(policy, batch, params)).sum().backward()
    whole = weight.grad.clone()
    policy.zero_grad()
    for rows, part in micro_batches(batch, max_tokens=24):
        (advantages[rows, None] * response_logprobs(policy, part, params)).sum().backward()
    assert len(list(micro_batches(batch, max_tokens=24))) > 1
    # the same sums over other float32 shapes: equal up to summation order (1e-6-1e-5 on AVX-512 machines, 7.6e-5
    # once on an AVX2-only Zen 3 with 2 threads, where torch's CPU GEMM blocks the shapes otherwise)
    assert float((weight.grad - whole).norm() / whole.norm()) < 3e-4 and float(whole.norm()) > 0


def test_rollout_batch_is_prompt_major_and_padded(bf16_rollouts):
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=11, logprobs=0)
    batch = bf16_rollouts.rollout(PROMPTS, n=2, sampling_params=params)
    outs = bf16_rollouts.engine.generate(PROMPTS, dataclasses.replace(params, n=2))
    assert isinstance(batch, RolloutBatch) and batch.batch_size == 6 and batch.n == 2
    width = batch.prompt_ids.shape[1]
    for row, (out, sample) in enumerate((o, c) for o in outs for c in o.outputs):
        plen, rlen = len(out.prompt_token_ids), len(sample.token_ids)
        assert batch.prompt_ids[row, width - plen:].tolist() == out.prompt_token_ids
        assert (batch.prompt_ids[row, :width - plen] == batch.pad_token_id).all()
        assert batch.response_ids[row, :rlen].tolist() == sample.token_ids
        assert batch.response_mask[row].sum() == rlen and batch.attention_mask[row].sum() == plen + rlen
        assert batch.rollout_logprobs[row, :rlen].tolist() == pytest.approx(sample.logprobs)
        assert (batch.rollout_logprobs[row, rlen:] == 0).all()
        assert batch.finish_reasons[row] == sample.finish_reason
    assert batch.rollout_logprobs.dtype == torch.float32
    assert batch.stats["num_tokens"] == batch.response_mask.sum() and batch.stats["tokens_per_s"] > 0
    assert batch.stats["preemptions_total"] == 0 and batch.stats["kv_blocks_total"] > 0


def test_rollout_rejects_bad_arguments(bf16_rollouts):
    with pytest.raises(ValueError, match="prompts"):
        bf16_rollouts.rollout("a bare string", n=2)
    with pytest.raises(ValueError, match="n must be"):
        bf16_rollouts.rollout(PROMPTS, n=0)
    with pytest.raises(ValueError, match="conflicts"):
        bf16_rollouts.rollout(PROMPTS, n=2, sampling_params=SamplingParams(n=3))
    with pytest.raises(ValueError, match="weight_version"):
        bf16_rollouts.sync_weights({}, weight_version=-1)


def test_pause_blocks_rollouts_until_resume(bf16_rollouts):
    bf16_rollouts.engine.add_request("Hello", SamplingParams(max_tokens=4))
    bf16_rollouts.pause("abort")
    assert not bf16_rollouts.engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="paused"):
        bf16_rollouts.rollout(PROMPTS)
    bf16_rollouts.resume()
    assert bf16_rollouts.rollout(PROMPTS[:1], sampling_params=GREEDY).batch_size == 1


def test_sleep_blocks_rollouts_until_wake_up(bf16_rollouts):
    before = bf16_rollouts.rollout(PROMPTS[:1], sampling_params=GREEDY).response_ids
    report = bf16_rollouts.sleep(1, ["kv_cache"])
    assert report.tags == ["kv_cache"] and bf16_rollouts.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep: kv_cache"):
        bf16_rollouts.rollout(PROMPTS[:1], sampling_params=GREEDY)
    assert bf16_rollouts.wake_up().tags == ["kv_cache"] and not bf16_rollouts.is_sleeping()
    assert torch.equal(bf16_rollouts.rollout(PROMPTS[:1], sampling_params=GREEDY).response_ids, before)


PAUSED_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)


def _start(engine, steps: int) -> tuple[list[str], dict[str, RequestOutput]]:
    """PROMPTS[1:] added to the engine directly and stepped `steps` times; their latest outputs."""
    ids = [engine.add_request(p, PAUSED_PARAMS) for p in PROMPTS[1:]]
    latest = {}
    for _ in range(steps):
        latest |= {o.request_id: o for o in engine.step() if o.request_id in ids}
    return ids, latest


def _finish(engine, ids: list[str]) -> list[RequestOutput]:
    """Step until every request in `ids` has returned its final output."""
    finished = {}
    while finished.keys() < set(ids):
        outputs = engine.step()
        finished |= {o.request_id: o for o in outputs if o.finished and o.request_id in ids}
        if not outputs and not engine.has_unfinished_requests() and finished.keys() < set(ids):
            raise AssertionError(f"requests {sorted(set(ids) - finished.keys())} ended without a final output")
    return [finished[i] for i in ids]


def _samples(outputs: list[RequestOutput]) -> list[tuple[list[int], list[float], str]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason) for o in outputs]


def test_pause_wait_finishes_in_flight_requests_before_returning(bf16_rollouts):
    engine = bf16_rollouts.engine
    unpaused = _samples(_finish(engine, _start(engine, 0)[0]))
    ids, latest = _start(engine, 3)
    assert all(1 <= len(latest[i].outputs[0].token_ids) < 16 for i in ids)  # in flight
    tokens = engine.get_stats().num_generation_tokens_total
    bf16_rollouts.pause("wait")
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_generation_tokens_total == tokens + sum(16 - len(latest[i].outputs[0].token_ids)
                                                                          for i in ids)
    with pytest.raises(RuntimeError, match="paused"):
        bf16_rollouts.rollout(PROMPTS[:1], sampling_params=GREEDY)
    assert _samples(_finish(engine, ids)) == unpaused  # their final outputs come from the next step()
    bf16_rollouts.resume()
    assert bf16_rollouts.rollout(PROMPTS[:1], sampling_params=GREEDY).response_lengths.tolist() == [10]


def test_pause_keep_holds_in_flight_requests_until_resume(bf16_rollouts):
    engine = bf16_rollouts.engine
    unpaused = _samples(_finish(engine, _start(engine, 0)[0]))
    ids, latest = _start(engine, 3)
    bf16_rollouts.pause("keep")
    stats = engine.get_stats()
    assert stats.num_running + stats.num_waiting == 2 and set(engine.requests) == set(ids)
    with pytest.raises(RuntimeError, match="paused"):
        bf16_rollouts.rollout(PROMPTS[:1], sampling_params=GREEDY)
    assert engine.get_stats().num_generation_tokens_total == stats.num_generation_tokens_total
    bf16_rollouts.resume()
    resumed = _samples(_finish(engine, ids))
    assert resumed == unpaused
    assert all(r[0][:len(latest[i].outputs[0].token_ids)] == latest[i].outputs[0].token_ids
               for r, i in zip(resumed, ids))
    assert engine.get_stats().num_generation_tokens_total == stats.num_generation_tokens_total + sum(
        16 - len(latest[i].outputs[0].token_ids) for i in ids)


@pytest.fixture(scope="module")
def server_url():
    pytest.importorskip("fp8engine.entrypoints.server")
    from fp8engine.bench.serve_load import serving
    flags = ["--api-key", API_KEY, "--dtype", "float32", "--kv-cache-memory-bytes", str(SMALL_KV)]
    with serving(flags, startup_timeout=600) as url:  # waits on /health; fails with the server's log
        yield url


def test_client_sleeps_and_wakes_the_server(server_url):
    client = RolloutClient(server_url, api_key=API_KEY)
    assert client.sleep(1, ["kv_cache"]).tags == ["kv_cache"] and client.is_sleeping()
    with pytest.raises(RuntimeError, match="503.*asleep"):
        client.rollout(PROMPTS[:1], sampling_params=GREEDY)
    assert client.wake_up(["kv_cache"]).tags == ["kv_cache"] and not client.is_sleeping()
    assert client.rollout(PROMPTS[:1], sampling_params=GREEDY).batch_size == 1


def test_client_equals_in_process_engine(server_url, fp32_rollouts, default_dir):
    client = RolloutClient(server_url, api_key=API_KEY, bucket_bytes=64 << 20, sync_dtype=None)
    policy = hf_policy(default_dir)
    remote_sync = client.sync_weights(policy, weight_version=5)
    local_sync = fp32_rollouts.sync_weights(policy, weight_version=5)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, seed=5)
    remote = client.rollout(PROMPTS, n=2, sampling_params=params)
    local = fp32_rollouts.rollout(PROMPTS, n=2, sampling_params=params)

    assert (remote_sync.num_tensors, remote_sync.num_bytes, remote_sync.num_buckets) == (
        local_sync.num_tensors, local_sync.num_bytes, local_sync.num_buckets)
    assert remote.weight_version == 5 == client.get_stats().weight_version
    for name in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "num_preemptions"):
        assert torch.equal(getattr(remote, name), getattr(local, name)), name
    assert torch.allclose(remote.rollout_logprobs, local.rollout_logprobs, atol=1e-5)
    assert torch.allclose(remote.log_kept_mass, local.log_kept_mass, atol=1e-5)
    assert remote.finish_reasons == local.finish_reasons
    assert remote.response_texts == local.response_texts
    client.pause("abort")
    with pytest.raises(RuntimeError, match="503"):
        client.rollout(PROMPTS[:1])
    client.resume()
    assert client.rollout(PROMPTS[:1], sampling_params=GREEDY).batch_size == 1
    client.close()


def test_grpo_tiny_smoke(tmp_path):
    """2 GRPO steps of 2 prompts x n=2 (examples/grpo_tiny.py --smoke, seed 0): FP8 rollouts of the
    policy, then a policy update, in exact mode (the default): the trainer's logprobs are the engine's
    replay, equal to the rollout's, so every mismatch metric is exactly on-policy. No wall-clock limit: a
    slow machine is not a failure."""
    out = tmp_path / "smoke.json"
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_tiny.py"), "--smoke", "--seed", "0",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    steps, evals = result["steps"], result["evals"]
    assert [s["step"] for s in steps] == [0, 1] and [e["step"] for e in evals] == [0, 2]
    assert result["config"]["label"] == "FP8 rollout, exact"
    for step in steps:
        for key in ("loss", "grad_norm", "k1", "k3", "is_mean", "is_std", "clip_frac", "ess", "sync_seconds",
                    "rollout_seconds", "train_seconds", "rollout_tokens_per_s"):
            assert math.isfinite(step[key]), (key, step[key])
        assert step["reward_mean"] * 4 in (0, 1, 2, 3, 4)  # 4 samples, reward 0 or 1 each
        assert 1 <= step["response_len_mean"] <= 16
        assert step["preemptions_total"] == step["preemptions_max"] == 0  # 4 short samples in 256 MiB
        assert 0 < step["k_scale_mean"] < 1  # recomputed FP8 KV scales, not the default 1.0
        assert 0 <= step["clip_frac"] <= 1 and 0 < step["ess"] <= 1 and step["k3"] >= 0
        if step["reward_mean"] in (0.0, 1.0):  # every group has equal rewards: zero advantages
            assert step["loss"] == 0 and step["grad_norm"] == 0
        assert step["k1"] == step["k3"] == step["clip_frac"] == 0 and step["is_mean"] == step["ess"] == 1
    assert all(e["accuracy"] * 4 in (0, 1, 2, 3, 4) for e in evals)


def test_stochastic_rounding_to_bf16_is_unbiased():
    sys.path.insert(0, str(ROOT / "examples"))
    from grpo_tiny import stochastic_bf16
    lo = torch.tensor(1.0)
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    x = torch.full((20000,), 1.0 + 0.3 * ulp)
    model = torch.nn.Linear(1, 1)
    model.weight = torch.nn.Parameter(x.view(-1, 1).contiguous())
    model.bias = torch.nn.Parameter(torch.tensor([-(1.0 + 0.75 * ulp)]))
    rounded = stochastic_bf16(model, torch.Generator().manual_seed(0))
    w, b = rounded["weight"].float().flatten(), rounded["bias"].float()
    assert set(w.unique().tolist()) == {1.0, 1.0 + ulp}  # only the two neighbours
    assert abs((w == lo + ulp).float().mean().item() - 0.3) < 0.02  # rounded up 30% of the time
    assert b.item() in (-1.0 - ulp, -1.0)  # negative values round in magnitude the same way


def test_client_retries_only_idempotent_calls(tokenizer):
    """GETs that change nothing are retried after a dropped connection or a 503; a rollout is not (it may
    have run), and its error says so."""
    import httpx
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/weight_version":
            if calls.count("/weight_version") == 1:
                raise httpx.ConnectError("connection refused")
            if calls.count("/weight_version") == 2:
                return httpx.Response(503, json={"error": "busy"})
            return httpx.Response(200, json={"weight_version": 7})
        raise httpx.ConnectError("connection reset")

    client = RolloutClient("http://server", tokenizer=tokenizer, retries=3, backoff=0.0)
    client.http = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    assert client.weight_version() == 7 and calls == ["/weight_version"] * 3
    with pytest.raises(RuntimeError, match="POST /v1/completions failed \\(not retried: it is not idempotent\\)"):
        client.rollout(PROMPTS[:1], sampling_params=GREEDY)
    assert calls.count("/v1/completions") == 1
    calls.clear()
    assert client.health() is False and calls == ["/health"] * 4  # 1 + 3 retries
    with pytest.raises(ValueError, match="retries and backoff must be >= 0"):
        RolloutClient("http://server", tokenizer=tokenizer, retries=-1)


def test_client_sends_every_sampling_field(tokenizer):
    """Penalties and logit_bias travel with a rollout (they used to be dropped over HTTP)."""
    import httpx
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(500, json={"error": "stop here"})

    client = RolloutClient("http://server", tokenizer=tokenizer)
    client.http = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    params = SamplingParams(max_tokens=4, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2,
                            logit_bias={17: -5.0})
    with pytest.raises(RuntimeError, match="HTTP 500"):
        client.rollout(PROMPTS[1:2], sampling_params=params)
    body = bodies[0]
    assert (body["presence_penalty"], body["frequency_penalty"], body["repetition_penalty"]) == (0.5, 0.25, 1.2)
    assert body["logit_bias"] == {"17": -5.0} and body["max_tokens"] == 4


def test_async_grpo_smoke(tmp_path):
    """examples/async_grpo.py, 2 asynchronous steps of 2 groups x n=2 (--smoke runs --sync first as well; CI time),
    weights by broadcast: per-step metrics finite, versions at most the loop's bound behind."""
    out = tmp_path / "async.json"
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "async_grpo.py"), "--steps", "2", "--prompts", "2",
                          "--n", "2", "--eval-prompts", "16", "--stop", "paragraph", "--max-tokens", "8",
                          "--trainer-dtype", "bfloat16", "--json", str(out)], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "async: held-out greedy accuracy at step 0" in run.stdout
    result = json.loads(out.read_text())
    assert result["config"]["label"] == "async (in_flight=keep)" and [s["step"] for s in result["steps"]] == [0, 1]
    for step in result["steps"]:
        assert step["tokens"] >= 4 and step["sync_bytes"] == 269_030_016  # the default model in BF16
        assert step["reward_mean"] * 4 in (0, 1, 2, 3, 4)
        # a group whose rewards are all equal has advantage 0 and is not run: k3 over the rows trained
        correct = round(step["reward_mean"] * 4)
        assert step["rows_trained"] in ((0,) if correct in (0, 4) else (2,) if correct in (1, 3) else (0, 4))
        assert math.isnan(step["k3"]) if step["rows_trained"] == 0 else math.isfinite(step["k3"]) and step["k3"] >= 0
        assert 0 <= step["staleness_mean"] <= step["staleness_max"] <= step["step"] + 1
    totals = result["totals"]
    assert 0 <= totals["engine_idle_fraction"] <= 1 and 0 <= totals["trainer_idle_fraction"] <= 1
    assert totals["generated_tokens_per_s"] >= totals["trained_tokens_per_s"] > 0
    assert totals["held_out_accuracy_after"] * 16 == round(totals["held_out_accuracy_after"] * 16)


def test_async_grpo_dynamic_sampling_stops_at_its_cap(monkeypatch):
    """A stream whose groups all have equal rewards does not keep the trainer waiting forever: take() draws at
    most max_groups and hands back the last one (it trains nothing) with every group counted as dropped."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import async_grpo

    streamer = object.__new__(async_grpo.Streamer)
    streamer.groups = queue.Queue()
    for i in range(10):
        streamer.groups.put(f"group {i}")
    kept, dropped = streamer.take(2, lambda group: None, max_groups=6)
    assert (kept, dropped) == (["group 5"], 6) and streamer.groups.qsize() == 4
    kept, dropped = streamer.take(2, lambda group: group if group.endswith(("7", "9")) else None, max_groups=6)
    assert (kept, dropped) == (["group 7", "group 9"], 2) and streamer.groups.qsize() == 0
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "async_grpo.py"), "--max-sampling-rounds", "0"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "--max-sampling-rounds must be at least 1, got 0" in run.stderr
