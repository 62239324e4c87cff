"""TRL's GRPOTrainer on fp8engine FP8 rollouts: the default model learns few-shot addition.

TRL trains the float32 policy; fp8engine generates. `make_rollout_func` syncs the policy into the
engine each step (FP8 linear + FP8 KV, scales recomputed for the new weights), samples n completions
per prompt and hands TRL the engine's logprobs, on which TRL's own importance-sampling correction
runs (token_truncate with C = 2 here). Logged per step: reward, fp8engine's mismatch k3 and TRL's
IS ratio, the loss, and the step time split (sync / rollout / rest of the step).

    python examples/trl_grpo.py --steps 10 --json examples/results/trl_grpo.json \\
        --png examples/results/trl_grpo.png
    fp8engine serve --quantization fp8 --kv-cache-dtype fp8_e4m3 --port 8000 &
    python examples/trl_grpo.py --steps 10 --server http://127.0.0.1:8000
"""

import argparse
import json
import os
import random
import tempfile

import torch
from addition import answer_reward, engine_config, make_problems
from transformers import PrinterCallback, TrainerCallback

from fp8engine import SamplingParams, default_model_path
from fp8engine.rl import RolloutClient, RolloutEngine
from fp8engine.rl.trl import make_rollout_func

COLUMNS = {"reward": "reward", "k3": "fp8engine/k3", "is_mean": "sampling/importance_sampling_ratio/mean",
           "is_min": "sampling/importance_sampling_ratio/min", "is_max": "sampling/importance_sampling_ratio/max",
           "loss": "loss", "weight_version": "fp8engine/weight_version", "step_seconds": "step_time",
           "sync_seconds": "fp8engine/sync_seconds", "rollout_seconds": "fp8engine/rollout_seconds"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--is-mode", default="token_truncate",
                   choices=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"))
    p.add_argument("--is-clip", type=float, default=2.0, help="TRL's vllm_importance_sampling_clip_max")
    p.add_argument("--server", help="URL of `fp8engine serve` (FP8 flags there); default: in-process")
    p.add_argument("--api-key")
    p.add_argument("--rollout", choices=("fp8", "bf16"), default="fp8", help="in-process engine mode")
    p.add_argument("--json", help="write per-step metrics to this file")
    p.add_argument("--png", help="plot reward and k3 per step into this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p.parse_args()


def addition_reward(completions: list[str], answer: list[int], **_) -> list[float]:
    return [answer_reward(text, a) for text, a in zip(completions, answer)]


def build_trainer(args: argparse.Namespace, rollouts, output_dir: str):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts, answers = make_problems(random.Random(args.seed), args.steps * args.prompts, args.max_operand)
    config = GRPOConfig(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n, max_completion_length=args.max_tokens, temperature=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=not torch.cuda.is_available(), bf16=False, activation_checkpointing=False,
        vllm_importance_sampling_mode=args.is_mode, vllm_importance_sampling_clip_max=args.is_clip,
        seed=args.seed, disable_tqdm=True)
    trainer = GRPOTrainer(model=default_model_path(), reward_funcs=addition_reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}),
                          rollout_func=make_rollout_func(rollouts, SamplingParams(stop=["\n"])),
                          callbacks=[PrintSteps()])
    trainer.remove_callback(PrinterCallback)  # PrintSteps prints a line per step instead of the whole log
    return trainer


def step_row(step: int, logs: dict) -> dict:
    """A training step's logs under COLUMNS' short names; step counts from 0."""
    return {"step": step - 1, **{short: logs.get(key) for short, key in COLUMNS.items()}}


class PrintSteps(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            print_row(step_row(state.global_step, logs))


def print_row(r: dict) -> None:
    rest = r["step_seconds"] - r["rollout_seconds"] - (r["sync_seconds"] or 0.0)
    print(f"step {r['step']:3d}  v{int(r['weight_version'])}  reward {r['reward']:.3f}  k3 {r['k3']:.2e}  "
          f"TRL IS ratio {r['is_mean']:.4f} [{r['is_min']:.3f}, {r['is_max']:.3f}]  loss {r['loss']:+.4f}  "
          f"step {r['step_seconds']:.1f}s = sync {r['sync_seconds'] or 0.0:.2f}s + rollout "
          f"{r['rollout_seconds']:.2f}s + train {rest:.2f}s", flush=True)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [r["reward"] for r in rows], marker="o")
    top.set_ylabel("mean reward")
    top.set_title(title, fontsize=10)
    bottom.plot(steps, [r["k3"] for r in rows], marker="o", color="tab:red")
    bottom.set_yscale("log")
    bottom.set_ylabel("mismatch k3 (engine vs trainer)")
    bottom.set_xlabel("GRPO step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    rollouts = (RolloutClient(args.server, args.api_key) if args.server
                else RolloutEngine(engine_config(args.rollout)))
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(args, rollouts, output_dir)
        trainer.train()
    rows = [step_row(entry["step"], entry) for entry in trainer.state.log_history if "reward" in entry]
    where = f"server {args.server}" if args.server else f"in-process {args.rollout.upper()}"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "steps": rows}, f, indent=1)
    if args.png:
        title = f"TRL GRPOTrainer + fp8engine\n{where} rollouts, TRL's IS {args.is_mode} C={args.is_clip}"
        plot(rows, args.png, title)


if __name__ == "__main__":
    main()
