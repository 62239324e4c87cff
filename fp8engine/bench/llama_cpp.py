"""`fp8engine bench --baseline llama.cpp`: llama.cpp's own batched benchmark on the workload's shape.

`llama-batched-bench` (tools/batched-bench in llama.cpp) prefills B sequences of PP tokens, then
decodes TG tokens in each, all B in every step, and times the two phases (T_PP, T_TG). It samples
nothing (each step feeds arbitrary token ids), so its time is the forward passes alone. We run it
with B = num_prompts * n, PP = the workload's prompt length (the mean, for chat prompts), TG = its
output length and the engine's thread count, and report B * TG / (T_PP + T_TG): output tokens per
second end to end, prefill included, as the engine rows count them. With one prompt its n sequences
share one prefill (`-pps`), as the engine's prefix cache shares it; with more, every sequence
prefills its own copy, where the engine prefills each prompt once for its n samples.

The binary is never downloaded: build it (docs/benchmarks.md, "llama.cpp baseline") and pass its directory.
"""

import json
import re
import subprocess
from functools import partial
from pathlib import Path

BINARY = "llama-batched-bench"
FIELDS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
_NUMBER = r"\s*(-?[\d.]+|nan|inf)\s*\|"
_ROW = re.compile(r"\|" + _NUMBER * len(FIELDS))  # "|   128 |    128 |    1 |    256 |    0.080 | ..."


def find_binary(llama_bin: str | None) -> Path:
    """llama-batched-bench in `llama_bin` or `llama_bin`/bin (where a CMake build puts it)."""
    if llama_bin is None:
        raise ValueError("--baseline llama.cpp needs --llama-bin DIR, the directory holding llama-batched-bench")
    root = Path(llama_bin).expanduser()
    if not root.is_dir():
        raise ValueError(f"--llama-bin {llama_bin!r} is not a directory")
    for path in (root / BINARY, root / "bin" / BINARY):
        if path.is_file():
            if not path.stat().st_mode & 0o111:
                raise ValueError(f"{path} is not executable")
            return path
    raise ValueError(f"no {BINARY} in --llama-bin {llama_bin!r} nor in its bin/; build it with "
                     f"`cmake --build build --target {BINARY}` in llama.cpp's sources (see docs/benchmarks.md)")


def check_gguf(gguf: str | None) -> Path:
    if gguf is None:
        raise ValueError("--baseline llama.cpp needs --gguf FILE, the model as GGUF (see docs/benchmarks.md)")
    path = Path(gguf).expanduser()
    if not path.is_file():
        raise ValueError(f"--gguf {gguf!r} is not a file")
    return path


def runner(gguf: str | None, llama_bin: str | None):
    """`run` with the binary and GGUF checked and bound: what throughput.run calls with the shape."""
    return partial(run, find_binary(llama_bin), check_gguf(gguf))


def command(binary: Path, gguf: Path, prompt_len: int, output_len: int, parallel: int, threads: int,
            shared_prompt: bool) -> list[str]:
    """The arguments for one PP/TG/B point. The context holds every sequence whole: llama-batched-bench
    silently skips a point that does not fit."""
    args = [str(binary), "-m", str(gguf), "-c", str(parallel * (prompt_len + output_len)),
            "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(parallel), "-t", str(threads),
            "--output-format", "jsonl"]
    return args + ["-pps"] if shared_prompt else args


def parse(text: str) -> list[dict]:
    """Result rows from llama-batched-bench's output: JSON lines (--output-format jsonl, every field it
    prints) or its markdown table (the FIELDS columns)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and set(FIELDS) <= record.keys():
                rows.append(record)
        elif match := _ROW.fullmatch(line):
            rows.append({f: (int if i < 4 else float)(v) for i, (f, v) in enumerate(zip(FIELDS, match.groups()))})
    return rows


def run(binary: Path, gguf: Path, prompt_len: int, output_len: int, parallel: int, threads: int,
        shared_prompt: bool = False) -> dict:
    """One llama-batched-bench run as a report row: output tokens/s end to end, and llama.cpp's own
    figures (prefill and decode speeds, times, the command) under "llama_cpp"."""
    args = command(binary, gguf, prompt_len, output_len, parallel, threads, shared_prompt)
    done = subprocess.run(args, capture_output=True, text=True)
    output = done.stdout + "\n" + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{binary.name} exited with status {done.returncode}: {' '.join(args)}\n"
                           f"{output_tail(output)}")
    rows = [r for r in parse(output) if (r["pp"], r["tg"], r["pl"]) == (prompt_len, output_len, parallel)]
    if not rows:
        raise RuntimeError(f"{binary.name} printed no result for PP={prompt_len}, TG={output_len}, B={parallel}: "
                           f"{' '.join(args)}\n{output_tail(output)}")
    own = dict(rows[-1], prompt_shared=shared_prompt, command=args)
    own.setdefault("n_threads", threads)
    tokens = parallel * output_len
    return {"mode": "llama.cpp", "output_tokens": tokens, "seconds": own["t"], "output_tok_s": tokens / own["t"],
            "llama_cpp": own}


def output_tail(output: str, lines: int = 20) -> str:
    """The last `lines` lines of a baseline's output, for its error message."""
    return "\n".join(output.strip().splitlines()[-lines:])
