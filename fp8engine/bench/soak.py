"""`fp8engine bench --workload soak`: a long mixed load against `fp8engine serve` in a subprocess.

For `minutes` minutes, `clients` streaming clients send short random prompts to /v1/completions
and /v1/chat/completions (max_tokens 16-64); a fraction of them close the connection after a few
chunks. After every `update_every_s` seconds of traffic an updater pauses the server in "wait" mode,
pushes the model's own safetensors through POST /update_weights as the next weight_version (one
file per bucket when there are several) and resumes; now and then the prefix cache is flushed.
Clients start no request while an update is due, as a rollout controller would, so a paused server
has nothing to refuse. Then the run drains and the report counts requests by HTTP status, transport
and in-stream errors, streamed choices whose chunks carried more than one weight_version, KV blocks
free vs total after the drain, the server's RSS after warm-up (its lowest point in the update cycle
after the first minute, or after 20% of a shorter run), at the end and at its peak, and p50/p99
latency and time to first token of the requests that ran to the end.
"""

import asyncio
import contextlib
import glob
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from fp8engine.bench.serve_load import percentile, server_process
from fp8engine.bench.throughput import machine_info
from fp8engine.weights.default_model import default_model_path

WORDS = ("apple", "river", "seven", "green", "count", "light", "story", "prime", "table", "cloud", "quick",
         "number", "write", "add", "explain", "why", "the", "a", "of", "sum", "poem", "list", "city", "small")
DRAIN_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """What one soak runs: durations in seconds, `disconnect_fraction` of requests closed early."""

    minutes: float = 10.0
    clients: int = 64
    model: str = "default"
    dtype: str = "bfloat16"
    device: str = "auto"
    update_every_s: float = 10.0
    flush_every_s: float = 15.0
    disconnect_fraction: float = 0.1
    max_tokens: tuple[int, int] = (16, 64)
    seed: int = 0

    def __post_init__(self):
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")

    @property
    def warmup_s(self) -> float:
        return min(60.0, 0.2 * self.minutes * 60)


@dataclass(slots=True)
class Tally:
    """What the clients saw. Every request either got a response (by_status) or a transport error."""

    requests: int = 0
    by_status: Counter = field(default_factory=Counter)
    transport_errors: Counter = field(default_factory=Counter)
    stream_errors: Counter = field(default_factory=Counter)
    admin_by_status: Counter = field(default_factory=Counter)
    completed: int = 0
    disconnected: int = 0
    output_tokens: int = 0
    mixed_version_choices: int = 0
    versions_seen: set = field(default_factory=set)
    latency: list = field(default_factory=list)
    ttft: list = field(default_factory=list)
    updates: list = field(default_factory=list)
    flushes: int = 0
    first_errors: list = field(default_factory=list)

    def note(self, error: str) -> None:
        if len(self.first_errors) < 5:
            self.first_errors.append(error)


class Gate:
    """Closed while an update is due: clients wait before sending; `close` returns once every request
    already sent has its response headers (so it is in the engine, or refused)."""

    def __init__(self):
        self.open = asyncio.Event()
        self.open.set()
        self.sending = 0
        self._answered = asyncio.Event()
        self._answered.set()

    async def enter(self) -> None:
        while not self.open.is_set():
            await self.open.wait()
        self.sending += 1
        self._answered.clear()

    def answered(self) -> None:
        self.sending -= 1
        if not self.sending:
            self._answered.set()

    async def close(self) -> None:
        self.open.clear()
        await self._answered.wait()


def run(config: SoakConfig) -> dict:
    """Start the server, soak it for config.minutes, drain; returns the report (see the module docstring)."""
    weights = weight_files(config.model)
    flags = ["--model", config.model, "--dtype", config.dtype, "--device", config.device]
    with server_process(flags) as (base_url, server):
        report = asyncio.run(_soak(base_url, server.pid, config, weights))
        report["server_exit_code"] = server.poll()
    return {"workload": {"name": "soak", **{k: getattr(config, k) for k in SoakConfig.__slots__}},
            "machine": machine_info(), **report}


def weight_files(model: str) -> list[bytes]:
    """The model's safetensors files, as bytes: the soak's weight updates push them back unchanged."""
    directory = default_model_path() if model == "default" else model
    paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not paths:
        raise ValueError(f"model {model!r}: no *.safetensors in {directory!r} (the soak needs a local directory)")
    return [open(p, "rb").read() for p in paths]


async def _soak(base_url: str, pid: int, config: SoakConfig, weights: list[bytes]) -> dict:
    tally, gate, rng = Tally(), Gate(), random.Random(config.seed)
    start = time.monotonic()
    deadline = start + config.minutes * 60
    limits = httpx.Limits(max_connections=config.clients, max_keepalive_connections=config.clients)
    async with (httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=limits) as client,
                httpx.AsyncClient(base_url=base_url, timeout=600.0) as admin):
        rss = RssSampler(pid, start + config.warmup_s, config.update_every_s + 1.0)
        sampling = asyncio.create_task(rss.run())
        await asyncio.gather(
            *(_client(client, gate, tally, random.Random(rng.random()), config, deadline)
              for _ in range(config.clients)),
            _updater(admin, gate, tally, weights, config.update_every_s, deadline),
            _flusher(admin, tally, random.Random(rng.random()), config.flush_every_s, deadline))
        stats = await _drained_stats(admin)
        rss.stop.set()
        await sampling
    return _report(tally, stats, rss, time.monotonic() - start)


# ------------------------------------------------------------------ clients
async def _client(client: httpx.AsyncClient, gate: Gate, tally: Tally, rng: random.Random, config: SoakConfig,
                  deadline: float) -> None:
    while True:
        await gate.enter()
        if time.monotonic() >= deadline:
            gate.answered()
            return
        chat = rng.random() < 0.5
        path, payload = _request(rng, chat, config.max_tokens)
        stop_after = rng.randint(1, 4) if rng.random() < config.disconnect_fraction else None
        await _stream(client, gate, tally, path, payload, stop_after)


def _request(rng: random.Random, chat: bool, max_tokens: tuple[int, int]) -> tuple[str, dict]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    body = {"max_tokens": rng.randint(*max_tokens), "temperature": 1.0, "seed": rng.randrange(2**31),
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": text}]}
    return "/v1/completions", body | {"prompt": text}


async def _stream(client: httpx.AsyncClient, gate: Gate, tally: Tally, path: str, payload: dict,
                  stop_after: int | None) -> None:
    """One streaming request; closes the connection after `stop_after` token chunks when set."""
    tally.requests += 1
    start, answered = time.perf_counter(), False
    try:
        async with client.stream("POST", path, json=payload) as response:
            gate.answered()
            answered = True
            tally.by_status[str(response.status_code)] += 1
            if response.status_code != 200:
                tally.note(f"{path} HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            await _read_events(response, tally, start, stop_after)
    except httpx.HTTPError as exc:
        errors = tally.stream_errors if answered else tally.transport_errors
        errors[type(exc).__name__] += 1
        tally.note(f"{path} {type(exc).__name__}: {exc}")
    finally:
        if not answered:
            gate.answered()


async def _read_events(response: httpx.Response, tally: Tally, start: float, stop_after: int | None) -> None:
    versions: dict[int, set] = {}
    first, chunks = None, 0
    try:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                tally.completed += 1
                tally.latency.append(time.perf_counter() - start)
                if first is not None:
                    tally.ttft.append(first - start)
                return
            if not line.startswith("data: "):
                continue
            try:
                chunk = json.loads(line[len("data: "):])
            except json.JSONDecodeError as exc:  # an event cut or garbled on the way: the server's fault
                tally.stream_errors["malformed event"] += 1
                tally.note(f"malformed event ({exc}): {line[:200]!r}")
                return
            if "error" in chunk:
                tally.stream_errors[str(chunk["error"].get("code") or chunk["error"].get("type"))] += 1
                tally.note(f"in-stream error: {chunk['error'].get('message')}")
                return
            new = 0
            for choice in chunk["choices"]:
                versions.setdefault(choice["index"], set()).add(choice["weight_version"])
                new += len(choice.get("token_ids") or ())
            if new:
                first = first or time.perf_counter()
                tally.output_tokens += new
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    tally.disconnected += 1
                    return  # leaving the `stream` block closes the connection mid-stream
        tally.stream_errors["no [DONE]"] += 1
    finally:
        tally.mixed_version_choices += sum(len(v) > 1 for v in versions.values())
        tally.versions_seen.update(*versions.values())


# ------------------------------------------------------------------ updates, flushes, stats
async def _updater(admin: httpx.AsyncClient, gate: Gate, tally: Tally, weights: list[bytes], every_s: float,
                   deadline: float) -> None:
    version = (await _admin(admin, tally, "GET", "/weight_version")).json()["weight_version"]
    while time.monotonic() + every_s < deadline:
        await asyncio.sleep(every_s)
        version += 1
        tally.updates.append(await _update(admin, gate, tally, weights, version))


async def _update(admin: httpx.AsyncClient, gate: Gate, tally: Tally, weights: list[bytes], version: int) -> dict:
    """Pause ("wait"), push the weights as `version`, resume; the timings and whether it took effect."""
    start = time.perf_counter()
    await gate.close()
    try:
        paused = await _admin(admin, tally, "POST", "/pause", json={"mode": "wait"})
        drained = time.perf_counter()
        if len(weights) == 1:
            pushed = await _admin(admin, tally, "POST", f"/update_weights?weight_version={version}",
                                  content=weights[0])
        else:
            await _admin(admin, tally, "POST", "/update_weights?bucket=start")
            for data in weights:
                await _admin(admin, tally, "POST", "/update_weights?bucket=add", content=data)
            pushed = await _admin(admin, tally, "POST", f"/update_weights?bucket=commit&weight_version={version}")
        updated = time.perf_counter()
    finally:
        await _admin(admin, tally, "POST", "/resume")
        gate.open.set()
    served = (await _admin(admin, tally, "GET", "/weight_version")).json()["weight_version"]
    return {"weight_version": version, "applied": pushed.status_code == 200 and served == version,
            "pause_status": paused.status_code, "update_status": pushed.status_code,
            "drain_s": drained - start, "update_s": updated - drained, "stall_s": time.perf_counter() - start}


async def _flusher(admin: httpx.AsyncClient, tally: Tally, rng: random.Random, every_s: float,
                   deadline: float) -> None:
    while True:
        await asyncio.sleep(rng.uniform(0.5, 1.5) * every_s)
        if time.monotonic() >= deadline:
            return
        await _admin(admin, tally, "POST", "/flush_cache")
        tally.flushes += 1


async def _admin(admin: httpx.AsyncClient, tally: Tally, method: str, path: str, **kwargs) -> httpx.Response:
    response = await admin.request(method, path, **kwargs)
    tally.admin_by_status[f"{method} {path.split('?')[0]} {response.status_code}"] += 1
    if response.status_code != 200:
        tally.note(f"{method} {path} HTTP {response.status_code}: {response.text[:200]}")
    return response


async def _drained_stats(admin: httpx.AsyncClient) -> dict:
    """GET /stats once nothing runs or waits (disconnected requests are aborted as the server notices)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while (stats := (await admin.get("/stats")).json())["num_running"] + stats["num_waiting"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not drain within {DRAIN_TIMEOUT_S:.0f} s: {stats}")
        await asyncio.sleep(0.1)
    return stats


class RssSampler:
    """The server's RSS every 0.5 s: the peak, the warm-up level, the level after the drain, and a trace of
    (seconds, MiB) every 5 s.

    The warm-up level is the lowest sample in the `window_s` seconds from `warm_at` (monotonic): a window
    that holds a whole update cycle, whose lowest point is the server between updates, as it is at the end
    (drained, the last update done). A single sample would land anywhere in an update's transient."""

    def __init__(self, pid: int, warm_at: float, window_s: float = 0.0):
        self.pid, self.warm_at, self.window_s = pid, warm_at, window_s
        self.warm = self.peak = self.end = 0
        self.trace: list[tuple[float, float]] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        start = time.monotonic()
        while True:
            rss = process_rss_bytes(self.pid)
            self.peak = max(self.peak, rss)
            if time.monotonic() - start >= 5 * len(self.trace):
                self.trace.append((round(time.monotonic() - start, 1), round(rss / 2**20, 1)))
            if self.warm_at <= time.monotonic() <= self.warm_at + self.window_s or (
                    not self.warm and time.monotonic() >= self.warm_at):
                self.warm = min(self.warm or rss, rss)
            if self.stop.is_set():
                self.end = rss
                self.warm = self.warm or rss
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.5)


def process_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _report(tally: Tally, stats: dict, rss: RssSampler, seconds: float) -> dict:
    server_errors = sum(n for code, n in tally.by_status.items() if code.startswith("5"))
    applied = [u for u in tally.updates if u["applied"]]
    return {
        "seconds": seconds, "requests": tally.requests, "by_status": dict(sorted(tally.by_status.items())),
        "transport_errors": dict(tally.transport_errors), "stream_errors": dict(tally.stream_errors),
        "server_errors": server_errors + sum(tally.stream_errors.values()),
        "completed": tally.completed, "disconnected": tally.disconnected, "output_tokens": tally.output_tokens,
        "mixed_version_choices": tally.mixed_version_choices, "weight_versions_seen": sorted(tally.versions_seen),
        "updates_applied": len(applied), "updates_failed": len(tally.updates) - len(applied),
        "final_weight_version": stats["weight_version"],
        "update_stall_p50_s": percentile([u["stall_s"] for u in tally.updates], 50),
        "update_stall_max_s": max((u["stall_s"] for u in tally.updates), default=None),
        "flushes": tally.flushes, "admin_by_status": dict(sorted(tally.admin_by_status.items())),
        "kv_blocks_free": stats["num_kv_blocks_free"], "kv_blocks_total": stats["num_kv_blocks_total"],
        "rss_warmup_mib": rss.warm / 2**20, "rss_end_mib": rss.end / 2**20, "rss_peak_mib": rss.peak / 2**20,
        "rss_growth_pct": 100 * (rss.end - rss.warm) / rss.warm, "rss_trace_s_mib": rss.trace,
        "latency_p50_s": percentile(tally.latency, 50), "latency_p99_s": percentile(tally.latency, 99),
        "ttft_p50_s": percentile(tally.ttft, 50), "ttft_p99_s": percentile(tally.ttft, 99),
        "first_errors": tally.first_errors, "updates": tally.updates}


def format_table(report: dict) -> str:
    w, m, r = report["workload"], report["machine"], report
    head = (f"soak: {w['minutes']} min, {w['clients']} streaming clients (completions + chat, max_tokens "
            f"{w['max_tokens'][0]}-{w['max_tokens'][1]}, {w['disconnect_fraction']:.0%} disconnect early), "
            f"update every {w['update_every_s']:.0f} s, {w['model']} {w['dtype']} on {w['device']}, "
            f"torch {m['torch']}, {m['processor']}")
    return "\n".join([
        head,
        f"requests {r['requests']}: by status {r['by_status']}, transport errors {r['transport_errors']}, "
        f"in-stream errors {r['stream_errors']}; completed {r['completed']}, disconnected {r['disconnected']}, "
        f"{r['output_tokens']} tokens",
        f"weight updates: {r['updates_applied']} applied, {r['updates_failed']} failed (final version "
        f"{r['final_weight_version']}), stall p50 {_s(r['update_stall_p50_s'])} max {_s(r['update_stall_max_s'])}; "
        f"mixed-version choices {r['mixed_version_choices']}; {r['flushes']} cache flushes",
        f"KV blocks free {r['kv_blocks_free']} / {r['kv_blocks_total']} after the drain; server RSS "
        f"{r['rss_warmup_mib']:.0f} MiB after warm-up -> {r['rss_end_mib']:.0f} MiB at the end "
        f"({r['rss_growth_pct']:+.2f}%), peak {r['rss_peak_mib']:.0f} MiB",
        f"latency p50 {_s(r['latency_p50_s'])} p99 {_s(r['latency_p99_s'])}; time to first token p50 "
        f"{_s(r['ttft_p50_s'])} p99 {_s(r['ttft_p99_s'])}"])


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"
