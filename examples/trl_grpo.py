"""TRL's GRPOTrainer on fp8engine FP8 rollouts, or on TRL's own generation as the baseline: the default
model learns few-shot addition.

TRL trains the float32 policy. With `--generation fp8engine` (the default) fp8engine generates:
`make_rollout_func` syncs the policy into the engine each step (FP8 linear + FP8 KV, scales recomputed
for the new weights), samples n completions per prompt and hands TRL the engine's logprobs, on which
TRL's own importance-sampling correction runs (token_truncate with C = 2 here). With `--generation trl`
the same trainer (model, seed, dataset, GRPOConfig) has no rollout_func: TRL samples with transformers'
`generate` on the policy itself (use_vllm=False), so there is no sync and no mismatch to correct. Both
stop a completion at its first newline (fp8engine: stop=["\\n"]; transformers: every token holding a
newline is an end-of-sequence id of the policy's generation config, which TRL's completion mask follows).

Logged per step: reward, loss, the wall time of the step split into generation (engine rollout, or
transformers' generate), sync (fp8engine only) and training (the rest: TRL's logprob passes, reward,
backward, AdamW), and for fp8engine its mismatch k3 and TRL's IS ratio.

    python examples/trl_grpo.py --steps 30 --threads 1 --json examples/results/trl_grpo_fp8.json
    python examples/trl_grpo.py --steps 30 --threads 1 --generation trl --json examples/results/trl_grpo_hf.json
    python examples/trl_grpo.py --compare examples/results/trl_grpo_fp8.json examples/results/trl_grpo_hf.json \\
        --png examples/results/trl_grpo_compare.png
    fp8engine serve --quantization fp8 --kv-cache-dtype fp8_e4m3 --port 8000 &
    python examples/trl_grpo.py --steps 10 --server http://127.0.0.1:8000
"""

import argparse
import functools
import json
import os
import random
import tempfile
import time
from collections.abc import Callable

import torch
from addition import answer_reward, engine_config, make_problems
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

from fp8engine import SamplingParams, default_model_path
from fp8engine.rl import RolloutClient, RolloutEngine
from fp8engine.rl.trl import make_rollout_func

COLUMNS = {"reward": "reward", "k3": "fp8engine/k3", "is_mean": "sampling/importance_sampling_ratio/mean",
           "is_min": "sampling/importance_sampling_ratio/min", "is_max": "sampling/importance_sampling_ratio/max",
           "loss": "loss", "weight_version": "fp8engine/weight_version", "step_seconds": "step_time",
           "sync_seconds": "fp8engine/sync_seconds", "rollout_seconds": "fp8engine/rollout_seconds",
           "completion_length": "completions/mean_length"}
"""Short name -> TRL log key of a step's row (None where that run does not log it)."""
PHASES = ("generation", "sync", "training")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    p.add_argument("--generation", choices=("fp8engine", "trl"), default="fp8engine",
                   help="who generates: fp8engine through the rollout function, or TRL's own transformers "
                        "generation (the baseline)")
    p.add_argument("--server", help="URL of `fp8engine serve` (FP8 flags there); default: in-process")
    p.add_argument("--api-key")
    p.add_argument("--rollout", choices=("fp8", "bf16"), default="fp8", help="in-process engine mode")
    p.add_argument("--json", help="write per-step metrics to this file")
    p.add_argument("--png", help="plot reward, step time and k3 per step into this file")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="plot the runs of these --json files side by side into --png instead of training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--bf16", action="store_true",
                   help="TRL trains in BF16 mixed precision (GRPOConfig(bf16=True): autocast, float32 master)")
    p.add_argument("--no-stop", dest="stop", action="store_false",
                   help="completions do not stop at a newline: every one runs to --max-tokens (or EOS), the "
                        "long-rollout regime; the reward still reads the first integer")
    args = p.parse_args(argv)
    if args.compare and not args.png:
        p.error("--compare needs --png")
    return args


def addition_reward(completions: list[str], answer: list[int], **_) -> list[float]:
    return [answer_reward(text, a) for text, a in zip(completions, answer)]


def newline_token_ids(tokenizer) -> list[int]:
    """Ids of the tokens whose text holds a newline: where fp8engine's stop=["\\n"] ends a completion."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [i for i, text in enumerate(texts) if "\n" in text]


def load_policy(path: str, stop_at_newline: bool = True):
    """The float32 policy (as TRL loads a model path); with stop_at_newline a newline ends a completion
    like EOS does."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if not stop_at_newline:
        return model
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    model.generation_config.eos_token_id = eos + newline_token_ids(AutoTokenizer.from_pretrained(path))
    return model


def build_trainer(args: argparse.Namespace, rollouts, output_dir: str, steps: "StepLog"):
    """GRPOTrainer on the addition task; rollouts None: TRL's own generation (no rollout_func)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts, answers = make_problems(random.Random(args.seed), args.steps * args.prompts, args.max_operand)
    config = GRPOConfig(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n, max_completion_length=args.max_tokens, temperature=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=not torch.cuda.is_available(), bf16=args.bf16, activation_checkpointing=False,
        vllm_importance_sampling_mode=args.is_mode, vllm_importance_sampling_clip_max=args.is_clip,
        seed=args.seed, disable_tqdm=True)
    policy = load_policy(default_model_path(), stop_at_newline=args.stop)
    params = SamplingParams(stop=["\n"] if args.stop else None)
    rollout_func = None if rollouts is None else make_rollout_func(rollouts, params)
    trainer = GRPOTrainer(model=policy, reward_funcs=addition_reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}),
                          rollout_func=rollout_func, callbacks=[steps])
    trainer.remove_callback(PrinterCallback)  # StepLog prints a line per step instead of the whole log
    if rollouts is None:
        policy.generate = steps.timed(policy.generate)  # TRL generates with the policy itself
    return trainer


class StepLog(TrainerCallback):
    """A row per training step (`step_row`), printed as it comes: TRL's logs, the step's wall time
    (on_step_begin to on_step_end: generation, training and the optimizer) and the seconds spent in the
    functions wrapped by `timed` during it (transformers' generate in the baseline)."""

    def __init__(self, baseline: bool):
        self.baseline = baseline
        self.rows: list[dict] = []
        self._start = self._timed = 0.0
        self._wall: dict[int, tuple[float, float]] = {}

    def timed(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._timed += time.perf_counter() - start
        return wrapper

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._timed = time.perf_counter(), 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self._wall[state.global_step] = time.perf_counter() - self._start, self._timed

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            wall, timed = self._wall[state.global_step]
            self.rows.append(step_row(state.global_step, logs, wall, timed if self.baseline else None))
            print_row(self.rows[-1])


def step_row(step: int, logs: dict, wall: float, generate_seconds: float | None = None) -> dict:
    """A training step's logs under COLUMNS' short names (step counts from 0) and its wall time split into
    PHASES: generation is the engine's rollout, or `generate_seconds` where TRL generated."""
    row = {"step": step - 1, **{short: logs.get(key) for short, key in COLUMNS.items()}}
    generation = row["rollout_seconds"] if generate_seconds is None else generate_seconds
    sync = row["sync_seconds"] or 0.0
    return row | {"wall_seconds": wall, "generation_seconds": generation, "sync_seconds": sync,
                  "training_seconds": wall - generation - sync}


def print_row(r: dict) -> None:
    engine = (f"v{int(r['weight_version'])}  k3 {r['k3']:.2e}  TRL IS ratio {r['is_mean']:.4f} "
              f"[{r['is_min']:.3f}, {r['is_max']:.3f}]  " if r["k3"] is not None else "")
    print(f"step {r['step']:3d}  reward {r['reward']:.3f}  {engine}loss {r['loss']:+.4f}  step "
          f"{r['wall_seconds']:.1f}s = generation {r['generation_seconds']:.2f}s + sync {r['sync_seconds']:.2f}s "
          f"+ training {r['training_seconds']:.2f}s", flush=True)


def run_label(config: dict) -> str:
    if config.get("generation", "fp8engine") == "trl":
        return f"TRL generation (transformers, {'BF16 autocast' if config.get('bf16') else 'float32'})"
    where = "server" if config.get("server") else config["rollout"].upper()
    return f"fp8engine {where} rollouts, TRL's IS {config['is_mode']} C={config['is_clip']:g}"


def totals(rows: list[dict]) -> dict[str, float]:
    """Seconds summed over the steps: wall and each of PHASES."""
    return {key: sum(r[f"{key}_seconds"] for r in rows) for key in ("wall", *PHASES)}


def plot(runs: list[dict], path: str) -> None:
    """Reward per step (5-step mean, faint: per step), the wall time of each step split into PHASES (a bar
    per run), and fp8engine's mismatch k3 where a run has it; the runs (--json files) side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plot_grpo import moving_average

    with_k3 = [run for run in runs if any(r["k3"] is not None for r in run["steps"])]
    fig, axes = plt.subplots(2 + bool(with_k3), 1, figsize=(9, 1 + 3.2 * (2 + bool(with_k3))), sharex=True)
    reward_ax, time_ax = axes[:2]
    width = 0.8 / len(runs)
    for j, run in enumerate(runs):
        rows, color, label = run["steps"], f"C{j}", run_label(run["config"])
        steps = [r["step"] for r in rows]
        rewards = [r["reward"] for r in rows]
        reward_ax.plot(steps, moving_average(rewards, 5), color=color, label=label)
        reward_ax.plot(steps, rewards, color=color, alpha=0.25, marker=".", linewidth=0.8)
        total = totals(rows)
        x = [s + (j - (len(runs) - 1) / 2) * width for s in steps]
        bottom = [0.0] * len(rows)
        for phase, alpha in zip(PHASES, (1.0, 0.35, 0.6)):
            heights = [r[f"{phase}_seconds"] for r in rows]
            time_ax.bar(x, heights, width, bottom=bottom, color=color, alpha=alpha,
                        hatch="//" if phase == "sync" else None,
                        label=f"{phase}: {total[phase]:.0f} s")
            bottom = [b + h for b, h in zip(bottom, heights)]
    reward_ax.set(ylabel="mean reward", title="reward (5-step mean; faint: per step)")
    time_ax.set(ylabel="seconds", title="wall time per step: generation (solid), sync (hatched), training; "
                                        "legend: sums")
    reward_ax.legend(fontsize=8)
    time_ax.legend(fontsize=7, ncol=2)
    if with_k3:
        for j, run in enumerate(runs):
            if run in with_k3:
                axes[2].plot([r["step"] for r in run["steps"]], [r["k3"] for r in run["steps"]], marker="o",
                             color=f"C{j}", label=run_label(run["config"]))
        axes[2].set(yscale="log", ylabel="mismatch k3", title="fp8engine logprobs vs TRL's (k3 per token)")
    axes[-1].set_xlabel("GRPO step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(plot_title(runs), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_title(runs: list[dict]) -> str:
    """The setting, each run's summed step wall time and, for two runs, the first one's speedup."""
    config = runs[0]["config"]
    title = (f"TRL GRPOTrainer, default model, addition task: {len(runs[0]['steps'])} steps x "
             f"{config['prompts']} prompts x n={config['n']}, seed {config['seed']}")
    walls = [totals(run["steps"])["wall"] for run in runs]
    title += "".join(f"\n{run_label(run['config'])}: {wall:.0f} s" for run, wall in zip(runs, walls))
    if len(runs) == 2:
        title += f"\nend-to-end speedup of the first run (summed step wall times): {walls[1] / walls[0]:.2f}x"
    return title


def train(args: argparse.Namespace) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    rollouts = None
    if args.generation == "fp8engine":
        rollouts = (RolloutClient(args.server, args.api_key) if args.server
                    else RolloutEngine(engine_config(args.rollout)))
    steps = StepLog(baseline=rollouts is None)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(args, rollouts, output_dir, steps)
        start = time.perf_counter()
        trainer.train()
    total = totals(steps.rows)
    print(f"{run_label(vars(args))}: {len(steps.rows)} steps in {time.perf_counter() - start:.0f} s; summed steps "
          + ", ".join(f"{key} {seconds:.1f} s" for key, seconds in total.items()))
    return {"config": vars(args), "totals": total, "steps": steps.rows}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare:
        runs = []
        for path in args.compare:
            with open(path) as f:
                runs.append(json.load(f))
        plot(runs, args.png)
        for run in runs:
            print(f"{run_label(run['config'])}: " + ", ".join(
                f"{key} {seconds:.1f} s" for key, seconds in totals(run["steps"]).items()))
        return
    run = train(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    if args.png:
        plot([run], args.png)


if __name__ == "__main__":
    main()
