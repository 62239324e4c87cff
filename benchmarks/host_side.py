"""Host side of a decode step on the CUDA path, counted on a CPU (no GPU needed): torch calls, torch ops on device
tensors (each a kernel launch on a GPU), Triton launches and host synchronisations per decode step, and the host
time of a step, for a 32-layer model with an 8B model's layer structure (Llama-3-8B: 32 heads, 8 KV heads, head
dim 128; the hidden sizes are shrunk, which changes no count). Triton launches are counted, not run
(tests/fake_cuda.py, stub_kernels=True); the host time includes the tracking mode's own overhead, so it is an
upper bound. Each case runs eagerly and with CUDA graphs (model_executor/cuda_graphs.py; FakeCuda(graphs="stub"):
the capture records the step once and a replay is the one call a graph replay is, the GPU's work not counted);
tempered sampling (the fused sampler's rows) also with async scheduling, where a step's host work is the next
step's launch and the read-back of the step before.

    python -m benchmarks.host_side [--batch 1,64] [--steps 8] [--json bench_results/host_side.json]   (checkout)
"""

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from fp8engine import EngineConfig, LLMEngine, SamplingParams, default_model_path  # noqa: E402
from tests.fake_cuda import FakeCuda  # noqa: E402

SHAPE = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=256,
             intermediate_size=512, vocab_size=1024, max_position_embeddings=4096)


def _model_dir(root: str) -> str:
    import torch
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16).save_pretrained(root)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(root)
    return root


def measure(model: str, batch: int, steps: int, options: dict, params: SamplingParams, graphs: bool,
            async_scheduling: bool = False) -> dict:
    with FakeCuda(stub_kernels=True, graphs="stub" if graphs else None) as dev:
        engine = LLMEngine(EngineConfig(model=model, device="cuda", num_kv_blocks=batch * 8 + 8, max_num_seqs=batch,
                                        enforce_eager=not graphs, async_scheduling=async_scheduling, **options))
        for i in range(batch):
            engine.add_request([5 + i, 6, 7, 8], params)
        engine.step()  # the prefill
        rows = []
        for _ in range(steps):
            before = counters(dev)
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            rows.append([a - b for a, b in zip(counters(dev), before)] + [seconds])
    med = [statistics.median(col) for col in zip(*rows)]
    assert (engine.runner.graphs is not None) == graphs, engine.get_stats().kernels["cuda_graphs"]
    return {"batch": batch, "graphs": graphs, "async": async_scheduling, "torch_calls": med[0], "device_ops": med[1],
            "triton_launches": med[2], "torch_kernels": med[3], "launches": med[2] + med[3], "host_syncs": med[4], "host_ms": med[-1] * 1e3}


def counters(dev: FakeCuda) -> tuple:
    """(torch calls, device ops, Triton launches, torch kernels, host syncs) so far: a step's are the differences."""
    return dev.torch_calls, dev.device_ops, sum(dev.launches.values()), dev.torch_kernels, dev.host_syncs()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.steps + 2, ignore_eos=True, seed=0,
                             logprobs=0)
    tempered = SamplingParams(temperature=1.0, max_tokens=args.steps + 4, ignore_eos=True, seed=0, logprobs=0)
    results = []
    with tempfile.TemporaryDirectory() as root:
        model = _model_dir(root)
        for mode, options in (("bf16", {}), ("fp8", dict(quantization="fp8"))):
            for name, params in (("greedy", greedy), ("top_p", sampled), ("temperature", tempered)):
                # (graphs, async scheduling): eager, graphs, and graphs with async scheduling for the common sampler
                runs = ((False, False), (True, False)) + (((True, True),) if name == "temperature" else ())
                for batch, (graphs, ahead) in ((b, r) for b in map(int, args.batch.split(",")) for r in runs):
                    try:
                        r = measure(model, batch, args.steps, options, params, graphs, ahead) | {"mode": mode,
                                                                                                  "sampling": name}
                    except Exception as exc:  # the path before the device sampler raised on sampled rows
                        r = {"mode": mode, "sampling": name, "batch": batch, "graphs": graphs, "error": f"{type(exc).__name__}: {exc}"[:200]}
                    results.append(r)
                    print(json.dumps(r))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPE, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
