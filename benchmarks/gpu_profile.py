"""Where a decode step's device time goes: the 8B-shaped Llama of benchmarks/gpu_engine.py (random weights drawn on
the device), eager steps (so that every kernel shows), under torch.profiler; prints the kernels by total device time
per step, for BF16 and FP8 at the given batch sizes, and writes them as JSON. Without CUDA it says so and exits 0.

    python -m benchmarks.gpu_profile [--batch 1,64] [--modes bf16,fp8] [--json bench_results/gpu_profile.json]
"""

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

STEPS = 5


def profile(model: str, batch: int, quantization: str | None, top: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from benchmarks.gpu_engine import start_decoding
    from fp8engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(model=model, device="cuda", quantization=quantization, load_format="dummy",
                                    num_kv_blocks=batch * 16 + 16, max_num_seqs=batch, enforce_eager=True))
    start_decoding(engine, batch, 128, SamplingParams(temperature=1.0, max_tokens=STEPS + 4, ignore_eos=True, seed=0))
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.device_time / STEPS
            kernels[event.name][1] += 1
    total = sum(us for us, _ in kernels.values())
    rows = sorted(({"kernel": name[:90], "us_per_step": round(us, 1), "calls_per_step": calls // STEPS}
                   for name, (us, calls) in kernels.items()), key=lambda r: -r["us_per_step"])
    mode = quantization or "bf16"
    launches = sum(calls for _, calls in kernels.values()) // STEPS
    print(f"\n{mode} batch {batch}: {total / 1e3:.2f} ms of kernels a step ({launches} launches)", flush=True)
    for row in rows[:top]:
        print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:4d}  {row['kernel']}", flush=True)
    del engine
    return {"mode": mode, "batch": batch, "kernel_us_per_step": round(total, 1), "kernels": rows[:top]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--modes", default="bf16,fp8")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", default="bench_results/gpu_profile.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA device here, nothing ran")
        return 0
    from benchmarks.gpu_engine import EIGHT_B, model_dir
    with tempfile.TemporaryDirectory() as root:
        model = model_dir(Path(root) / "8b", EIGHT_B, weights=False)
        report = [profile(model, int(b), None if m == "bf16" else m, args.top)
                  for m in args.modes.split(",") for b in args.batch.split(",")]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
