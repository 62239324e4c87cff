"""Weight updates during generation: `fp8engine bench --workload rl-long --update-every N`.

An asynchronous RL rollout as the engine sees it: prompt groups stream in (half the workload's groups
generating at a time, the next one admitted as one finishes; each group's length drawn between a quarter of
and the workload's output length, seeded, so the batch has a tail), and every N engine steps a new weight
version lands — the whole model, alternating between the checkpoint and a copy with k/v projections scaled
by 17/16, so an FP8 KV cache's recomputed scales move at every update. Policies, side by side in one run:

- none: no update (the reference),
- wait: `update_weights(in_flight="wait")`: no new group starts, the ones in flight finish on the old
  weights (the batch drains), then the update,
- keep: `in_flight="keep"`: the update lands between two steps, everything in flight goes on,
- keep+recompute: `in_flight="keep", kv_on_update="recompute"`: and re-prefills what is in flight.

Stall per update = (seconds - the none run's seconds) / updates: the generation time each update costs.
"""

import random
import time
from collections import deque

import torch

from fp8engine.bench.throughput import (
    engine_config,
    machine_info,
    model_dir,
    prompt_ids,
    shape_of,
    shape_words,
    table,
    torch_threads,
)
from fp8engine.bench.workloads import IN_FLIGHT_POLICIES, Workload
from fp8engine.engine import LLMEngine
from fp8engine.sampling_params import SamplingParams
from fp8engine.weights.loader import iter_safetensors

POLICIES = dict(zip(IN_FLIGHT_POLICIES, (None, dict(in_flight="wait"), dict(in_flight="keep"),
                                         dict(in_flight="keep", kv_on_update="recompute"))))
KV_SCALE_STEP = 17 / 16


def check_policies(policies: list[str]) -> list[str]:
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"--in-flight: unknown policies {unknown or policies}; choose from {list(POLICIES)}")
    return policies


def weight_versions(model: str) -> list[dict[str, torch.Tensor]]:
    """The checkpoint's tensors, and the same with every k_proj / v_proj weight scaled by KV_SCALE_STEP."""
    base = dict(iter_safetensors(model_dir(model)))
    moved = {name: t * KV_SCALE_STEP if name.endswith(("k_proj.weight", "v_proj.weight")) else t
             for name, t in base.items()}
    return [moved, base]


def run_policy(policy: str, mode: str, spec: Workload, prompts: list[list[int]], lengths: list[int], every: int,
               versions: list[dict], model: str, dtype: str, device: str) -> dict:
    engine = LLMEngine(engine_config(mode, spec, model, dtype, device))
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    engine.update_weights({})
    slots = max(1, spec.num_prompts // 2)
    pending, live = deque(range(len(prompts))), set()
    update_seconds, recomputes = [], 0
    before = engine.get_stats()
    next_update = engine.num_steps + every
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < slots:
            g = pending.popleft()
            params = SamplingParams(n=spec.n, temperature=spec.temperature, max_tokens=lengths[g], ignore_eos=True,
                                    seed=g, logprobs=0)
            live.add(engine.add_request(prompts[g], params))
        for out in engine.step(finished_only=True):
            live.discard(out.request_id)
        if POLICIES[policy] is not None and engine.num_steps >= next_update and live:
            t = time.perf_counter()
            report = engine.update_weights(versions[len(update_seconds) % 2], **POLICIES[policy])
            update_seconds.append(time.perf_counter() - t)
            recomputes += report.num_kv_recomputed
            next_update = engine.num_steps + every
    seconds = time.perf_counter() - start
    after = engine.get_stats()
    tokens = after.num_generation_tokens_total - before.num_generation_tokens_total
    updates = len(update_seconds)
    return {"policy": policy, "mode": mode, "seconds": seconds, "output_tokens": tokens,
            "output_tok_s": tokens / seconds,
            "updates": updates, "update_call_s": sum(update_seconds) / updates if updates else 0.0,
            "recomputed_seqs": recomputes, "steps": after.num_steps_total - before.num_steps_total,
            "kv_rescale_ms_per_update": 1e3 * (after.kv_rescale_seconds_total - before.kv_rescale_seconds_total)
            / updates if updates else 0.0,
            "preemptions": after.num_preemptions_total - before.num_preemptions_total}


def run(spec: Workload, mode: str, every: int, policies: list[str], model: str = "default", dtype: str = "bfloat16",
        device: str = "auto", threads: int | None = None) -> dict:
    """Every policy once on the same prompts and lengths, in the order given (put "none" first: it is the
    reference the stalls are measured against)."""
    check_policies(policies)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"--update-every must be an integer >= 1 (engine steps), got {every!r}")
    with torch_threads(threads) as threads:
        from transformers import AutoTokenizer
        prompts = prompt_ids(spec, AutoTokenizer.from_pretrained(model_dir(model)))
        rng = random.Random(0)
        lengths = [rng.randint(max(1, spec.max_tokens // 4), spec.max_tokens) for _ in prompts]
        versions = weight_versions(model)
        results = [run_policy(p, mode, spec, prompts, lengths, every, versions, model, dtype, device)
                   for p in policies]
        shape = shape_of(spec, prompts, threads)
    reference = next((r for r in results if r["policy"] == "none"), None)
    for r in results:
        r["ratio_vs_first"] = r["output_tok_s"] / results[0]["output_tok_s"]
        if reference is not None and r["updates"]:
            r["stall_s_per_update"] = (r["seconds"] - reference["seconds"]) / r["updates"]
    return {"workload": {"name": spec.name}, "shape": shape, "mode": mode, "update_every": every, "model": model,
            "dtype": dtype, "machine": machine_info(), "lengths": lengths, "results": results}


def format_table(report: dict) -> str:
    cols = [("policy", "{}"), ("output_tok_s", "{:.1f}"), ("ratio_vs_first", "{:.2f}x"), ("updates", "{}"),
            ("stall_s_per_update", "{:.2f}"), ("update_call_s", "{:.2f}"), ("kv_rescale_ms_per_update", "{:.1f}"),
            ("recomputed_seqs", "{}"), ("steps", "{}"), ("preemptions", "{}"), ("seconds", "{:.1f}")]
    head = (f"workload {report['workload']['name']} with a weight update every {report['update_every']} steps, "
            f"{report['mode']}: {shape_words(report['shape'])} (lengths drawn in [max/4, max]), half the groups in "
            f"flight, {report['dtype']}, torch {report['machine']['torch']}")
    return "\n".join([head, *table(report["results"], cols)])
