"""GRPO on a multi-turn tool task: the default model learns to use a calculator the environment runs.

Each episode: the user asks for a product a*b; on the first turn the model must call `calc` (a forced call: its
arguments follow the tool's schema, SamplingParams(grammar=...)); the environment evaluates the expression and
answers with a tool message; the model then answers in text. Reward: 1 when the answer contains a*b, 0.3 when
only the call computed it. Episodes come from fp8engine.rl.episodes.rollout_episodes, so the trainer sees the
exact token history (prompt, both model turns, the tool result between them) and trains on model tokens only
(response_mask), with token-level TIS (C=2) against the engine's FP8 rollout logprobs (raw mode: the grammar's
mask is not part of the policy the trainer differentiates).

    python examples/agent_grpo.py --smoke                                   # 2 tiny steps
    python examples/agent_grpo.py --steps 20 --json examples/results/agent_grpo.json \\
        --png examples/results/agent_grpo.png
"""

import argparse
import json
import random
import time

import torch
from grpo_tiny import group_advantages
from transformers import AutoModelForCausalLM

from fp8engine import EngineConfig, SamplingParams, default_model_path
from fp8engine.rl import RolloutBatch, RolloutEngine, correction, response_logprobs
from fp8engine.rl.episodes import rollout_episodes
from fp8engine.tools import forced_call_grammar

TIS_CLIP = 2.0
CALC = {"type": "function", "function": {
    "name": "calc", "description": "evaluate an arithmetic expression of integers with + - *",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string", "pattern": "^[0-9+*-]{1,12}$"}},
                   "required": ["expr"], "additionalProperties": False}}}


class Calculator:
    """One product to compute; the environment runs the model's calc calls."""

    tools = [CALC]

    def reset(self, prompt: tuple[int, int]) -> list[dict]:
        self.a, self.b = prompt
        self.computed = False
        return [{"role": "user", "content": f"What is {self.a}*{self.b}? Call calc, then give the answer."}]

    def step(self, turn):
        if turn.tool_calls:
            result = calc(turn.tool_calls[0].arguments)
            self.computed |= result == str(self.a * self.b)
            return [{"role": "tool", "tool_call_id": turn.tool_calls[0].id, "content": result}], 0.0, False
        right = str(self.a * self.b) in turn.content
        return None, 1.0 if right else 0.3 if self.computed else 0.0, True


def calc(arguments: str) -> str:
    """The calc tool: its call's arguments (JSON text) evaluated, or an error message; only digits and + - *."""
    try:
        expr = json.loads(arguments).get("expr")
        if not isinstance(expr, str) or not expr or set(expr) - set("0123456789+-*") or "**" in expr:
            return "error: not an expression of integers with + - *"
        return str(eval(expr, {"__builtins__": {}}, {}))
    except (AttributeError, SyntaxError, ValueError):
        return "error: not an expression"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="2 steps, 2 prompts, n=2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="episodes per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per model turn")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--json", help="write per-step metrics to this file")
    p.add_argument("--png", help="plot reward and turns per step to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.prompts, args.n, args.max_tokens = 2, 2, 2, 40
    return args


def turn_params(turn: int, seed: int, max_tokens: int) -> SamplingParams:
    """The first turn is a forced calc call; the second a free answer."""
    forced = forced_call_grammar("hermes", [CALC], "calc") if turn == 0 else None
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, grammar=forced, logprobs_mode="raw")


def train_step(policy, optimizer, batch: RolloutBatch) -> dict[str, float]:
    mask = batch.response_mask
    train_lp = response_logprobs(policy, batch, SamplingParams(temperature=1.0, logprobs_mode="raw"))
    weights = correction.token_tis_weights(train_lp, batch.rollout_logprobs, mask, clip=TIS_CLIP)
    adv = group_advantages(batch.rewards, batch.n)[:, None]
    loss = -(weights * adv * train_lp).sum() / mask.sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    return {"loss": loss.item(), **correction.mismatch_metrics(train_lp.detach(), batch.rollout_logprobs, mask)}


def plot(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in records]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(steps, [r["reward_mean"] for r in records], marker="o")
    left.set(xlabel="step", ylabel="mean reward", title="reward")
    right.plot(steps, [r["turns_mean"] for r in records], marker="o", color="tab:orange")
    right.set(xlabel="step", ylabel="model turns per episode", title="turns")
    fig.suptitle("agent GRPO: calculator tool, FP8 rollouts (SmolLM2-135M)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    policy = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    rollouts = RolloutEngine(EngineConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3", kv_scale_mode="recompute",
                                          kv_cache_memory_bytes=256 << 20, seed=args.seed))
    records = []
    for step in range(args.steps):
        start = time.perf_counter()
        rollouts.sync_weights(policy, weight_version=step)
        synced = time.perf_counter()
        problems = [(rng.randint(11, 49), rng.randint(3, 29)) for _ in range(args.prompts)]
        batch = rollout_episodes(rollouts, Calculator, problems, n=args.n, max_turns=args.max_turns,
                                 sampling_params=lambda turn, s=step: turn_params(turn, args.seed * 1000 + s,
                                                                                  args.max_tokens))
        rolled = time.perf_counter()
        metrics = train_step(policy, optimizer, batch)
        record = {"step": step, "reward_mean": batch.rewards.mean().item(),
                  "turns_mean": batch.num_turns.float().mean().item(), "model_tokens": batch.stats["model_tokens"],
                  "observation_tokens": batch.stats["observation_tokens"],
                  "prefill_tokens": sum(batch.stats["prefill_tokens_by_turn"]),
                  "prompt_tokens": sum(batch.stats["prompt_tokens_by_turn"]), "loss": metrics["loss"],
                  "k3": metrics["k3"], "sync_seconds": synced - start, "rollout_seconds": rolled - synced,
                  "train_seconds": time.perf_counter() - rolled}
        records.append(record)
        print(f"step {step:3d}  reward {record['reward_mean']:.3f}  turns {record['turns_mean']:.2f}  "
              f"k3 {record['k3']:.2e}  prefill {record['prefill_tokens']}/{record['prompt_tokens']} prompt tokens  "
              f"rollout {record['rollout_seconds']:.1f}s  train {record['train_seconds']:.1f}s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "steps": records}, f, indent=1)
    if args.png:
        plot(records, args.png)


if __name__ == "__main__":
    main()
