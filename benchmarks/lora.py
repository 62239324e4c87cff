"""LoRA rollouts on the default model: what a sync moves and costs (adapter vs full model, FP8 re-quantization
included), what an unmerged adapter costs in decoding (rank 8 and 64 against no adapter: batch-1 decode and the
bench's rl-short workload), and with --trl a TRL GRPO step with adapter-only syncs against merge-and-sync.

Every engine is FP8 (W8A8 linears, FP8 KV cache); the adapter covers q/k/v/o and gate/up/down of all 30 layers
(random A and B, PEFT's names). Throughput rounds alternate between the engines, so drift hits all alike.

    python -m benchmarks.lora [--rounds 3] [--trl] [--json FILE]
"""

import argparse
import json
import platform
import statistics
import time

import torch

from fp8engine import EngineConfig, LLMEngine, SamplingParams, default_model_path
from fp8engine.bench.throughput import rl_prompts
from fp8engine.bench.workloads import WORKLOADS
from fp8engine.weights.loader import iter_safetensors

MODULES = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (576, 192), "self_attn.v_proj": (576, 192),
           "self_attn.o_proj": (576, 576), "mlp.gate_proj": (576, 1536), "mlp.up_proj": (576, 1536),
           "mlp.down_proj": (1536, 576)}
FP8 = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", kv_cache_memory_bytes=256 << 20)


def adapter(rank: int, seed: int = 0, layers: int = 30) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(layers):
        for module, (k, n) in MODULES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = (torch.randn(rank, k, generator=g) * 0.02).to(torch.bfloat16)
            out[f"{prefix}.lora_B.weight"] = (torch.randn(n, rank, generator=g) * 0.02).to(torch.bfloat16)
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def sync_times(engine: LLMEngine, full: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], rounds: int) -> dict:
    """Median seconds of update_weights(whole model) and update_lora(adapter) on the same engine."""
    whole, only = [], []
    for _ in range(rounds):
        whole.append(engine.update_weights(full).seconds)
        only.append(engine.update_lora(lora, 2.0).seconds)
    return {"full_model": {"bytes": nbytes(full), "seconds": statistics.median(whole)},
            "adapter": {"bytes": nbytes(lora), "seconds": statistics.median(only)}}


def tok_s(engine: LLMEngine, prompts: list, max_tokens: int, n: int = 1) -> float:
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - start)


def trl_steps(adapter_only: bool, steps: int) -> dict:
    """A TRL GRPOTrainer on a rank-8 PEFT policy (all 7 projections) for `steps` steps (4 completions of 32 tokens
    a step): the adapter alone synced into an engine with LoRA buffers, or the adapter merged and the whole model
    synced (what TRL does for vLLM). Median step time, sync time and bytes."""
    import os

    import peft
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from fp8engine.rl import RolloutEngine
    from fp8engine.rl.trl import make_rollout_func
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    rollouts = RolloutEngine(EngineConfig(**FP8, max_lora_rank=8 if adapter_only else 0))
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    policy = peft.get_peft_model(policy, peft.LoraConfig(r=8, lora_alpha=16, target_modules=[
        m.split(".")[1] for m in MODULES]))
    args = GRPOConfig(output_dir="/tmp/fp8engine-lora-trl", max_steps=steps, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=32, temperature=1.0, learning_rate=1e-4,
                      logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0)
    prompts = [p[0]["content"] for p in rl_prompts(16)]
    trainer = GRPOTrainer(model=policy, reward_funcs=lambda completions, **_: [len(c) / 100 for c in completions],
                          args=args, rollout_func=make_rollout_func(rollouts),
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {key: statistics.median(e[name] for e in logged)
            for key, name in (("step_seconds", "step_time"), ("sync_seconds", "fp8engine/sync_seconds"),
                              ("sync_bytes", "fp8engine/sync_bytes"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trl", action="store_true", help="also a TRL GRPO run each way (adapter-only vs merge)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    engines = {"none": LLMEngine(EngineConfig(**FP8))}
    for rank in (8, 64):
        engines[f"rank {rank}"] = LLMEngine(EngineConfig(**FP8, max_lora_rank=rank))
        engines[f"rank {rank}"].update_lora(adapter(rank), 2.0)
    full = dict(iter_safetensors(default_model_path()))
    syncs = {rank: sync_times(engines[f"rank {rank}"], full, adapter(rank, seed=1), args.rounds) for rank in (8, 64)}
    g = torch.Generator().manual_seed(0)
    short = WORKLOADS["rl-short"]
    workloads = {"decode, 1 sequence x 128 tokens": ([torch.randint(100, 40000, (32,), generator=g).tolist()], 128, 1),
                 f"rl-short, {short.num_prompts} prompts x n={short.n} x {short.max_tokens} tokens": (
                     rl_prompts(short.num_prompts), short.max_tokens, short.n)}
    rates: dict[str, dict[str, list[float]]] = {w: {e: [] for e in engines} for w in workloads}
    for name, engine in engines.items():  # warm-up: kernels built, pages touched
        tok_s(engine, workloads["decode, 1 sequence x 128 tokens"][0], 8)
    for _ in range(args.rounds):
        for workload, (prompts, max_tokens, n) in workloads.items():
            for name, engine in engines.items():
                rates[workload][name].append(tok_s(engine, prompts, max_tokens, n))
    print(f"machine: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
          f"kernels {engines['none'].get_stats().kernels}")
    for rank, sync in syncs.items():
        f, a = sync["full_model"], sync["adapter"]
        print(f"sync, rank {rank} adapter on all 7 projections x 30 layers: full model {f['bytes'] / 1e6:.1f} MB "
              f"{f['seconds'] * 1e3:.1f} ms (FP8 re-quantization included); adapter {a['bytes'] / 1e6:.2f} MB "
              f"{a['seconds'] * 1e3:.1f} ms ({f['seconds'] / a['seconds']:.0f}x faster, "
              f"{f['bytes'] / a['bytes']:.0f}x fewer bytes)")
    summary = {}
    for workload, by_engine in rates.items():
        medians = {name: statistics.median(r) for name, r in by_engine.items()}
        summary[workload] = medians
        print(f"{workload} (median of {args.rounds} alternating rounds, tok/s): " + ", ".join(
            f"{name} {rate:.1f} ({rate / medians['none']:.2f}x)" for name, rate in medians.items()))
    decoders = {n: e.get_stats().kernels["decoder"] for n, e in engines.items()}
    trl = {}
    if args.trl:
        engines.clear()  # their KV caches
        trl = {"adapter": trl_steps(True, 4), "merge": trl_steps(False, 4)}
        a, m = trl["adapter"], trl["merge"]
        print(f"TRL GRPO, rank-8 PEFT policy, 4 steps (median): adapter-only sync {a['step_seconds']:.2f} s a step "
              f"(sync {a['sync_seconds'] * 1e3:.0f} ms, {a['sync_bytes'] / 1e6:.2f} MB) vs merge-and-sync "
              f"{m['step_seconds']:.2f} s (sync {m['sync_seconds'] * 1e3:.0f} ms, {m['sync_bytes'] / 1e6:.1f} MB): "
              f"{m['step_seconds'] / a['step_seconds']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sync": syncs, "tok_s": summary, "rounds": rates, "trl": trl,
                       "decoder": decoders}, f, indent=1)


if __name__ == "__main__":
    main()
