"""Reward, held-out accuracy and mismatch k3 curves of several grpo_tiny.py runs in one PNG.

    python examples/plot_grpo.py examples/results/fp8_tis.json examples/results/fp8_no_tis.json \\
        examples/results/bf16_tis.json --out examples/results/grpo_tiny.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


LINE_STYLES = ("-", "--", ":", "-.")


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (shorter at the start)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i + 1 - window):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot(runs: list[dict], out: str, window: int) -> None:
    """One panel each for training reward, held-out accuracy and k3; a colour per configuration
    (the run's label), a line style per seed."""
    fig, (reward_ax, eval_ax, k3_ax) = plt.subplots(1, 3, figsize=(17, 4.8))
    colors: dict[str, str] = {}
    seeds = sorted({run["config"]["seed"] for run in runs})
    for run in runs:
        config, steps, evals = run["config"], run["steps"], run.get("evals", [])
        color = colors.setdefault(config["label"], f"C{len(colors)}")
        style = dict(color=color, linestyle=LINE_STYLES[seeds.index(config["seed"]) % len(LINE_STYLES)],
                     label=f"{config['label']}, seed {config['seed']}")
        x = [s["step"] for s in steps]
        rewards = [s["reward_mean"] for s in steps]
        reward_ax.plot(x, moving_average(rewards, window), **style)
        reward_ax.plot(x, rewards, color=color, alpha=0.15, linewidth=0.8)
        eval_ax.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], marker="o", **style)
        k3_ax.plot(x, moving_average([s["k3"] for s in steps], window), **style)
    reward_ax.set(title=f"training reward ({window}-step mean; faint: per step)", xlabel="step",
                  ylabel="mean reward")
    eval_ax.set(title="greedy accuracy on held-out problems (rollout engine)", xlabel="step",
                ylabel="accuracy")
    k3_ax.set(title=f"train/rollout mismatch k3 ({window}-step mean)", xlabel="step",
              ylabel="k3 (nats/token; 0 in exact mode)")
    k3_ax.set_yscale("symlog", linthresh=1e-3)  # exact-mode runs sit at 0
    for ax in (reward_ax, eval_ax, k3_ax):
        ax.grid(alpha=0.3)
    eval_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="JSON files written by grpo_tiny.py --json")
    p.add_argument("--out", default="examples/results/grpo_tiny.png")
    p.add_argument("--window", type=int, default=5, help="moving-average window of the reward (steps)")
    args = p.parse_args()
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    plot(runs, args.out, args.window)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
