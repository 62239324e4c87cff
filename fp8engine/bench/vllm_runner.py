"""The child of `fp8engine bench --baseline vllm`, run as a script by the vLLM venv's python (it imports vllm and
torch, never fp8engine): the workload from a JSON file, a warm-up generate, then one timed generate of every
prompt, and one JSON line on stdout with the figures and what ran.

    python vllm_runner.py --check          # {"vllm": ..., "torch": ..., "platform": ...}
    python vllm_runner.py WORKLOAD.json    # {"vllm": ..., "seconds": ..., "output_tok_s": ..., ...}

The warm-up is one generate of the whole timed batch, so that the timed run pays no compilation of the batch's
shapes (a warm-up of one short prompt left vLLM's 128-sequence decode at half its speed).

WORKLOAD.json: prompt_token_ids (lists of ints), n, output_len, temperature, threads, cpus, model, dtype,
max_num_seqs, kv_cache_bytes, seed. This process, and the engine core and worker processes vLLM starts from it, run
on `cpus`; the worker's OpenMP threads are bound to them by the environment the parent sets
(VLLM_CPU_OMP_THREADS_BIND), torch's threads in this process are `threads`.
"""

import argparse
import json
import os
import sys
import time

FIELDS = {"prompt_token_ids": list, "n": int, "output_len": int, "temperature": float, "threads": int, "cpus": list,
          "model": str, "dtype": str, "max_num_seqs": int, "kv_cache_bytes": int, "seed": int}
POSITIVE = ("n", "output_len", "threads", "max_num_seqs", "kv_cache_bytes")


def load_workload(path: str) -> dict:
    """The workload file, checked (ValueError, TypeError): every field of FIELDS with its type, token ids as
    non-empty lists of ints."""
    with open(path) as f:
        spec = json.load(f)
    missing = [k for k in FIELDS if k not in spec]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    for key, kind in FIELDS.items():
        value = spec[key]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise TypeError(f"{path}: {key} must be of type {kind.__name__}, got {value!r}")
    bad = [k for k in POSITIVE if spec[k] < 1]
    if bad:
        raise ValueError(f"{path}: {', '.join(bad)} must be >= 1")
    prompts = spec["prompt_token_ids"]
    if not prompts or not all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompts):
        raise ValueError(f"{path}: prompt_token_ids must be non-empty lists of token ids")
    if not spec["cpus"] or not all(type(c) is int and c >= 0 for c in spec["cpus"]):
        raise ValueError(f"{path}: cpus must be a non-empty list of CPU ids, got {spec['cpus']!r}")
    return spec


def sampling_kwargs(spec: dict) -> dict:
    """vLLM SamplingParams for the workload: n samples of exactly output_len tokens, EOS ignored, the
    sampled token's logprob (as the engine computes it)."""
    return dict(n=spec["n"], temperature=spec["temperature"], top_p=1.0, top_k=0, max_tokens=spec["output_len"],
                min_tokens=spec["output_len"], ignore_eos=True, logprobs=0)


def versions() -> dict:
    """What runs: vLLM's and torch's versions and vLLM's platform. Imports LLM, which imports transformers (and
    through it torchvision, where installed): a venv that cannot run vLLM fails here."""
    import vllm  # first: a python without it fails before torch's import time
    from vllm import LLM  # noqa: F401
    from vllm.platforms import current_platform

    import torch
    return {"vllm": vllm.__version__, "torch": torch.__version__, "platform": current_platform.device_type}


def run(spec: dict) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.sched_setaffinity(0, spec["cpus"])  # before LLM starts its processes: they inherit it
    torch.set_num_threads(spec["threads"])
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec["seed"], max_num_seqs=spec["max_num_seqs"],
              kv_cache_memory_bytes=spec["kv_cache_bytes"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompt_token_ids"]]
    params = SamplingParams(**sampling_kwargs(spec))
    llm.generate(prompts, params, use_tqdm=False)  # warm-up on the timed batch: its shapes compiled, as ours are
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    config = llm.llm_engine.vllm_config
    compilation = config.compilation_config
    return {**versions(), "seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "sequences": sum(len(o.outputs) for o in outs), "threads": spec["threads"],
            "cpus": sorted(os.sched_getaffinity(0)), "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "compilation_mode": compilation.mode.name, "compilation_backend": compilation.backend,
            "enforce_eager": config.model_config.enforce_eager,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "kv_cache_bytes": spec["kv_cache_bytes"], "ld_preload": os.environ.get("LD_PRELOAD", "")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", nargs="?", help="the workload as a JSON file")
    parser.add_argument("--check", action="store_true", help="print the vllm, torch and platform in use")
    args = parser.parse_args(argv)
    if args.check == (args.workload is not None):
        parser.error("give a workload file or --check")
    print(json.dumps(versions() if args.check else run(load_workload(args.workload))), flush=True)
    return 0


if __name__ == "__main__":  # vLLM's workers start by spawn, which imports this file again
    sys.exit(main())
