"""Decode throughput of a Qwen3.5-2B-shaped hybrid model (issue 63): fp8engine BF16 and FP8 against transformers'
`generate`, each warmed up on the batch it is timed on, rounds alternating.

The model: transformers' Qwen3_5TextConfig with the 2B's published sizes (24 layers, 18 Gated DeltaNet + 6 gated
attention, hidden 2048, MLP 6144, 8 query / 2 KV heads of 256, 16 / 16 linear heads of 128), random weights
(load_format="dummy" for the engine, transformers' init for HF) and the default model's tokenizer, so its vocabulary
is 49,152 rather than 248,320 (the LM head is a smaller share of a step than in the released model). vLLM's CPU
build is not run: its 0.32 wheel has no qwen3_5 text model for CPU (say so in the note if that changes).

    python benchmarks/hybrid_decode.py --batches 1,8,32 --input-len 32 --output-len 64 --rounds 2 [--hf]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3_5TextConfig

from fp8engine import EngineConfig, LLMEngine, SamplingParams
from fp8engine.envs import cache_root
from fp8engine.weights.default_model import default_model_path

SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
             num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
             rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25))
MODES = {"bf16": {}, "fp8-linear": dict(quantization="fp8")}


def model_dir() -> str:
    """A directory with the config and tokenizer only (the engine draws the weights: load_format="dummy")."""
    path = cache_root() / "models" / "qwen3.5-2b-shape"
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        Qwen3_5TextConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, architectures=["Qwen3_5ForCausalLM"],
                          eos_token_id=tokenizer.eos_token_id, **SHAPE).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40_000, (batch, length), generator=gen).tolist()


def time_engine(engine: LLMEngine, batch: int, args) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts(batch, args.input_len), params)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


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
        line = ", ".join(f"{name} {tps:.1f}" for name, tps in results[batch].items())
        print(f"batch {batch}: tok/s {line}; fp8/bf16 {results[batch]['fp8-linear'] / results[batch]['bf16']:.2f}x",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
