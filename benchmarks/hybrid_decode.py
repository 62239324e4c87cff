"""Decode throughput of a Qwen3.5-2B-shaped hybrid model (issue 63): fp8engine BF16 and FP8 against transformers'
`generate`, each warmed up on the batch it is timed on, rounds alternating.

The model: `--model qwen3.5-2b-shape` of the bench (fp8engine/bench/model_shapes.py: the 2B's sizes, random
weights: load_format="dummy" for the engine, transformers' seeded init for HF, the default model's 49,152-token
vocabulary). vLLM's CPU build 0.32 does not run it: its Transformers backend refuses the linear-attention layers,
and its own Qwen3_5ForCausalLM imports torchvision (not in its CPU venv) and runs GDN through Triton kernels,
which its CPU build disables.

    python benchmarks/hybrid_decode.py --batches 1,8,32 --input-len 32 --output-len 64 --rounds 2 [--hf]

`--plan-ab` also times each engine with its decode steps in the Python layers instead of the C++ plan
(fused_decoder.HybridDecoder) as "<mode>-python", in the same rounds (the same tokens and logprobs bit for bit:
tests/test_fused_decoder.py).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen3_5TextConfig

from fp8engine import EngineConfig, LLMEngine, SamplingParams
from fp8engine.bench import model_shapes

MODES = {"bf16": {}, "fp8-linear": dict(quantization="fp8")}


def model_dir() -> str:
    """The shape's config and tokenizer (the engine draws the weights: load_format="dummy")."""
    return model_shapes.shape_path("qwen3.5-2b-shape")


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40_000, (batch, length), generator=gen).tolist()


def time_engine(engine: LLMEngine, batch: int, args) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts(batch, args.input_len), params)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


class WithoutPlan:
    """An engine whose decode steps run the Python layers while it generates (its plan set aside)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def generate(self, *args, **kwargs):
        model = self.engine.runner.model
        plan, model.fused = model.fused, None
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            model.fused = plan


def time_hf(model, batch: int, args) -> float:
    ids = torch.tensor(prompts(batch, args.input_len))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    return batch * (out.shape[1] - ids.shape[1]) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-gib", type=float, default=4.0, help="KV budget (state slots included) per engine")
    parser.add_argument("--hf", action="store_true", help="also transformers' generate (BF16)")
    parser.add_argument("--plan-ab", action="store_true", help="also each engine without its C++ decode plan")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    path = model_dir()
    engines = {name: LLMEngine(EngineConfig(model=path, load_format="dummy", max_num_seqs=max(batches),
                                            kv_cache_memory_bytes=int(args.kv_gib * 2**30), **options))
               for name, options in MODES.items()}
    stats = engines["bf16"].get_stats()
    print(f"state per sequence: {stats.state_bytes_per_sequence / 2**20:.1f} MiB, "
          f"{stats.num_state_slots_total} slots + {engines['bf16'].runner.num_state_snapshots} snapshots, "
          f"{stats.num_kv_blocks_total} KV blocks; kernels {stats.kernels.get('gated_delta')}")
    systems = dict(engines)
    if args.plan_ab:
        systems |= {f"{name}-python": WithoutPlan(engine) for name, engine in engines.items()}
    if args.hf:
        from transformers import AutoModelForCausalLM
        torch.manual_seed(0)
        config = Qwen3_5TextConfig.from_pretrained(path)
        systems["hf"] = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    results = {}
    for batch in batches:
        for name, system in systems.items():  # warm-up on the timed shape
            (time_hf if name == "hf" else time_engine)(system, batch, args)
        runs = {name: [] for name in systems}
        for _ in range(args.rounds):
            for name, system in systems.items():
                runs[name].append((time_hf if name == "hf" else time_engine)(system, batch, args))
        results[batch] = {name: statistics.median(v) for name, v in runs.items()}
        r = results[batch]
        line = ", ".join(f"{name} {tps:.1f}" for name, tps in r.items())
        plan = "".join(f"; {m} plan/python {r[m] / r[m + '-python']:.2f}x" for m in MODES if m + "-python" in r)
        print(f"batch {batch}: tok/s {line}; fp8/bf16 {r['fp8-linear'] / r['bf16']:.2f}x{plan}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
