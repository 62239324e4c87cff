"""TRL's GRPOTrainer on fp8engine rollouts (fp8engine.rl.trl): the rollout function's fields against the
engine, TRL's own importance-sampling correction on the engine's logprobs, a weight sync per step."""

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fp8engine import EngineConfig, SamplingParams  # noqa: E402
from fp8engine.rl import RolloutClient, RolloutEngine  # noqa: E402
from fp8engine.rl.correction import mismatch_metrics  # noqa: E402
from fp8engine.rl.trl import check_trl, generation_params, hf_weights, make_rollout_func  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
SMALL_KV = 64 << 20
FP8 = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", batch_invariant=True, kv_cache_memory_bytes=SMALL_KV)
PROMPTS = ["12+5=", "The capital of France is", "7+8=", "Water boils at", "3+9=", "Name a color:"]
CHAT = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "Name a color."}]]
IS_CLIP = 2.0


@pytest.fixture(scope="module")
def rollouts() -> RolloutEngine:
    return RolloutEngine(EngineConfig(**FP8))


def grpo_config(tmp_path, **overrides) -> GRPOConfig:
    """4 completions per step (2 prompts x 2), 6 tokens each, float32 on the CPU, token-level TIS at C=2."""
    settings = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=6, temperature=1.0, learning_rate=1e-5, lr_scheduler_type="constant",
                    logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                    activation_checkpointing=False, vllm_importance_sampling_mode="token_truncate",
                    vllm_importance_sampling_clip_max=IS_CLIP, seed=0)
    return GRPOConfig(**settings | overrides)


def digit_reward(completions, **_) -> list[float]:
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def make_trainer(default_dir, rollout_func, args: GRPOConfig, reward=digit_reward) -> GRPOTrainer:
    policy = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32)
    return GRPOTrainer(model=policy, reward_funcs=reward, args=args, rollout_func=rollout_func,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}))


def repeated(prompts: list, n: int) -> list:
    """What TRL hands a rollout function: each prompt n times in a row."""
    return [p for p in prompts for _ in range(n)]


def test_trl_is_the_version_and_source_this_module_was_written_against():
    """Fails loudly when TRL changes: the pin, and the private source lines fp8engine.rl.trl relies on."""
    import trl
    assert trl.__version__.startswith("1.16."), trl.__version__
    check_trl()

    class Changed(GRPOTrainer):
        def _generate(self, prompts):
            return super()._generate(prompts)

    with pytest.raises(RuntimeError, match="_generate: 'if self.use_vllm and self.state.global_step"):
        check_trl(Changed)


def test_rollout_func_fields_equal_the_engine(rollouts, default_dir, tmp_path):
    """Batch-invariant FP8 engine, seeded: the rollout function's fields are the engine's own rollout of the
    same prompts with the trainer's sampling settings (T=0.7, processed logprobs), bit for bit."""
    args = grpo_config(tmp_path, temperature=0.7, top_k=0, max_completion_length=8, num_generations=3,
                       per_device_train_batch_size=6)
    func = make_rollout_func(rollouts, SamplingParams(seed=11))
    trainer = make_trainer(default_dir, func, args)
    out = func(repeated(PROMPTS[:2], 3), trainer)

    params = SamplingParams(temperature=0.7, top_k=-1, max_tokens=8, seed=11, logprobs=0)
    tokenizer = trainer.processing_class
    batch = rollouts.rollout([tokenizer(p)["input_ids"] for p in PROMPTS[:2]], n=3, sampling_params=params)
    prompts, responses = batch.prompts_and_responses()
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "num_preemptions", "weight_version",
                        "finish_reason", "token_weight_versions"}
    assert out["prompt_ids"] == prompts == repeated([tokenizer(p)["input_ids"] for p in PROMPTS[:2]], 3)
    assert out["completion_ids"] == responses
    assert out["logprobs"] == [batch.rollout_logprobs[i, :len(r)].tolist() for i, r in enumerate(responses)]
    assert out["finish_reason"] == batch.finish_reasons
    assert out["num_preemptions"] == batch.num_preemptions.tolist() == [0] * 6
    assert out["weight_version"] == [0] * 6 == [rollouts.get_stats().weight_version] * 6
    assert len(set(map(tuple, responses[:3]))) > 1  # the 3 samples of a prompt differ

    # TRL's convention, log_softmax(logits / temperature), from the float32 policy. Measured: |diff| mean 0.20,
    # max 0.98 over 48 tokens (0.36 without the temperature); FP8 on this model is that far from float32
    # (docs/benchmarks.md: k3 0.05-0.1 per token), a BF16 engine 0.036. The bound leaves ~1.7x headroom.
    with torch.no_grad():
        diffs = []
        for prompt, response, logprobs in zip(prompts, responses, out["logprobs"]):
            logits = trainer.model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
            trl_logprobs = (logits / 0.7).log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
            diffs += (trl_logprobs - torch.tensor(logprobs)).abs().tolist()
    print(f"|TRL logprob - engine logprob| mean {sum(diffs) / len(diffs):.4f} max {max(diffs):.4f} over "
          f"{len(diffs)} tokens")
    assert sum(diffs) / len(diffs) < 0.35


def test_chat_prompts_are_templated_and_uneven_groups_keep_their_order(rollouts, default_dir, tmp_path):
    func = make_rollout_func(rollouts, SamplingParams(seed=3))
    trainer = make_trainer(default_dir, func, grpo_config(tmp_path, max_completion_length=4))
    out = func(repeated(CHAT, 2), trainer)
    templated = [rollouts.engine.render_chat(messages) for messages in CHAT]
    assert out["prompt_ids"] == repeated(templated, 2)
    assert templated[0] == trainer.processing_class.apply_chat_template(
        CHAT[0], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert [len(ids) for ids in out["completion_ids"]] == [len(lp) for lp in out["logprobs"]]
    assert all(1 <= len(ids) <= 4 for ids in out["completion_ids"])

    # runs of 2, 1 and 2 equal prompts: one rollout with n=2, one with n=1, answers back in prompt order
    prompts = ["12+5=", "12+5=", "7+8=", "3+9=", "3+9="]
    out = func(prompts, trainer)
    assert out["prompt_ids"] == [trainer.processing_class(p)["input_ids"] for p in prompts]
    assert len(out["completion_ids"]) == len(out["logprobs"]) == 5
    assert out["completion_ids"][0] != out["completion_ids"][1]  # a group's samples differ (n=2, not twice n=1)


def test_generation_params_come_from_the_trainer_config(tmp_path):
    base = SamplingParams(stop=["\n"], seed=5, temperature=0.2, max_tokens=99)
    args = grpo_config(tmp_path, temperature=0.9, top_p=0.8, top_k=0, min_p=None, max_completion_length=12)
    params = generation_params(args, base)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens) == (
        0.9, 0.8, -1, 0.0, 12)
    assert (params.stop, params.seed, params.logprobs, params.logprobs_mode) == (["\n"], 5, 0, "processed")
    assert params.repetition_penalty == 1.0
    args = grpo_config(tmp_path, top_k=5, min_p=0.1, repetition_penalty=1.1,
                       generation_kwargs={"min_tokens": 2, "top_p": 0.5})
    params = generation_params(args, base)
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens, params.top_p) == (
        5, 0.1, 1.1, 2, 0.5)
    with pytest.raises(ValueError, match="structured_outputs"):
        generation_params(grpo_config(tmp_path, generation_kwargs={"structured_outputs": {}}), base)
    with pytest.raises(ValueError, match="processed"):
        make_rollout_func(object.__new__(RolloutEngine), SamplingParams(logprobs_mode="raw"))


def test_peft_adapters_are_merged_under_the_base_names():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    base = LlamaForCausalLM(cfg)
    names = set(dict(base.named_parameters()))
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, lora)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    plain = q_proj.base_layer.weight.detach().clone()
    delta = q_proj.get_delta_weight("default")
    with hf_weights(model) as weights:
        assert set(weights) == names  # no lora_ tensors, no base_model.model. / .base_layer in the names
        assert torch.allclose(weights["model.layers.0.self_attn.q_proj.weight"], plain + delta)
    assert torch.allclose(q_proj.base_layer.weight, plain, atol=1e-6) and not q_proj.merged
    with hf_weights(base) as weights:
        assert weights is base


def test_three_grpo_steps_on_fp8_rollouts(rollouts, default_dir, tmp_path, monkeypatch):
    """GRPOTrainer with use_vllm=False and the rollout function: a sync per step (version = step), TRL's
    importance-sampling metrics and ratio computed from the engine's logprobs, fp8engine's mismatch
    metrics in TRL's logs, a finite loss. Colocated: the engine sleeps through the rest of each step (the
    rewards and the trainer's update) and wakes for the next sync and rollout."""
    func = make_rollout_func(rollouts, colocate=True)
    returned, old_logps, synced, seen_by_reward = [], [], [], []

    def rollout_spy(prompts, trainer):
        returned.append(func(prompts, trainer))
        return returned[-1]

    def reward(completions, weight_version, finish_reason, num_preemptions, trainer_state, **_):
        seen_by_reward.append((trainer_state.global_step, weight_version, rollouts.get_stats().weight_version))
        assert rollouts.is_sleeping()
        assert set(finish_reason) <= {"stop", "length"} and num_preemptions == [0] * 4
        return digit_reward(completions)

    sync = rollouts.sync_weights
    monkeypatch.setattr(rollouts, "sync_weights", lambda weights, weight_version: (
        synced.append((weight_version, weights)), sync(weights, weight_version))[1])
    trainer = make_trainer(default_dir, rollout_spy, grpo_config(tmp_path), reward=reward)
    assert not trainer.use_vllm
    per_token_logps = trainer._get_per_token_logps_and_entropies

    def logps_spy(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = per_token_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if not torch.is_grad_enabled():
            old_logps.append((input_ids[:, -logits_to_keep:].clone(), out[0].clone()))
        return out

    trainer._get_per_token_logps_and_entropies = logps_spy
    start = time.perf_counter()
    try:
        trainer.train()
        assert rollouts.is_sleeping()
    finally:
        rollouts.wake_up()
    seconds = time.perf_counter() - start

    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    print(f"3 GRPO steps in {seconds:.1f} s ({seconds / 3:.1f} s per step); TRL step_time "
          f"{[round(s['step_time'], 2) for s in steps]}, sync "
          f"{[round(s['fp8engine/sync_seconds'], 2) for s in steps]}, "
          f"rollout {[round(s['fp8engine/rollout_seconds'], 2) for s in steps]}, k3 "
          f"{[round(s['fp8engine/k3'], 4) for s in steps]}, |diff| mean "
          f"{[round(s['sampling/sampling_logp_difference/mean'], 3) for s in steps]}")
    assert [v for v, _ in synced] == [0, 1, 2]
    assert all(weights is trainer.model for _, weights in synced)
    assert seen_by_reward == [(s, [s] * 4, s) for s in range(3)]
    assert [s["fp8engine/weight_version"] for s in steps] == [0, 1, 2]
    assert all(s["fp8engine/sleep_seconds"] > 0 for s in steps) and rollouts.get_stats().num_sleeps_total >= 3
    assert len(steps) == 3 and all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps)

    assert len(old_logps) == len(returned) == 3  # TRL's old_per_token_logps: one no-grad pass per generation
    for step, out, (completions, old) in zip(steps, returned, old_logps):
        mask = torch.zeros(old.shape, dtype=torch.bool)
        ours = torch.zeros(old.shape)
        for i, (ids, logprobs) in enumerate(zip(out["completion_ids"], out["logprobs"])):
            assert completions[i, :len(ids)].tolist() == ids
            mask[i, :len(ids)] = True
            ours[i, :len(ids)] = torch.tensor(logprobs)
        delta = (old - ours).abs()[mask]
        ratio = (old - ours).exp()[mask]
        assert step["sampling/sampling_logp_difference/mean"] == pytest.approx(delta.mean().item(), rel=1e-5)
        assert step["sampling/sampling_logp_difference/max"] == pytest.approx(delta.max().item(), rel=1e-5)
        assert step["sampling/importance_sampling_ratio/mean"] == pytest.approx(
            ratio.clamp(max=IS_CLIP).mean().item(), rel=1e-5)
        assert step["sampling/importance_sampling_ratio/min"] == pytest.approx(ratio.min().item(), rel=1e-5)
        metrics = mismatch_metrics(old, ours, mask)
        for name in ("k1", "k3", "is_mean", "is_min", "is_max", "ess"):
            assert step[f"fp8engine/{name}"] == pytest.approx(metrics[name], rel=1e-5, abs=1e-9), name
        # FP8 engine vs float32 trainer: close, not identical. Measured k3 0.025-0.100 and |diff| mean
        # 0.16-0.22 over the 3 steps (docs/benchmarks.md: FP8 k3 0.05-0.15 per token on this model)
        assert 0 < step["fp8engine/k3"] < 0.3 and 0 < step["fp8engine/ess"] <= 1
        assert 0 < delta.mean() < 0.4


def test_rollout_func_over_http_equals_in_process(rollouts, default_dir, tmp_path):
    """RolloutClient against `fp8engine serve` with the same (batch-invariant FP8) engine: the same fields."""
    pytest.importorskip("fp8engine.entrypoints.server")
    from fp8engine.bench.serve_load import serving
    flags = ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--batch-invariant",
             "--kv-cache-memory-bytes", str(SMALL_KV)]
    params = SamplingParams(seed=9, stop=["\n"])
    local = make_rollout_func(rollouts, params)
    trainer = make_trainer(default_dir, local, grpo_config(tmp_path, max_completion_length=6))
    trainer.state.global_step = 4
    expected = local(repeated(PROMPTS[2:4], 2), trainer)
    with serving(flags, startup_timeout=600) as url:
        client = RolloutClient(url, sync_dtype=None)
        got = make_rollout_func(client, params)(repeated(PROMPTS[2:4], 2), trainer)
        assert client.get_stats().weight_version == 4
        client.close()
    assert got["weight_version"] == expected["weight_version"] == [4] * 4
    for key in ("prompt_ids", "completion_ids", "finish_reason", "num_preemptions"):
        assert got[key] == expected[key], key
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
               for a, b in zip(got["logprobs"], expected["logprobs"]))


def trl_grpo_example():
    """examples/trl_grpo.py as a module (it imports its neighbours addition.py and plot_grpo.py)."""
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import trl_grpo
    return trl_grpo


def test_baseline_stops_at_a_newline_like_the_engine(default_dir, tokenizer):
    """--generation trl: every token holding a newline ends a completion (fp8engine's stop=["\\n"], which
    keeps the token that hit it), in transformers' generate and in TRL's completion mask."""
    example = trl_grpo_example()
    ids = example.newline_token_ids(tokenizer)
    assert tokenizer("\n")["input_ids"][0] in ids and tokenizer("\n\n")["input_ids"][0] in ids
    assert all("\n" in tokenizer.decode([i]) for i in ids)
    assert not {tokenizer.eos_token_id, *tokenizer("17 +=")["input_ids"]} & set(ids)
    policy = example.load_policy(default_dir)
    assert policy.dtype == torch.float32
    assert policy.generation_config.eos_token_id == [tokenizer.eos_token_id, *ids]
    torch.manual_seed(0)
    prompt = tokenizer(["3+4=7\n12+5=17\n5+6="], return_tensors="pt")
    out = policy.generate(**prompt, do_sample=True, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id)
    completion = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert completion[-1] in ids and not set(completion[:-1]) & set(ids)  # measured: "11\n", 3 tokens


def test_baseline_run_has_the_same_trainer_without_rollout_func(rollouts, tmp_path):
    """One GRPO step of each: the same GRPOConfig, dataset and model; the baseline without a rollout function
    (TRL's transformers generation, use_vllm off), its step timed per phase; both runs plotted side by side."""
    example = trl_grpo_example()
    argv = ["--steps", "1", "--prompts", "2", "--n", "2", "--max-tokens", "4"]
    runs = {}
    for generation in ("fp8engine", "trl"):
        path = tmp_path / f"{generation}.json"
        example.main([*argv, "--generation", generation, "--json", str(path)])
        runs[generation] = json.loads(path.read_text())
    fp8, hf = runs["fp8engine"]["steps"][0], runs["trl"]["steps"][0]
    assert hf["k3"] is None and hf["weight_version"] is None and hf["sync_seconds"] == 0
    assert fp8["k3"] >= 0 and fp8["weight_version"] == 0 and fp8["sync_seconds"] > 0
    for row in (fp8, hf):
        assert row["generation_seconds"] > 0 and row["training_seconds"] > 0 and math.isfinite(row["loss"])
        assert row["wall_seconds"] == pytest.approx(
            row["generation_seconds"] + row["sync_seconds"] + row["training_seconds"])
        assert 1 <= row["completion_length"] <= 4
    assert runs["trl"]["totals"]["wall"] == pytest.approx(hf["wall_seconds"])

    trainers = {generation: example.build_trainer(example.parse_args([*argv, "--generation", generation]), engine,
                                                  str(tmp_path / generation), example.StepLog(engine is None))
                for generation, engine in (("fp8engine", rollouts), ("trl", None))}
    fp8_trainer, hf_trainer = trainers["fp8engine"], trainers["trl"]
    assert hf_trainer.rollout_func is None and not hf_trainer.use_vllm and fp8_trainer.rollout_func is not None
    settings = [{k: v for k, v in t.args.to_dict().items() if k not in ("output_dir", "logging_dir")}
                for t in (fp8_trainer, hf_trainer)]
    assert settings[0] == settings[1]
    assert hf_trainer.train_dataset.to_dict() == fp8_trainer.train_dataset.to_dict()
    assert hf_trainer.eos_token_ids == fp8_trainer.eos_token_ids

    png = tmp_path / "compare.png"
    example.main(["--compare", str(tmp_path / "fp8engine.json"), str(tmp_path / "trl.json"), "--png", str(png)])
    assert png.stat().st_size > 10_000


def test_three_grpo_steps_with_a_peft_model_sync_the_adapter_alone(default_dir, tmp_path):
    """A LoRA policy on an FP8 engine with LoRA buffers: each step sends the adapter (q/v, rank 8: 0.9 MB), not
    the 135M model; the base's FP8 bytes never change, the engine's version follows the step."""
    peft = pytest.importorskip("peft")
    rollouts = RolloutEngine(EngineConfig(**FP8, max_lora_rank=8))
    fp8_bytes = {n: t.clone() for n, t in rollouts.engine.named_parameters()}
    policy = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32)
    policy = peft.get_peft_model(policy, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    adapter_bytes = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
    trainer = GRPOTrainer(model=policy, reward_funcs=digit_reward, args=grpo_config(tmp_path, learning_rate=1e-3),
                          rollout_func=make_rollout_func(rollouts), train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [s["fp8engine/weight_version"] for s in steps] == [0, 1, 2] and rollouts.get_stats().weight_version == 2
    assert [s["fp8engine/sync_bytes"] for s in steps] == [adapter_bytes] * 3 and adapter_bytes == 30 * 8 * (
        576 + 576 + 576 + 192) * 4
    assert all(torch.equal(t.view(torch.uint8), fp8_bytes[n].view(torch.uint8))
               for n, t in rollouts.engine.named_parameters())
    rollouts.sync_weights(policy, weight_version=3)  # the adapter after the last optimizer step
    q_proj = policy.base_model.model.model.layers[0].self_attn.q_proj
    lora = rollouts.engine.runner.lora_layers["model.layers.0.self_attn.qkv_proj"]
    a, b = lora.shard_views(0)
    assert torch.equal(a, q_proj.lora_A["default"].weight.to(torch.bfloat16))
    assert torch.equal(b, (q_proj.lora_B["default"].weight * 2.0).to(torch.bfloat16))


def test_trls_vllm_client_drives_serve_in_server_mode(monkeypatch, tokenizer):
    """TRL's own VLLMClient (GRPO's vllm_mode="server") against `fp8engine serve --logprobs-mode
    processed_logprobs`: /server_info passes GRPOTrainer's logprobs-mode check and init_communicator's
    weight-transfer check, generate's token-id completions (return_tokens_as_token_ids, top_k 0, prompt-major n)
    equal our /v1/completions with processed logprobs, and the weight sync stops at TRL's own CUDA requirement.
    VLLMClient refuses to start without vLLM installed; nothing it calls here imports vLLM, so that check is
    lifted, and vLLM's get_ip (the trainer's address for the rendezvous) is given one."""
    import requests
    from trl.generation import vllm_client

    from fp8engine.bench.serve_load import serving

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *_, **__: True)
    monkeypatch.setattr(vllm_client, "get_ip", lambda: "127.0.0.1", raising=False)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    flags = ["--logprobs-mode", "processed_logprobs", "--batch-invariant", "--num-kv-blocks", "256"]
    with serving(flags) as url:
        client = vllm_client.VLLMClient(base_url=url, connection_timeout=30)
        info = client.get_server_info()
        assert info["model_config"]["logprobs_mode"] == "processed_logprobs"  # GRPOTrainer's IS-correction check
        assert info["weight_transfer_config"] == {"backend": "gloo"} and info["lora_config"] is None
        assert info["parallel_config"]["data_parallel_size"] == 1 and client.get_world_size() == 1
        out = client.generate(prompts, n=2, temperature=1.0, top_p=0.8, top_k=0, max_tokens=6,
                              generation_kwargs={"seed": 7, "ignore_eos": True})
        body = {"prompt": prompts, "n": 2, "temperature": 1.0, "top_p": 0.8, "max_tokens": 6, "seed": 7,
                "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
        choices = {mode: requests.post(f"{url}/v1/completions", json=body | {"logprobs_mode": mode}).json()[
            "choices"] for mode in ("processed", "raw")}
        assert out["prompt_ids"] == prompts
        assert out["completion_ids"] == [c["token_ids"] for c in choices["processed"]]
        assert all(len(ids) == 6 for ids in out["completion_ids"])
        assert out["logprob_token_ids"] == [[[t] for t in ids] for ids in out["completion_ids"]]
        assert out["logprobs"] == [[[lp] for lp in c["logprobs"]["token_logprobs"]] for c in choices["processed"]]
        raw = [lp for c in choices["raw"] for lp in c["logprobs"]["token_logprobs"]]
        assert [c["token_ids"] for c in choices["raw"]] == out["completion_ids"]
        assert all(p >= r for p, r in zip(sum(sum(out["logprobs"], []), []), raw))  # top-p renormalizes upward
        assert sum(sum(out["logprobs"], []), []) != raw
        client.reset_prefix_cache()
        with pytest.raises(NotImplementedError, match="needs a CUDA device"):
            client.init_communicator(device="cpu")
