"""GRPO on CPU with FP8 rollouts: the default model learns few-shot addition.

Each step: sync the float32 policy into the engine (FP8 linear + FP8 KV, scales recomputed for
the new weights) -> rollout n samples per prompt at T=1 -> trainer logprobs with the engine's
semantics -> GRPO loss (group-normalised advantages, token-level policy gradient, token TIS
weights C=2 as detached multipliers) -> AdamW step.

Exact mode (the default): the engine runs batch invariant and the trainer's logprobs are the engine's
own replay of the batch (response_logprobs(..., exact=True)), so they equal the rollout's bit for bit
(k3 = 0) while the gradient is still the float32 policy's. The trainer then optimises the policy the
engine holds (BF16-rounded or FP8-quantized weights), not a float32 master the engine cannot represent.
--no-exact trains on the float32 policy's own logprobs, corrected by TIS. --stochastic-rounding rounds
the float32 master to BF16 stochastically at each sync (unbiased: the engine tracks the master in
expectation, where round-to-nearest ignores Adam's sub-ulp steps).

The task is a verifiable reward: the prompt is a few-shot addition table ending in "a+b=", the
answer is the first integer of the response, reward 1 if it equals a+b.

    python examples/grpo_tiny.py --smoke                       # 2 tiny steps, < 2 minutes
    python examples/grpo_tiny.py --steps 30 --json examples/results/fp8_tis.json
    python examples/grpo_tiny.py --steps 30 --no-tis --json examples/results/fp8_no_tis.json
    python examples/grpo_tiny.py --steps 30 --rollout bf16 --json examples/results/bf16_tis.json
    python examples/grpo_tiny.py --steps 30 --no-exact --json examples/results/fp8_tis.json   # the float32 trainer
    python examples/plot_grpo.py examples/results/*.json --out examples/results/grpo_tiny.png
"""

import argparse
import json
import random
import time

import torch
from addition import answer_reward, engine_config, make_problems
from transformers import AutoModelForCausalLM

from fp8engine import SamplingParams, default_model_path
from fp8engine.rl import RolloutBatch, RolloutEngine, correction, response_logprobs

TIS_CLIP = 2.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="2 steps, 2 prompts, n=2, 16 tokens")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--no-tis", action="store_true", help="plain policy gradient, no TIS weights")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                   help="trainer logprobs replayed by the batch-invariant engine (equal to the rollout's); "
                        "--no-exact: the float32 policy's own logprobs")
    p.add_argument("--stochastic-rounding", action="store_true",
                   help="sync the float32 master as BF16 rounded stochastically (seeded per step)")
    p.add_argument("--rollout", choices=("fp8", "bf16"), default="fp8",
                   help="fp8: FP8 linear + FP8 KV (recomputed scales); bf16: plain engine")
    p.add_argument("--eval-every", type=int, default=5,
                   help="greedy accuracy on a fixed held-out set every k steps and at the end (0: off)")
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--json", help="write per-step metrics to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.prompts, args.n, args.max_tokens, args.eval_prompts = 2, 2, 2, 16, 4
    return args


def rewards(batch: RolloutBatch, answers: list[int]) -> torch.Tensor:
    """[B] float32: 1 where the response's first integer is the answer of its prompt."""
    return torch.tensor([answer_reward(text, answers[i // batch.n]) for i, text in enumerate(batch.response_texts)])


def evaluate(engine: RolloutEngine, prompts: list[str], answers: list[int], max_tokens: int) -> float:
    """Greedy accuracy of the engine's current weights on held-out problems."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["\n"])
    return rewards(engine.rollout(prompts, n=1, sampling_params=params), answers).mean().item()


def group_advantages(reward: torch.Tensor, n: int) -> torch.Tensor:
    """[B] GRPO advantages: reward standardised within each prompt's group of n samples."""
    groups = reward.view(-1, n)
    adv = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)
    return adv.view(-1)


def stochastic_bf16(model: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The model's float32 parameters as BF16, each rounded up with probability equal to the dropped
    fraction of an ulp (unbiased), from random 16-bit noise added to the dropped bits."""
    out = {}
    for name, param in model.state_dict().items():
        bits = param.detach().float().contiguous().view(torch.int32)
        noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32)
        out[name] = (((bits + noise) >> 16) << 16).view(torch.float32).to(torch.bfloat16)
    return out


def train_step(policy, optimizer, batch: RolloutBatch, params: SamplingParams, reward: torch.Tensor,
               use_tis: bool, exact: bool) -> dict[str, float]:
    """One GRPO update; returns the loss and the train/rollout mismatch metrics."""
    mask = batch.response_mask
    train_lp = response_logprobs(policy, batch, params, exact=exact)
    weights = (correction.token_tis_weights(train_lp, batch.rollout_logprobs, mask, clip=TIS_CLIP)
               if use_tis else mask.float())
    adv = group_advantages(reward, batch.n)[:, None]
    loss = -(weights * adv * train_lp).sum() / mask.sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    metrics = correction.mismatch_metrics(train_lp.detach(), batch.rollout_logprobs, mask)
    return {"loss": loss.item(), "grad_norm": grad_norm.item(), **metrics}


def step_record(step: int, reward: torch.Tensor, batch: RolloutBatch, train: dict,
                seconds: dict[str, float]) -> dict:
    k_scales = [k for k, _ in batch.stats["kv_scales"].values()]
    return {
        "step": step, "reward_mean": reward.mean().item(),
        "response_len_mean": batch.response_lengths.float().mean().item(),
        **{k: train[k] for k in ("loss", "grad_norm", "k1", "k3", "is_mean", "is_std", "clip_frac",
                                 "ess", "mean_abs_ratio_dev", "ppl_ratio")},
        "preemptions_total": batch.stats["preemptions_total"],
        "preemptions_max": batch.stats["preemptions_max"],
        "rollout_tokens_per_s": batch.stats["tokens_per_s"],
        "k_scale_mean": sum(k_scales) / len(k_scales),
        **{f"{phase}_seconds": value for phase, value in seconds.items()},
    }


def print_record(r: dict) -> None:
    total = r["sync_seconds"] + r["rollout_seconds"] + r["train_seconds"]
    print(f"step {r['step']:3d}  reward {r['reward_mean']:.3f}  k1 {r['k1']:+.2e}  k3 {r['k3']:.2e}  "
          f"IS {r['is_mean']:.3f}±{r['is_std']:.3f} clip {r['clip_frac']:.3f}  "
          f"preempt {r['preemptions_total']} (max {r['preemptions_max']})  "
          f"sync {r['sync_seconds']:.2f}s  rollout {r['rollout_tokens_per_s']:.0f} tok/s  "
          f"time {total:.1f}s = sync {r['sync_seconds'] / total:.0%} / rollout "
          f"{r['rollout_seconds'] / total:.0%} / train {r['train_seconds'] / total:.0%}", flush=True)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    held_out = make_problems(random.Random(args.seed + 1), args.eval_prompts, args.max_operand)
    policy = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    engine = RolloutEngine(engine_config(args.rollout, exact=args.exact))
    rounding = torch.Generator().manual_seed(args.seed)
    records, evals = [], []
    for step in range(args.steps + 1):
        weights = stochastic_bf16(policy, rounding) if args.stochastic_rounding else policy
        sync = engine.sync_weights(weights, weight_version=step)
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            evals.append({"step": step, "accuracy": evaluate(engine, *held_out, args.max_tokens)})
            print(f"eval  step {step:3d}  greedy accuracy {evals[-1]['accuracy']:.3f}", flush=True)
        if step == args.steps:
            break
        prompts, answers = make_problems(rng, args.prompts, args.max_operand)
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop=["\n"],
                                seed=args.seed * 1_000_003 + step * args.n)
        start = time.perf_counter()
        batch = engine.rollout(prompts, n=args.n, sampling_params=params)
        rollout_seconds = time.perf_counter() - start
        reward = rewards(batch, answers)
        start = time.perf_counter()
        train = train_step(policy, optimizer, batch, params, reward, not args.no_tis, args.exact)
        seconds = {"sync": sync.seconds, "rollout": rollout_seconds, "train": time.perf_counter() - start}
        records.append(step_record(step, reward, batch, train, seconds))
        print_record(records[-1])
        if args.json:
            write_json(args, records, evals)
    if args.json:
        write_json(args, records, evals)


def write_json(args: argparse.Namespace, records: list[dict], evals: list[dict]) -> None:
    config = vars(args) | {"label": label(args)}
    with open(args.json, "w") as f:
        json.dump({"config": config, "steps": records, "evals": evals}, f, indent=1)


def label(args: argparse.Namespace) -> str:
    if args.exact:
        return f"{args.rollout.upper()} rollout, exact" + (" + SR" if args.stochastic_rounding else "")
    return f"{args.rollout.upper()} rollout" + (", no TIS" if args.no_tis else " + TIS") \
        + (" + SR" if args.stochastic_rounding else "")


if __name__ == "__main__":
    main()
