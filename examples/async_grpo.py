"""Asynchronous GRPO: the engine never stops generating while the trainer trains and syncs.

The addition task of grpo_tiny.py (a few-shot table ending in "a+b=", reward 1 when the first integer
of the response is a+b), with the engine in its own process (`fp8engine serve`, FP8 linear + FP8 KV
with scales recomputed for every weight version) and the trainer in this one, one CPU thread each.

Async (the default): a thread streams prompt groups through the server without pause
(`RolloutClient.stream`, at most --groups-in-flight groups generating, at most --queue finished groups
waiting for the trainer). The trainer takes the next --prompts finished groups, trains on them with
token-level TIS (C=2) against the per-token behaviour logprobs, whatever version sampled each token,
and syncs with `in_flight="keep"`: the groups in flight go on, their next tokens come from the new
weights, and `token_weight_versions` says which version sampled which token (the staleness metric).
Weights travel by a gloo broadcast (RolloutClient.use_weights_update_group; --sync-via http: safetensors buckets).
--sync: the same loop, one rollout at a time (the engine idles while the trainer trains, the trainer
idles while the engine generates).

    python examples/async_grpo.py --smoke                                  # 2 tiny steps of each mode
    python examples/async_grpo.py --steps 30 --json examples/results/async_grpo.json
    python examples/async_grpo.py --steps 30 --sync --json examples/results/sync_grpo.json
    # long-tailed responses, DAPO's dynamic sampling, a BF16-autocast trainer: where async pays (docs/async-rl.md)
    python examples/async_grpo.py --steps 30 --stop paragraph --max-tokens 128 --trainer-dtype bfloat16 \
        --dynamic-sampling [--sync] --json examples/results/async_grpo_long.json
    python examples/async_grpo.py --plot examples/results/sync_grpo.json examples/results/async_grpo.json \\
        --out examples/results/async_grpo.png
"""

import argparse
import contextlib
import itertools
import json
import math
import os
import queue
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import torch
from addition import answer_reward, make_problems
from grpo_tiny import group_advantages
from transformers import AutoModelForCausalLM

from fp8engine import SamplingParams, default_model_path
from fp8engine.bench.serve_load import server_process
from fp8engine.rl import RolloutBatch, RolloutClient, correction, response_logprobs
from fp8engine.rl.batch import concat, micro_batches

TIS_CLIP = 2.0
STOPS = {"line": "\n", "paragraph": "\n\n"}
ENGINE_FLAGS = ["--dtype", "bfloat16", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3",
                "--kv-scale-mode", "recompute", "--kv-cache-memory-bytes", str(256 << 20)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sync", action="store_true", help="synchronous: rollout, train, sync, one after another")
    p.add_argument("--smoke", action="store_true", help="2 steps, 2 prompts, n=2, 16 eval prompts")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=4, help="prompt groups per training step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stop", choices=tuple(STOPS), default="line",
                   help="where a training response ends: its first line break (a few tokens), or a blank line "
                        "(paragraph: lengths from a few tokens to --max-tokens, the long tail of RL rollouts)")
    p.add_argument("--trainer-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: the trainer's decoder under BF16 autocast (float32 weights, optimizer and head)")
    p.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO's dynamic sampling: drop groups whose rewards are all equal (no gradient) and train "
                        "on the next --prompts groups that differ")
    p.add_argument("--max-sampling-rounds", type=int, default=10,
                   help="dynamic sampling: a step draws at most this many --prompts' worth of groups, then trains on "
                        "what it kept (nothing, when every group's rewards were equal) instead of drawing forever "
                        "from a model that solves every problem or none (DAPO's max_num_gen_batches)")
    p.add_argument("--micro-batch-tokens", type=int, default=2048,
                   help="the trainer's micro-batches: at most this many padded positions, rows of similar length")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--groups-in-flight", type=int, default=None,
                   help="async: groups generating at once (default: one training step's worth)")
    p.add_argument("--queue", type=int, default=None,
                   help="async: finished groups waiting for the trainer at most (default: one step's worth); "
                        "with --groups-in-flight it bounds the staleness")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out problems, greedy, before and after")
    p.add_argument("--sync-via", choices=("group", "http"), default="group",
                   help="weights to the engine by a gloo broadcast (RolloutClient.use_weights_update_group) "
                        "or as safetensors over HTTP")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the trainer and of the engine each")
    p.add_argument("--json", help="write the run's per-step metrics and totals to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", nargs="+", metavar="JSON", help="plot these runs' JSON files (no training)")
    p.add_argument("--out", default="examples/results/async_grpo.png", help="the PNG --plot writes")
    args = p.parse_args()
    if args.max_sampling_rounds < 1:
        p.error(f"--max-sampling-rounds must be at least 1, got {args.max_sampling_rounds}")
    if args.smoke:
        args.steps, args.prompts, args.n, args.eval_prompts = 2, 2, 2, 16
    args.groups_in_flight = args.groups_in_flight or args.prompts
    args.queue = args.queue or args.prompts
    return args


class Problems:
    """An endless source of addition prompts; remembers each prompt's answer (thread-safe reads)."""

    def __init__(self, seed: int, max_operand: int):
        self.rng, self.max_operand, self.answers = random.Random(seed), max_operand, {}

    def __iter__(self) -> Iterator[str]:
        while True:
            (prompt,), (answer,) = make_problems(self.rng, 1, self.max_operand)
            self.answers[prompt] = answer
            yield prompt

    def take(self, count: int) -> list[str]:
        return list(itertools.islice(self, count))


def rewards(batch: RolloutBatch, answers: dict[str, int]) -> torch.Tensor:
    """[B] float32: 1 where the response's first integer is the answer of its group's prompt."""
    return torch.tensor([answer_reward(text, answers[batch.group_prompts[i // batch.n]])
                         for i, text in enumerate(batch.response_texts)])


def train_step(policy, optimizer, batch: RolloutBatch, params: SamplingParams, reward: torch.Tensor,
               version: int, micro_batch_tokens: int, autocast: bool) -> dict[str, float]:
    """One GRPO update with token TIS against each token's behaviour logprob; the mismatch and the
    staleness (versions behind `version`, the weights being trained) of the rows trained.

    Rows with advantage 0 (groups whose rewards are all equal) add nothing to the loss, so they are not run;
    the others run in micro-batches of similar length (gradients accumulated), not padded to the longest
    response of the step. autocast: the decoder in BF16 (the weights and the head stay float32)."""
    advantages = group_advantages(reward, batch.n)
    rows = advantages.nonzero().view(-1)
    mask = batch.response_mask[rows]
    total = mask.sum().clamp(min=1)
    parts = []
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for part_rows, part in micro_batches(batch, micro_batch_tokens, rows):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            train_lp = response_logprobs(policy, part, params)
        weights = correction.token_tis_weights(train_lp, part.rollout_logprobs, part.response_mask, clip=TIS_CLIP)
        loss = -(weights * advantages[part_rows, None] * train_lp).sum() / total
        loss.backward()
        loss_sum += loss.item()
        parts.append((part_rows, train_lp.detach()))
    if not parts:  # every group's rewards were equal: nothing to learn from this step
        return {"loss": 0.0, "rows_trained": 0, "k3": float("nan"),
                **correction.staleness(batch.token_weight_versions, batch.response_mask, version)}
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    train_lp = torch.zeros(batch.response_mask.shape)
    for part_rows, lp in parts:
        train_lp[part_rows, :lp.shape[1]] = lp
    return {"loss": loss_sum, "rows_trained": len(rows), **correction.mismatch_metrics(
        train_lp[rows], batch.rollout_logprobs[rows], mask, batch.token_weight_versions[rows], version)}


def float32_head(policy) -> None:
    """Keep the LM head (and so the logprobs) in float32 under BF16 autocast: a logit of 20 in BF16 is off by
    up to 0.06, more than the mismatch TIS corrects for."""
    head = policy.get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return torch.nn.functional.linear(hidden.float(), head.weight, head.bias)

    head.forward = forward


def evaluate(client: RolloutClient, problems: tuple[list[str], list[int]], max_tokens: int) -> float:
    """Greedy accuracy of the engine's current weights on the held-out problems."""
    prompts, answers = problems
    batch = client.rollout(prompts, n=1, sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                         stop=["\n"]))
    return rewards(batch, dict(zip(prompts, answers))).mean().item()


class Streamer:
    """Async mode: a thread that streams groups into a bounded queue until closed."""

    def __init__(self, client: RolloutClient, problems: Problems, n: int, params: SamplingParams,
                 groups_in_flight: int, queue_size: int):
        self.groups: queue.Queue[RolloutBatch | BaseException] = queue.Queue(maxsize=queue_size)
        self.stopped = threading.Event()
        self._stream = client.stream(problems, n=n, sampling_params=params, max_groups_in_flight=groups_in_flight)
        self._thread = threading.Thread(target=self._run, name="rollout-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for group in self._stream:
                while not self.stopped.is_set():
                    with contextlib.suppress(queue.Full):
                        self.groups.put(group, timeout=0.1)
                        break
                if self.stopped.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 (handed to the trainer)
            self.groups.put(exc)
        finally:
            self._stream.close()  # disconnects the groups still generating: the server aborts them

    def take(self, count: int, keep: Callable[[RolloutBatch], RolloutBatch | None],
             max_groups: int) -> tuple[list[RolloutBatch], int]:
        """The next `count` finished groups that `keep` keeps, drawing at most `max_groups`, and how many it
        dropped; when it kept none, the last group drawn (which trains nothing)."""
        out, dropped, item = [], 0, None
        while len(out) < count and dropped + len(out) < max_groups:
            item = self.groups.get()
            if isinstance(item, BaseException):
                raise RuntimeError("the rollout stream failed") from item
            kept = keep(item)
            dropped += kept is None
            out += [kept] if kept is not None else []
        return out or [item], dropped

    def close(self) -> None:
        self.stopped.set()
        self._thread.join(timeout=120)


def run(args: argparse.Namespace, client: RolloutClient) -> dict:
    torch.manual_seed(args.seed)
    problems = Problems(args.seed, args.max_operand)
    held_out = make_problems(random.Random(args.seed + 1), args.eval_prompts, args.max_operand)
    policy = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    if args.trainer_dtype == "bfloat16":
        float32_head(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop=[STOPS[args.stop]])
    client.sync_weights(policy, weight_version=0)
    accuracy_before = evaluate(client, held_out, args.max_tokens)
    print(f"{'sync' if args.sync else 'async'}: held-out greedy accuracy at step 0: {accuracy_before:.3f}", flush=True)
    def keep(batch: RolloutBatch) -> RolloutBatch | None:
        """The batch's groups worth training on: all of them, or (dynamic sampling) those whose rewards differ."""
        if not args.dynamic_sampling:
            return batch
        grouped = rewards(batch, problems.answers).view(-1, batch.n)
        informative = (grouped != grouped[:, :1]).any(-1).repeat_interleave(batch.n).nonzero().view(-1)
        return batch.select(informative) if informative.numel() else None

    records = []
    engine_start = client.get_stats()
    start = time.perf_counter()
    streamer = None if args.sync else Streamer(client, problems, args.n, params, args.groups_in_flight, args.queue)
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            if streamer is None:  # one rollout, or (dynamic sampling) rollouts of the groups still missing
                groups, dropped, have = [], 0, 0
                for _ in range(args.max_sampling_rounds):
                    rollout = client.rollout(problems.take(args.prompts - have), n=args.n, sampling_params=params)
                    kept = keep(rollout)
                    got = kept.batch_size // args.n if kept is not None else 0
                    groups += [kept] if kept is not None else []
                    dropped, have = dropped + args.prompts - have - got, have + got
                    if have == args.prompts:
                        break
                groups = groups or [rollout]  # nothing kept: its groups train nothing (advantage 0)
            else:
                groups, dropped = streamer.take(args.prompts, keep, args.max_sampling_rounds * args.prompts)
            batch = concat(groups)
            t1 = time.perf_counter()
            reward = rewards(batch, problems.answers)
            train = train_step(policy, optimizer, batch, params, reward, step, args.micro_batch_tokens,
                               args.trainer_dtype == "bfloat16")
            t2 = time.perf_counter()
            sync = client.sync_weights(policy, weight_version=step + 1, in_flight="wait" if args.sync else "keep")
            t3 = time.perf_counter()
            records.append({"step": step, "reward_mean": reward.mean().item(),
                            "tokens": int(batch.response_mask.sum()), "groups_dropped": dropped,
                            "wait_seconds": t1 - t0,
                            "train_seconds": t2 - t1, "sync_seconds": t3 - t2, "sync_bytes": sync.num_bytes, **train})
            r = records[-1]
            print(f"step {step:3d}  reward {r['reward_mean']:.3f}  k3 {r['k3']:.2e}  staleness mean "
                  f"{r['staleness_mean']:.2f} max {r['staleness_max']:.0f}  wait {r['wait_seconds']:.2f}s  "
                  f"train {r['train_seconds']:.2f}s ({r['rows_trained']} rows, {r['tokens']} tokens, "
                  f"{dropped} groups dropped)  sync {r['sync_seconds']:.2f}s", flush=True)
    finally:
        if streamer is not None:
            streamer.close()
    wall = time.perf_counter() - start
    engine_end = client.get_stats()
    accuracy_after = evaluate(client, held_out, args.max_tokens)
    trained_tokens = sum(r["tokens"] for r in records)
    totals = {
        "wall_seconds": wall,
        "engine_idle_fraction": 1 - (engine_end.step_seconds_total - engine_start.step_seconds_total) / wall,
        "trainer_idle_fraction": sum(r["wait_seconds"] for r in records) / wall,
        "trained_tokens_per_s": trained_tokens / wall,
        "generated_tokens_per_s": (engine_end.num_generation_tokens_total
                                   - engine_start.num_generation_tokens_total) / wall,
        "held_out_accuracy_before": accuracy_before, "held_out_accuracy_after": accuracy_after,
        "k3_mean": statistics.fmean(k3s) if (k3s := [r["k3"] for r in records if not math.isnan(r["k3"])])
        else math.nan,
        "staleness_max": max(r["staleness_max"] for r in records),
        "staleness_mean": sum(r["staleness_mean"] * r["tokens"] for r in records) / trained_tokens,
        "kv_rescale_seconds": engine_end.kv_rescale_seconds_total - engine_start.kv_rescale_seconds_total,
    }
    print(json.dumps(totals, indent=1), flush=True)
    config = {k: v for k, v in vars(args).items() if k not in ("plot", "out")}
    return {"config": config | {"label": "sync" if args.sync else "async (in_flight=keep)"},
            "steps": records, "totals": totals}


def plot(paths: list[str], out: str) -> None:
    """Reward, k3 and staleness per step of each run, one panel each; wall times in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [json.load(open(path)) for path in paths]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for run_ in runs:
        steps = [r["step"] for r in run_["steps"]]
        totals = run_["totals"]
        label = (f"{run_['config']['label']}: {totals['wall_seconds']:.0f} s, held-out "
                 f"{totals['held_out_accuracy_before']:.2f} -> {totals['held_out_accuracy_after']:.2f}")
        for ax, key in zip(axes, ("reward_mean", "k3", "staleness_mean")):
            ax.plot(steps, [r[key] for r in run_["steps"]], label=label)
    for ax, title in zip(axes, ("training reward", "k3 (rollout vs trainer)", "staleness (versions behind)")):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    args = parse_args()
    if args.plot:
        return plot(args.plot, args.out)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine's process
    modes = [True, False] if args.smoke else [args.sync]
    with server_process(["--model", default_model_path(), *ENGINE_FLAGS]) as (url, _):
        for sync in modes:
            args.sync = sync
            client = RolloutClient(url)
            if args.sync_via == "group":
                client.use_weights_update_group()
            try:
                result = run(args, client)
            finally:
                client.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
