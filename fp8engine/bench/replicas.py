"""`fp8engine bench --replicas 1,2`: a throughput workload through RolloutCluster, k replicas side by side.

For each replica count k, once per round (the order alternating between rounds, as the modes do), a
fresh cluster of k Ray actors of `threads` threads each: a warm-up rollout that reaches every
replica, a full-weight sync of the model's own checkpoint per sync method (each synced twice and the
second timed: the first forms the weight-update group and touches every page), then the workload's
rollout, timed. The bench starts a local Ray of max(k) * threads CPUs, so the largest cluster fills
it; the ratios against the first count are what more replicas buy on this machine.
"""

import contextlib
import time
from dataclasses import asdict

import torch

from fp8engine.bench.throughput import (Workload, check_positive, engine_config, machine_info, median_run,
                                             model_dir, prompt_ids, sampling_params, shape_of, shape_words, table,
                                             workload_model)
from fp8engine.sampling_params import SamplingParams

SYNC_METHODS = ("object_store", "distributed")


def run(spec: Workload, mode: str, replica_counts: list[int], model: str = "default", dtype: str = "bfloat16",
        device: str = "auto", threads: int | None = None, rounds: int = 1,
        sync_methods: tuple[str, ...] = SYNC_METHODS) -> dict:
    """The report: per replica count its median round (by output tok/s) with ratios to the first count.
    threads: per replica (None: torch's threads / max(replica_counts), at least 1)."""
    from transformers import AutoTokenizer

    from fp8engine.weights.loader import iter_safetensors
    if not replica_counts:
        raise ValueError("--replicas needs at least one replica count")
    counts = [check_positive("--replicas", k) for k in replica_counts]
    threads = check_positive("--threads", max(1, torch.get_num_threads() // max(counts)) if threads is None
                             else threads)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    unknown = [m for m in sync_methods if m not in SYNC_METHODS]
    if unknown:
        raise ValueError(f"unknown sync methods {unknown}; choose from {list(SYNC_METHODS)}")
    model = workload_model(spec, model)
    config = engine_config(mode, spec, model, dtype, device)
    prompts = prompt_ids(spec, AutoTokenizer.from_pretrained(model_dir(model)))
    state = dict(iter_safetensors(model_dir(model)))
    runs: dict[int, list[dict]] = {k: [] for k in counts}
    with local_ray(max(counts) * threads):
        for i in range(rounds):
            for k in counts if i % 2 == 0 else counts[::-1]:
                runs[k].append(run_cluster(config, k, threads, prompts, sampling_params(spec), state, sync_methods))
    results = [median_run(runs[k]) for k in counts]
    for r in results:
        r["ratio_vs_first"] = r["output_tok_s"] / results[0]["output_tok_s"]
        for method in sync_methods:
            r[f"sync_{method}_ratio_vs_first"] = r[f"sync_{method}_s"] / results[0][f"sync_{method}_s"]
    return {"workload": asdict(spec), "shape": shape_of(spec, prompts, threads), "mode": mode, "model": model,
            "dtype": dtype, "rounds": rounds, "threads_per_replica": threads, "sync_methods": list(sync_methods),
            "sync_bytes": results[0]["sync_bytes"], "machine": machine_info(), "results": results}


@contextlib.contextmanager
def local_ray(num_cpus: int):
    """A local Ray of `num_cpus` CPUs for the block, shut down after it; a Ray this process already
    joined is used as it is, if it has the CPUs (else the clusters would wait for them forever)."""
    import ray
    if ray.is_initialized():
        have = int(ray.cluster_resources().get("CPU", 0))
        if have < num_cpus:
            raise ValueError(f"the Ray this process joined has {have} CPUs; --replicas needs "
                             f"max(replicas) * threads = {num_cpus}")
        yield
        return
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def run_cluster(config, num_replicas: int, threads: int, prompts: list[list[int]], params: SamplingParams,
                state: dict[str, torch.Tensor], sync_methods: tuple[str, ...]) -> dict:
    """One round of one replica count: start, warm up, syncs (timed), rollout (timed), shut down."""
    from fp8engine.rl import RolloutCluster
    cluster = RolloutCluster(config, num_replicas=num_replicas, num_cpus_per_replica=threads)
    try:
        # one short prompt per replica: the dispatcher sends each to the least loaded one, so all warm up
        cluster.rollout(prompts[:1] * num_replicas, n=1, sampling_params=SamplingParams(max_tokens=2))
        row = {"replicas": num_replicas}
        version = 0
        for method in sync_methods:
            cluster.sync_method = method  # read at each sync
            for _ in range(2):
                version += 1
                report = cluster.sync_weights(state, weight_version=version)
            row[f"sync_{method}_s"], row["sync_bytes"] = report.seconds, report.num_bytes
        start = time.perf_counter()
        batch = cluster.rollout(prompts, n=params.n, sampling_params=params)
        seconds = time.perf_counter() - start
    finally:
        cluster.shutdown()
    tokens = int(batch.response_mask.sum())
    return row | {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
                  "preemptions_total": int(batch.num_preemptions.sum()), "weight_version": batch.weight_version}


def format_table(report: dict) -> str:
    cols = [("replicas", "{}"), ("output_tok_s", "{:.1f}"), ("ratio_vs_first", "{:.2f}x")]
    for method in report["sync_methods"]:
        cols += [(f"sync_{method}_s", "{:.3f}"), (f"sync_{method}_ratio_vs_first", "{:.2f}x")]
    cols += [("preemptions_total", "{}"), ("seconds", "{:.1f}")]
    head = (f"workload {report['workload']['name']} through RolloutCluster: {shape_words(report['shape'])} per "
            f"replica, mode {report['mode']}, {report['dtype']}; sync of {report['sync_bytes'] / 1e6:.0f} MB "
            f"(second of two per method); torch {report['machine']['torch']}, {report['machine']['processor']}")
    if report["rounds"] > 1:
        head += f"; median of {report['rounds']} rounds in alternating order"
    return "\n".join([head, *table(report["results"], cols)])
