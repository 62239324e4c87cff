"""`fp8engine bench --workload serve`: concurrent streaming clients against `fp8engine serve`.

`run` drives a running server with `concurrency` streaming chat clients until `num_requests` are
done and reports requests/s, output tok/s, time to first token and inter-token latency (p50, p99).
`run_side_by_side` starts the server in a subprocess on a free port and alternates that load with
the same prompts and sampling params run in-process by LLMEngine.generate (max_num_seqs =
concurrency), then reports server / in-process output tok/s. generate runs in a worker thread, as
the server's engine loop does: torch's CPU thread team belongs to the calling thread, and on a busy
machine a main-thread team was measured many times slower. The clients run in this process, on the
same cores as the server: their cost is part of what the ratio shows."""

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from fp8engine.bench.throughput import machine_info, rl_prompts
from fp8engine.config import EngineConfig
from fp8engine.engine import LLMEngine
from fp8engine.sampling_params import SamplingParams
from fp8engine.weights.dist_update import free_port


def run(base_url: str, concurrency: int, num_requests: int, max_tokens: int, *, api_key: str | None = None,
        prompts: list[list[dict]] | None = None, temperature: float = 1.0, seed: int = 0) -> dict:
    """Stream `num_requests` chat completions from `concurrency` clients; returns throughput and latency."""
    prompts = prompts or rl_prompts(num_requests)
    payloads = [{"messages": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": temperature,
                 "seed": seed + i, "ignore_eos": True, "stream": True, "return_token_ids": True}
                for i in range(num_requests)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return asyncio.run(_run(base_url.rstrip("/") + "/v1/chat/completions", payloads, concurrency, headers))


async def _run(url: str, payloads: list[dict], concurrency: int, headers: dict) -> dict:
    todo = iter(payloads)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as client:

        async def worker() -> None:
            for payload in todo:
                results.append(await _stream_one(client, url, payload))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return _summary(results, seconds, concurrency)


async def _stream_one(client: httpx.AsyncClient, url: str, payload: dict) -> dict:
    start = time.perf_counter()
    arrivals, tokens = [], 0
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                new = sum(len(c.get("token_ids", ())) for c in chunk["choices"])
                if new:
                    arrivals.append(time.perf_counter())
                    tokens += new
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not arrivals:
        return {"error": "no tokens streamed"}
    return {"tokens": tokens, "ttft": arrivals[0] - start, "itl": np.diff(arrivals).tolist()}


def _summary(results: list[dict], seconds: float, concurrency: int) -> dict:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    errors = [r["error"] for r in results if "error" in r]
    return {"concurrency": concurrency, "requests": len(results), "errors": len(errors),
            "first_errors": errors[:3], "seconds": seconds, "requests_per_s": len(ok) / seconds,
            "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run_in_process(engine: LLMEngine, prompts: list[list[dict]], max_tokens: int, *, temperature: float = 1.0,
                   seed: int = 0) -> dict:
    """The workload of `run` through engine.generate (its max_num_seqs plays the concurrency)."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, ignore_eos=True)
              for i in range(len(prompts))]
    with ThreadPoolExecutor(1) as worker:  # the server steps its engine outside the main thread too
        start = time.perf_counter()
        outs = worker.submit(engine.generate, prompts, params).result()
        seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"requests": len(outs), "seconds": seconds, "requests_per_s": len(outs) / seconds,
            "output_tokens": tokens, "output_tok_s": tokens / seconds}


def run_side_by_side(concurrency: int = 64, num_requests: int = 200, max_tokens: int = 16, *,
                     model: str = "default", dtype: str = "bfloat16", engine_options: dict | None = None,
                     rounds: int = 3) -> dict:
    """Server under `concurrency` streaming clients vs in-process generate on the same prompts.

    The two alternate for `rounds` rounds (fresh prompts each round, the same on both sides), so a
    busy machine slows both alike; the ratio is the median of the per-round ratios.
    engine_options: extra EngineConfig fields (e.g. {"quantization": "fp8"}) for both sides.
    Returns {"workload", "machine", "rounds", "server", "in_process", "ratio_output_tok_s"} where
    "server" and "in_process" are the medians over rounds.
    """
    engine_options = engine_options or {}
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=concurrency, **engine_options))
    prompts = rl_prompts(num_requests * rounds)
    results = []
    with serving(["--model", model, "--dtype", dtype, *_flags(engine_options)]) as base_url:
        run(base_url, 1, 1, 2)
        run_in_process(engine, prompts[:1], 2)
        for r in range(rounds):
            batch = prompts[r * num_requests:(r + 1) * num_requests]
            served = run(base_url, concurrency, num_requests, max_tokens, prompts=batch)
            local = run_in_process(engine, batch, max_tokens)
            results.append({"server": served, "in_process": local,
                            "ratio_output_tok_s": served["output_tok_s"] / local["output_tok_s"]})
    return {"workload": {"concurrency": concurrency, "num_requests": num_requests, "max_tokens": max_tokens,
                         "model": model, "dtype": dtype, **engine_options},
            "machine": machine_info(), "rounds": results,
            "server": _medians([r["server"] for r in results]),
            "in_process": _medians([r["in_process"] for r in results]),
            "ratio_output_tok_s": statistics.median(r["ratio_output_tok_s"] for r in results)}


def _medians(results: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in results) for k, v in results[0].items()
            if isinstance(v, (int, float)) and all(r[k] is not None for r in results)}


@contextlib.contextmanager
def serving(flags: list[str], startup_timeout: float = 300.0) -> Iterator[str]:
    """Run `fp8engine serve FLAGS --port <free port>` in a subprocess; yields its base URL once healthy."""
    with server_process(flags, startup_timeout) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def server_process(flags: list[str], startup_timeout: float = 300.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """`serving`, yielding the server's process beside its base URL."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen([sys.executable, "-m", "fp8engine.entrypoints.cli", "serve", *flags,
                                   "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log,
                                  env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_until_healthy(base_url, server, log, startup_timeout)
            yield base_url, server
        finally:
            server.terminate()
            server.wait(timeout=60)


def wait_until_healthy(base_url: str, server: subprocess.Popen, log, timeout: float) -> None:
    """Poll GET /health until it answers 200; RuntimeError with the server's log if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with code {server.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")


def _flags(options: dict) -> list[str]:
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def format_table(report: dict) -> str:
    w, s, local, m = report["workload"], report["server"], report["in_process"], report["machine"]
    head = (f"serve workload: {w['num_requests']} chat requests x {w['max_tokens']} tokens, {w['concurrency']} "
            f"concurrent streaming clients, {w['dtype']}, torch {m['torch']}, {m['processor']}; "
            f"medians of {len(report['rounds'])} alternating rounds")
    served = (f"server:     {s['output_tok_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s, "
              f"{s['errors']} errors; TTFT p50 {s['ttft_p50_s']:.3f} s p99 {s['ttft_p99_s']:.3f} s; "
              f"inter-token p50 {s['itl_p50_s']:.3f} s p99 {s['itl_p99_s']:.3f} s")
    in_process = f"in-process: {local['output_tok_s']:.1f} output tok/s, {local['requests_per_s']:.2f} req/s"
    ratios = ", ".join(f"{r['ratio_output_tok_s']:.2f}" for r in report["rounds"])
    return "\n".join([head, served, in_process,
                      f"server / in-process output tok/s: {report['ratio_output_tok_s']:.2f}x (rounds: {ratios})"])
