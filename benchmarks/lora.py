"""LoRA rollouts on the default model: what a sync moves and costs (adapter vs full model, FP8 re-quantization
included), and what an unmerged adapter costs in decoding (rank 8 and 64 against no adapter), side by side.

Every engine is FP8 (W8A8 linears, FP8 KV cache); the adapter covers q/k/v/o and gate/up/down of all 30 layers
(random A and B, PEFT's names). Throughput rounds alternate between the engines, so drift hits all alike.

    python -m benchmarks.lora [--rounds 3] [--json FILE]
"""

import argparse
import json
import platform
import statistics
import time

import torch

from fp8engine import EngineConfig, LLMEngine, SamplingParams, default_model_path
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


def tok_s(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
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
    workloads = {"decode, 1 sequence x 128 tokens": ([torch.randint(100, 40000, (32,), generator=g).tolist()], 128),
                 "rl-short-like, 32 sequences x 64 tokens": (
                     [torch.randint(100, 40000, (32,), generator=g).tolist() for _ in range(32)], 64)}
    rates: dict[str, dict[str, list[float]]] = {w: {e: [] for e in engines} for w in workloads}
    for name, engine in engines.items():  # warm-up: kernels built, pages touched
        tok_s(engine, workloads["decode, 1 sequence x 128 tokens"][0], 8)
    for _ in range(args.rounds):
        for workload, (prompts, max_tokens) in workloads.items():
            for name, engine in engines.items():
                rates[workload][name].append(tok_s(engine, prompts, max_tokens))
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sync": syncs, "tok_s": summary, "rounds": rates,
                       "decoder": {n: e.get_stats().kernels["decoder"] for n, e in engines.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
