"""Agent workloads, measured side by side in one run (docs/agents.md, raw output docs/agents.txt):

1. 4-turn calculator episodes (3 forced calc calls, then a free answer; n=8): rollout_episodes (exact token
   histories, the new messages appended) against a client that re-renders the whole chat every turn, as an
   OpenAI-style agent loop does: prefix-cache hits on turns >= 2, prefill tokens computed, wall time, and the
   share of episodes whose re-rendered history differs from the tokens the model actually saw (the same
   problems and seeds in both, each run on an empty prefix cache).
2. Structured outputs: tok/s of a json_schema-constrained rollout against the same rollout unconstrained.
3. --cluster: the episodes on a 2-replica RolloutCluster, sessions sticky against least-loaded only.

    python benchmarks/agent_episodes.py [--rounds 2] [--cluster] [--json out.json]
"""

import argparse
import dataclasses
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from agent_grpo import CALC, calc  # noqa: E402 (the example's tool)

from fp8engine import EngineConfig, SamplingParams
from fp8engine.rl import RolloutEngine
from fp8engine.rl.episodes import Turn, rollout_episodes
from fp8engine.tools import forced_call_grammar, parse, render_ids

STORY = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                          "story": {"type": "string", "minLength": 1000}},
         "required": ["title", "story"], "additionalProperties": False}
TURNS = 4


class Steps:
    """((a*b)+c)-d in three calc calls, then the answer; keeps its chat as messages for the re-render check."""

    tools = [CALC]

    def reset(self, prompt):
        a, b, c, d = prompt
        self.messages = [{"role": "user", "content": f"Compute (({a}*{b})+{c})-{d} with the calc tool, one "
                                                     f"operation per call, then state the result."}]
        return self.messages

    def step(self, turn):
        if not turn.tool_calls:
            self.messages.append({"role": "assistant", "content": turn.content})
            return None, 1.0, True
        call = turn.tool_calls[0]
        observation = [{"role": "tool", "tool_call_id": call.id, "content": calc(call.arguments)}]
        self.messages += [{"role": "assistant", "content": None, "tool_calls": [call.openai()]}, *observation]
        return observation, 0.0, False


def turn_params(max_tokens: int, seed: int):
    forced = forced_call_grammar("hermes", [CALC], "calc")
    return lambda turn: SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed,
                                       grammar=forced if turn < TURNS - 1 else None)


def flush(rollouts) -> None:
    """Empty the prefix cache of the engine, or of every replica."""
    if hasattr(rollouts, "engine"):
        rollouts.engine.flush_prefix_cache()
    else:
        import ray
        ray.get([replica.call.remote(_flush) for replica in rollouts.replicas])


def _flush(engine) -> None:
    engine.flush_prefix_cache()


def problems(rng: random.Random, count: int) -> list[tuple[int, ...]]:
    return [(rng.randint(11, 49), rng.randint(3, 29), rng.randint(10, 99), rng.randint(1, 9)) for _ in range(count)]


def rerendered(rollouts, prompts, n: int, params_of, tokenizer) -> dict:
    """The same episodes driven by a client that re-renders the whole chat every turn (no exact history)."""
    envs = [Steps() for _ in range(len(prompts) * n)]
    messages = [env.reset(prompts[i // n]) for i, env in enumerate(envs)]
    live = list(range(len(envs)))
    sent, computed, start = [], [], time.perf_counter()
    for turn in range(TURNS):
        if not live:
            break
        prompt_ids = [render_ids(tokenizer, messages[i], [CALC]) for i in live]
        params = params_of(turn)
        seeds = [(params.seed * 1_000_003 + 7919 * (i + 1) + 104_729 * turn) % (1 << 62) for i in live]
        before = rollouts.get_stats().num_prompt_tokens_total
        batch = rollouts.rollout(prompt_ids, n=1, sessions=[("rerender", i) for i in live],
                                 sampling_params=[dataclasses.replace(params, seed=s) for s in seeds])
        sent.append(sum(map(len, prompt_ids)))
        computed.append(rollouts.get_stats().num_prompt_tokens_total - before)
        still = []
        for i, text in zip(live, batch.response_texts):
            _, calls = parse("hermes", text)
            _, _, done = envs[i].step(Turn(text, text, calls, [], "stop", turn))
            if not done and turn < TURNS - 1:
                still.append(i)
        live = still
    return {"seconds": time.perf_counter() - start, "prompt_tokens_by_turn": sent, "prefill_tokens_by_turn": computed}


def drift(batch, envs: list[Steps], tokenizer) -> float:
    """Share of episodes whose whole chat, re-rendered, is not the token history the model saw."""
    prompts, responses = batch.prompts_and_responses()
    changed = 0
    for env, prompt, response in zip(envs, prompts, responses):
        history = prompt + response
        again = render_ids(tokenizer, env.messages[:-1] if env.messages[-1]["role"] == "assistant"
                           and env.messages[-1].get("tool_calls") is None else env.messages, [CALC])
        changed += history[:len(again)] != again[:len(history)]
    return changed / len(envs)


def episodes_round(rollouts, prompts, n, params_of, tokenizer) -> dict:
    envs = []

    def make():
        envs.append(Steps())
        return envs[-1]
    start = time.perf_counter()
    batch = rollout_episodes(rollouts, make, prompts, n=n, sampling_params=params_of, max_turns=TURNS)
    seconds = time.perf_counter() - start
    s = batch.stats
    return {"seconds": seconds, "prompt_tokens_by_turn": s["prompt_tokens_by_turn"],
            "prefill_tokens_by_turn": s["prefill_tokens_by_turn"], "mean_turns": s["mean_turns"],
            "model_tokens": s["model_tokens"], "drift": drift(batch, envs, tokenizer),
            "replicas": s["replicas_of_episode"]}


def structured_round(rollouts, n: int, seed: int) -> dict:
    """Both generate exactly 64 tokens a sample (EOS ignored; a schema that cannot end sooner), so tok/s compares
    the steps, not how soon samples stop."""
    ask = [[{"role": "user", "content": f"Tell story number {i} as JSON."}] for i in range(4)]
    out = {}
    for name, extra in (("plain", {"ignore_eos": True}), ("json_schema", {"json_schema": STORY})):
        params = SamplingParams(temperature=1.0, max_tokens=64, seed=seed, **extra)
        start = time.perf_counter()
        batch = rollouts.rollout(ask, n=n, sampling_params=params)
        seconds = time.perf_counter() - start
        out[name] = {"tok_s": batch.stats["num_tokens"] / seconds, "tokens": batch.stats["num_tokens"]}
    return out


def summarize(rows: list[dict], label: str) -> None:
    sent = [sum(r["prompt_tokens_by_turn"][1:]) for r in rows]
    computed = [sum(r["prefill_tokens_by_turn"][1:]) for r in rows]
    seconds = [r["seconds"] for r in rows]
    print(f"  {label:<22} wall {sum(seconds) / len(rows):6.1f} s  prefill on turns>=2 {sum(computed) // len(rows):6d} "
          f"of {sum(sent) // len(rows):6d} prompt tokens  prefix-cache hit rate {1 - sum(computed) / sum(sent):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--cluster", action="store_true", help="also sticky vs least-loaded on 2 Ray replicas")
    p.add_argument("--json")
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
    config = EngineConfig(quantization="fp8", kv_cache_memory_bytes=512 << 20)
    rollouts = RolloutEngine(config)
    tokenizer = rollouts.tokenizer
    rng = random.Random(0)
    results = {"episodes": [], "rerender": [], "structured": []}
    for r in range(args.rounds):  # the same problems and seeds in both, alternating, each on an empty prefix cache
        params_of, prompts = turn_params(args.max_tokens, seed=r), problems(rng, args.prompts)
        for mode in ("episodes", "rerender") if r % 2 == 0 else ("rerender", "episodes"):
            flush(rollouts)
            run = episodes_round if mode == "episodes" else rerendered
            results[mode].append(run(rollouts, prompts, args.n, params_of, tokenizer))
        results["structured"].append(structured_round(rollouts, args.n, seed=r))
    print(f"{TURNS}-turn calculator episodes, {args.prompts} prompts x n={args.n}, fp8-linear, {args.rounds} rounds:")
    summarize(results["episodes"], "exact history")
    summarize(results["rerender"], "re-rendered each turn")
    print(f"  episodes whose re-rendered chat differs from the sampled tokens: "
          f"{sum(r['drift'] for r in results['episodes']) / args.rounds:.1%}; mean model turns "
          f"{sum(r['mean_turns'] for r in results['episodes']) / args.rounds:.2f}")
    plain = sum(r["plain"]["tok_s"] for r in results["structured"]) / args.rounds
    schema = sum(r["json_schema"]["tok_s"] for r in results["structured"]) / args.rounds
    print(f"structured outputs, 4 prompts x n={args.n}, T=1, 64 tokens a sample: plain {plain:.1f} tok/s, "
          f"json_schema {schema:.1f} tok/s ({schema / plain:.2f}x)")
    if args.cluster:
        results["cluster"] = cluster_rounds(config, args, rng)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def cluster_rounds(config: EngineConfig, args, rng: random.Random) -> dict:
    import ray

    from fp8engine.rl import RolloutCluster
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cluster = RolloutCluster(config, num_replicas=2, num_cpus_per_replica=1)
    out = {"sticky": [], "least_loaded": []}
    tokenizer = cluster.tokenizer
    for r in range(args.rounds):
        prompts = problems(rng, args.prompts)
        for mode in ("sticky", "least_loaded") if r % 2 == 0 else ("least_loaded", "sticky"):
            cluster.sticky_sessions = mode == "sticky"
            flush(cluster)
            out[mode].append(episodes_round(cluster, prompts, args.n, turn_params(args.max_tokens, seed=100 + r),
                                            tokenizer))
    print(f"2-replica cluster (1 thread each), the same episodes, {args.rounds} rounds:")
    for mode in ("sticky", "least_loaded"):
        summarize(out[mode], f"sessions {mode}")
        moved = sum(len(set(turns)) > 1 for row in out[mode] for turns in row["replicas"])
        print(f"    episodes that changed replica: {moved} of {sum(len(row['replicas']) for row in out[mode])}")
    cluster.shutdown()
    ray.shutdown()
    return out


if __name__ == "__main__":
    main()
