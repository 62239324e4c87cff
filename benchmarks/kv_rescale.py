"""FP8 KV re-quantization across a scale change: its error against a cache written at the new scale, and its time.

When an update moves a layer's k/v scale while samples keep their KV (in_flight="keep"), the engine converts
the stored E4M3 values to the new scale in place (ModelRunner.rescale_kv): read = E4M3(stored * old / new) * new.
The alternative a cache could take is to have been written at the new scale from the start, E4M3(x / new) * new,
which nothing can do after the fact (x is gone); this measures how far the first is from the second and from x,
for K and V activations of the default model, at scale ratios around the ones RL updates give.

    python -m benchmarks.kv_rescale            # a table; --json FILE for the raw figures
"""

import argparse
import json
import time

import torch

from fp8engine import EngineConfig, LLMEngine, SamplingParams
from fp8engine.model_executor.kernels.attention_ref import quantize_fp8

RATIOS = (0.5, 0.8, 0.95, 0.99, 1.01, 1.05, 1.25, 2.0)
FP8_MAX = 448.0


def activations(prompt: str, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor, LLMEngine]:
    """K and V of every layer for one prompt's tokens, from a BF16-KV engine's cache (float32, [tokens-ish, ...])."""
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_memory_bytes=64 << 20))
    engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    cache = engine.runner.kv_cache.float()  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    used = cache.flatten(2, 3).abs().amax(dim=(0, 1, 3, 4)) > 0
    k, v = cache[:, 0].flatten(1, 2)[:, used], cache[:, 1].flatten(1, 2)[:, used]
    return k, v, engine


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def measure(x: torch.Tensor, ratio: float) -> dict:
    """Per layer: old scale = amax / 448, new = old * ratio; rescaled vs written at the new scale."""
    errors = {"rescaled_vs_direct": [], "rescaled_vs_x": [], "direct_vs_x": [], "differ": []}
    for layer in x:
        old = float(layer.abs().amax()) / FP8_MAX
        new = old * ratio
        stored = quantize_fp8(layer, old)
        rescaled = quantize_fp8(stored.float() * old, new).float() * new
        direct = quantize_fp8(layer, new).float() * new
        errors["rescaled_vs_direct"].append(rel_rms(rescaled, direct))
        errors["rescaled_vs_x"].append(rel_rms(rescaled, layer))
        errors["direct_vs_x"].append(rel_rms(direct, layer))
        errors["differ"].append(float((rescaled != direct).float().mean()))
    return {key: sum(v) / len(v) for key, v in errors.items()}


def rescale_time(engine: LLMEngine, repeats: int = 5) -> dict:
    """ModelRunner.rescale_kv over every block of every layer of a full cache (both K and V change)."""
    runner = engine.runner
    blocks = list(range(runner.kv_cache.shape[2]))
    runner.kv_cache = runner.kv_cache.to(torch.float8_e4m3fn)
    start = time.perf_counter()
    for _ in range(repeats):
        for layer in range(runner.kv_cache.shape[0]):
            runner.rescale_kv(layer, blocks, (1.0, 1.0), (1.05, 0.95))
    seconds = (time.perf_counter() - start) / repeats
    tokens = len(blocks) * runner.kv_cache.shape[3]
    return {"cache_tokens": tokens, "seconds_all_layers": seconds, "us_per_token": 1e6 * seconds / tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    args = p.parse_args()
    torch.manual_seed(0)
    k, v, engine = activations("Write a short story about a robot who learns to paint.", 200)
    rows = [{"ratio": r, "k": measure(k, r), "v": measure(v, r)} for r in RATIOS]
    timing = rescale_time(engine)
    print(f"K/V of the default model ({k.shape[1]} tokens x 30 layers); relative RMS errors, mean over layers")
    print(f"{'new/old':>8} {'K resc-vs-direct':>17} {'K resc-vs-x':>12} {'K direct-vs-x':>14} {'K differ':>9} "
          f"{'V resc-vs-direct':>17} {'V resc-vs-x':>12} {'V direct-vs-x':>14}")
    for r in rows:
        print(f"{r['ratio']:8.2f} {r['k']['rescaled_vs_direct']:17.4f} {r['k']['rescaled_vs_x']:12.4f} "
              f"{r['k']['direct_vs_x']:14.4f} {r['k']['differ']:9.2%} {r['v']['rescaled_vs_direct']:17.4f} "
              f"{r['v']['rescaled_vs_x']:12.4f} {r['v']['direct_vs_x']:14.4f}")
    print(f"rescale time: {timing['seconds_all_layers'] * 1e3:.1f} ms for a full cache of {timing['cache_tokens']} "
          f"tokens x 30 layers ({timing['us_per_token']:.2f} us per cached token)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "timing": timing}, f, indent=1)


if __name__ == "__main__":
    main()
