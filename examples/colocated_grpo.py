"""Colocated GRPO: the trainer and the engine share one machine and take turns with its memory.

grpo_tiny.py's loop (few-shot addition, FP8 rollouts, the float32 trainer's own logprobs corrected by TIS: the
exact mode's replay needs the engine during the trainer's step), run twice, each in a process of its own:
"awake" keeps the engine's weights and KV cache resident through the trainer's step; "sleep" hands them back
while the trainer steps (LLMEngine.sleep) and takes them back in veRL's order before the next rollout:
wake_up(["weights"]) -> sync_weights -> wake_up(["kv_cache"]). Every step syncs every weight, so the sleep is
level 2 (nothing of the old weights is kept). A thread samples the process's resident memory (RssAnon + RssShmem)
every 10 ms; the peak of each run and its step times go to JSON, the traces side by side to a PNG.

    python examples/colocated_grpo.py --steps 4 --prompts 8 --n 8 --json examples/results/colocated.json \\
        --png examples/results/colocated.png
    python examples/colocated_grpo.py --smoke                 # 2 tiny steps of each
"""

import argparse
import json
import random
import subprocess
import sys
import threading
import time

import torch
from addition import engine_config, make_problems
from grpo_tiny import rewards, train_step
from transformers import AutoModelForCausalLM

from fp8engine import SamplingParams, default_model_path
from fp8engine.rl import RolloutEngine


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[k].split()[0]) for k in ("RssAnon", "RssShmem")) << 10


class Trace:
    """Resident memory sampled every `period` seconds by a thread, with the phase the loop was in."""

    def __init__(self, period: float = 0.01):
        self.period, self.phase, self.samples = period, "start", []
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append((time.perf_counter() - self.start, resident_bytes(), self.phase))

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


def run(args: argparse.Namespace) -> dict:
    """One variant's loop in this process; its step records, peak and trace."""
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    policy = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    engine = RolloutEngine(engine_config("fp8"))
    sleep = args.variant == "sleep"
    trace, records = Trace(), []
    for step in range(args.steps):
        timings = {}

        def timed(phase: str, fn, *a, **kw):
            trace.phase, start = phase, time.perf_counter()
            result = fn(*a, **kw)
            timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start
            return result

        if sleep:
            timed("wake", engine.wake_up, ["weights"])
        timed("sync", engine.sync_weights, policy, weight_version=step)
        if sleep:
            timed("wake", engine.wake_up, ["kv_cache"])
        prompts, answers = make_problems(rng, args.prompts, 20)
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop=["\n"], seed=step)
        batch = timed("rollout", engine.rollout, prompts, n=args.n, sampling_params=params)
        reward = rewards(batch, answers)
        if sleep:
            timed("sleep", engine.sleep, 2)
        train = timed("train", train_step, policy, optimizer, batch, params, reward, True, False)
        records.append({"step": step, "reward_mean": reward.mean().item(), "k3": train["k3"], **timings,
                        "step_seconds": sum(timings.values())})
        print(f"{args.variant} step {step}: " + "  ".join(f"{k} {v:.2f}s" for k, v in timings.items()), flush=True)
    samples = trace.stop()
    stats = engine.get_stats()
    return {"variant": args.variant, "steps": records, "peak_bytes": max(b for _, b, _ in samples),
            "peak_by_phase": {p: max(b for _, b, q in samples if q == p) for p in {q for _, _, q in samples}},
            "sleep_seconds_total": stats.sleep_seconds_total, "wake_seconds_total": stats.wake_seconds_total,
            "trace": samples}


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in results:
        times = [t for t, _, _ in r["trace"]]
        ax.plot(times, [b / 2**30 for _, b, _ in r["trace"]],
                label=f"{r['variant']}: peak {r['peak_bytes'] / 2**30:.2f} GiB")
    ax.set_xlabel("seconds")
    ax.set_ylabel("resident memory (GiB)")
    ax.set_title("Colocated GRPO on CPU: engine awake vs asleep during the trainer's step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="2 steps of 2 prompts x 2 samples")
    p.add_argument("--variant", choices=("awake", "sleep"), help="run one variant here (the parent runs both)")
    p.add_argument("--json", help="write both runs' records here")
    p.add_argument("--png", help="plot both runs' resident memory here")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.prompts, args.n = 2, 2, 2
    if args.variant:
        print("RESULT " + json.dumps(run(args)), flush=True)
        return
    results = []
    for variant in ("awake", "sleep"):
        cmd = [sys.executable, __file__, "--variant", variant, "--steps", str(args.steps), "--prompts",
               str(args.prompts), "--n", str(args.n), "--max-tokens", str(args.max_tokens), "--lr", str(args.lr),
               "--seed", str(args.seed)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        print("".join(line + "\n" for line in out.splitlines() if not line.startswith("RESULT ")), end="")
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    for r in results:
        steps = [s["step_seconds"] for s in r["steps"][1:]] or [r["steps"][0]["step_seconds"]]
        print(f"{r['variant']:>5}: peak resident {r['peak_bytes'] / 2**30:.2f} GiB, step "
              f"{sum(steps) / len(steps):.2f} s (after the first), sleep {r['sleep_seconds_total']:.2f} s + wake "
              f"{r['wake_seconds_total']:.2f} s in all")
    if args.json:
        with open(args.json, "w") as f:  # the traces are in the PNG
            json.dump([{k: v for k, v in r.items() if k != "trace"} for r in results], f, indent=1)
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()
