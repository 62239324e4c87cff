"""The OpenAI server: parses with the official client, equals the in-process engine, survives load,
disconnects, weight updates during traffic and bad input (with OpenAI-shaped errors)."""

import asyncio
import itertools
import json
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from safetensors.torch import save, save_file
from starlette.testclient import TestClient
from transformers import AutoConfig

import fp8engine
from fp8engine import SamplingParams
from fp8engine.bench.serve_load import serving
from fp8engine.entrypoints.server import ServerSettings, create_app
from fp8engine.weights.loader import iter_safetensors
from tests.checkpoints import perturbed_state
from tests.conftest import make_engine
from tests.prompts import CHATS, RAW

API_KEY, ADMIN_KEY = "test-key", "admin-key"
ENGINE_OPTIONS = dict(dtype="float32", num_kv_blocks=512)
UPDATED = ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight",
           "model.layers.0.post_attention_layernorm.weight")
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = 2048  # max_tokens of requests that must still be running when a pause or disconnect lands
TIMEOUT = 300.0  # seconds to wait for a state before failing with what was seen


class ServerHandle:
    def __init__(self, base_url: str, weight_dir: str):
        self.url = base_url
        self.weight_dir = weight_dir
        self.user = httpx.Client(base_url=base_url, timeout=120, headers=_bearer(API_KEY))
        self.admin = httpx.Client(base_url=base_url, timeout=120, headers=_bearer(ADMIN_KEY))
        self.openai = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0)

    def stats(self) -> dict:
        return self.admin.get("/stats").json()

    def wait_idle(self) -> dict:
        """Stats once no request runs or waits; AssertionError with the last stats after TIMEOUT s."""
        deadline = time.monotonic() + TIMEOUT
        while (stats := self.stats())["num_running"] + stats["num_waiting"]:
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is still busy after {TIMEOUT:.0f} s: {stats}")
            time.sleep(0.05)
        return stats

    def wait_aborted(self) -> dict:
        """Pause in "keep" mode, where no request is stepped and so none can finish, and wait until
        none is left: every request there was has been aborted. Resumes; returns the idle stats."""
        assert self.admin.post("/pause", json={"mode": "keep"}).json()["paused"] == "keep"
        try:
            return self.wait_idle()
        finally:
            self.admin.post("/resume")

    def update_count(self) -> float:
        return _metric(self.user.get("/metrics").text, "fp8engine_update_weights_seconds_count")


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _metric(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


@pytest.fixture(scope="module")
def weight_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("allowed_weights"))


@pytest.fixture(scope="module")
def reference():
    """The in-process engine with the server's EngineConfig."""
    return make_engine(**ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def server(weight_dir) -> ServerHandle:
    flags = ["--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--allowed-weight-dir", weight_dir,
             "--dtype", ENGINE_OPTIONS["dtype"], "--num-kv-blocks", str(ENGINE_OPTIONS["num_kv_blocks"])]
    with serving(flags) as base_url:
        yield ServerHandle(base_url, weight_dir)


@pytest.fixture(autouse=True)
def fresh_server(server) -> None:
    """Every test starts from the same server state, whatever ran before: idle, not paused, the
    original weights (version 0) and an empty prefix cache."""
    stats = server.wait_idle()
    assert stats["paused"] is None and stats["weight_version"] == 0, stats
    assert server.admin.post("/flush_cache").json() == {"flushed": True}


def generate(engine, prompts, params):
    """engine.generate on an empty prefix cache (results don't depend on earlier tests), from a
    worker thread as the server steps its engine: on shared cores torch's main-thread CPU team was
    measured ~10x slower, which would dominate this file's runtime."""
    engine.flush_prefix_cache()
    with ThreadPoolExecutor(1) as worker:
        return worker.submit(engine.generate, prompts, params).result()


def chat_body(messages, **fields) -> dict:
    return {"model": "default", "messages": messages, **fields}


# ------------------------------------------------------------------ OpenAI client
def test_openai_client_parses_completion_chat_stream_n_and_logprobs(server):
    client = server.openai
    done = client.completions.create(model="default", prompt=RAW[0], max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"logprobs_mode": "raw"})
    choice = done.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == done.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(3 <= len(top) <= 4 for top in choice.logprobs.top_logprobs)
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens

    chat = client.chat.completions.create(model="default", messages=CHATS[0], max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"logprobs_mode": "raw"})
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.role == "assistant"
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
               for c in content)
    assert bytes(b for c in content for b in c.bytes).decode() == chat.choices[0].message.content

    stream = client.chat.completions.create(model="default", messages=CHATS[0], max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    many = client.completions.create(model="default", prompt=[RAW[1], RAW[2]], n=3, max_tokens=5, seed=5,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    assert sorted(c.index for c in many.choices) == list(range(6))
    assert all(len(c.model_extra["token_ids"]) == 5 for c in many.choices)
    assert many.usage.completion_tokens == 30
    assert many.usage.prompt_tokens == sum(len(many.choices[i].model_extra["prompt_token_ids"]) for i in (0, 3))


def test_streamed_stop_string_is_held_back_and_never_leaks(server):
    """The stop string spans a token boundary, so without the hold-back its first characters would
    be streamed with the token before it."""
    body = {"prompt": RAW[4], "temperature": 0.0, "max_tokens": 24, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True}
    full = server.user.post("/v1/completions", json=body).json()["choices"][0]
    tokens, text = full["logprobs"]["tokens"], full["text"]
    offsets = full["logprobs"]["text_offset"]
    # the first stop string "<last char of token j><token j+1>" that spans tokens j, j+1, j >= 2
    j, stop = next((j, tokens[j][-1] + tokens[j + 1]) for j in range(2, len(tokens) - 1)
                   if tokens[j].strip() and len(tokens[j + 1].strip()) >= 2
                   and text.find(tokens[j][-1] + tokens[j + 1]) == offsets[j + 1] - 1)
    expected = text[:offsets[j + 1] - 1]

    server.admin.post("/flush_cache")
    stopped = server.user.post("/v1/completions", json=dict(body, stop=[stop])).json()["choices"][0]
    assert stopped["text"] == expected and stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == full["token_ids"][:j + 2]

    server.admin.post("/flush_cache")
    chunks = []
    with server.user.stream("POST", "/v1/completions", json=dict(body, stop=[stop], stream=True)) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks += json.loads(line[6:])["choices"]
    sent = list(itertools.accumulate(c["text"] for c in chunks))
    assert sent[-1] == expected and all(expected.startswith(t) for t in sent)  # nothing sent is taken back
    assert [t for c in chunks for t in c["token_ids"]] == full["token_ids"][:j + 2]
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["stop"]
    assert sum(bool(c["text"]) for c in chunks) >= 2  # the text arrived in pieces, not all at the end


def test_version_and_kv_scales(server, default_dir):
    assert server.user.get("/version").json() == {"version": fp8engine.__version__}
    scales = server.admin.get("/kv_scales").json()
    num_layers = AutoConfig.from_pretrained(default_dir).num_hidden_layers
    assert list(scales) == [f"model.layers.{i}.self_attn" for i in range(num_layers)]
    assert scales == {layer: {"k_scale": k, "v_scale": v} for layer, (k, v) in server.stats()["kv_scales"].items()}
    assert all(pair == {"k_scale": 1.0, "v_scale": 1.0} for pair in scales.values())  # no FP8 KV cache
    assert _error(server.user.get("/kv_scales"), 401)["code"] == "invalid_api_key"


def test_kv_scales_of_an_fp8_kv_cache_are_the_engines():
    """In process (a second server process would cost a model load): external scales sent with
    /update_weights are what /kv_scales, /stats and the engine report."""
    engine = make_engine(dtype="bfloat16", kv_cache_dtype="fp8_e4m3", kv_scale_mode="external", num_kv_blocks=16)
    layer = "model.layers.1.self_attn"
    scales = save({f"{layer}.k_scale": torch.tensor(0.0371), f"{layer}.v_scale": torch.tensor([0.0123])})
    with TestClient(create_app(engine, ServerSettings())) as client:
        before = client.get("/kv_scales").json()
        report = client.post("/update_weights?weight_version=4", content=scales).json()
        after = client.get("/kv_scales").json()
        stats = client.get("/stats").json()
        completion = client.post("/v1/completions", json={"prompt": RAW[0], "max_tokens": 2, "temperature": 0.0})
    assert after == {name: {"k_scale": k, "v_scale": v} for name, (k, v) in engine.get_stats().kv_scales.items()}
    assert after == {name: {"k_scale": k, "v_scale": v} for name, (k, v) in stats["kv_scales"].items()}
    assert after[layer] == {"k_scale": pytest.approx(0.0371), "v_scale": pytest.approx(0.0123)}
    assert {n: s for n, s in after.items() if n != layer} == {n: s for n, s in before.items() if n != layer}
    assert before[layer] != after[layer] and stats["kv_cache_dtype"] == "fp8_e4m3"
    assert (report["num_tensors"], report["num_bytes"], report["weight_version"]) == (0, 8, 4)
    assert completion.json()["usage"]["completion_tokens"] == 2


async def _merged_stream(response: httpx.Response) -> dict:
    """One streamed choice put back together: token ids, logprobs (either shape), prompt ids."""
    merged = {"token_ids": [], "logprobs": []}
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                merged["token_ids"] += choice["token_ids"]
                merged.setdefault("prompt_token_ids", choice.get("prompt_token_ids"))
                lps = choice["logprobs"]
                merged["logprobs"] += ([c["logprob"] for c in lps["content"]] if "content" in lps
                                       else lps["token_logprobs"])
    return merged


def test_greedy_and_seeded_outputs_equal_the_in_process_engine(server, reference):
    """The 12 requests are queued while paused in "keep" mode, so their first step is one batch as
    in generate(): float32 results depend on batch shapes (~2e-5 on logprobs), not on the server."""
    fields = dict(GREEDY, stream=True, logprobs_mode="raw", return_token_ids=True)
    requests = ([("/v1/chat/completions", chat_body(m, logprobs=True, **fields)) for m in CHATS[:6]]
                + [("/v1/completions", {"prompt": p, "logprobs": 0, **fields}) for p in RAW[:6]])

    async def query():
        admin = _bearer(ADMIN_KEY)
        async with httpx.AsyncClient(base_url=server.url, headers=_bearer(API_KEY), timeout=120) as client:
            await client.post("/flush_cache", headers=admin)
            await client.post("/pause", json={"mode": "keep"}, headers=admin)
            responses = [await client.send(client.build_request("POST", path, json=body), stream=True)
                         for path, body in requests]
            await client.post("/resume", headers=admin)
            return [await _merged_stream(r) for r in responses]

    streamed = asyncio.run(query())
    reference.flush_prefix_cache()
    expected = generate(reference, CHATS[:6] + RAW[:6], SamplingParams(**GREEDY, logprobs=0, logprobs_mode="raw"))
    for got, ref in zip(streamed, expected):
        assert got["token_ids"] == ref.outputs[0].token_ids
        assert got["prompt_token_ids"] == ref.prompt_token_ids
        assert max(abs(a - b) for a, b in zip(got["logprobs"], ref.outputs[0].logprobs)) <= 1e-5

    sampled = server.openai.completions.create(model="default", prompt=RAW[2], n=3, max_tokens=8, seed=11,
                                               temperature=1.0, top_p=0.9, extra_body={"return_token_ids": True})
    ref = generate(reference, [RAW[2]], SamplingParams(n=3, max_tokens=8, seed=11, temperature=1.0, top_p=0.9))[0]
    assert [c.model_extra["token_ids"] for c in sampled.choices] == [o.token_ids for o in ref.outputs]
    assert all(c.model_extra["weight_version"] == 0 for c in sampled.choices)


# ------------------------------------------------------------------ load and disconnects
def _sse_summary(chunks: list[dict]) -> dict:
    tokens = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    reasons = [choice["finish_reason"] for c in chunks for choice in c["choices"] if choice["finish_reason"]]
    return {"status": 200, "tokens": tokens, "reasons": reasons}


async def _read_events(lines, stop_after: int | None = None) -> dict:
    chunks = []
    async for line in lines:
        if line.startswith("data: {"):
            chunks.append(json.loads(line[6:]))
            if len(chunks) == stop_after:
                return {"status": 200, "disconnected": True}
        elif line == "data: [DONE]":
            return _sse_summary(chunks)
    return {"status": 200, "incomplete": True}


async def _stream(client: httpx.AsyncClient, body: dict, stop_after: int | None = None) -> dict:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code}
        return await _read_events(response.aiter_lines(), stop_after)


def _load(server: ServerHandle, bodies: list[dict], concurrency: int, stop_after=None) -> list[dict]:
    async def run():
        todo, results = iter(enumerate(bodies)), {}
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=server.url, headers=_bearer(API_KEY), timeout=120,
                                     limits=limits) as client:
            async def worker():
                for i, body in todo:
                    results[i] = await _stream(client, body, stop_after(i) if stop_after else None)
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return [results[i] for i in range(len(bodies))]
    return asyncio.run(run())


def test_64_streaming_clients_200_requests_then_half_disconnect(server):
    bodies = [{"prompt": RAW[i % len(RAW)] + f" ({i})", "max_tokens": 8, "ignore_eos": True, "seed": i,
               "stream": True, "return_token_ids": True} for i in range(200)]
    results = _load(server, bodies, concurrency=64)
    assert all(r["status"] == 200 and len(r["tokens"]) == 8 and r["reasons"] == ["length"] for r in results)
    stats = server.wait_idle()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]

    # Disconnected requests could run LONG tokens: the server only goes idle while paused in "keep"
    # mode (nothing stepped) if it aborted them, however fast or slow it is.
    before = stats
    bodies = [dict(b, max_tokens=LONG if i % 2 else 8) for i, b in enumerate(bodies[:64])]
    results = _load(server, bodies, concurrency=64, stop_after=lambda i: 2 if i % 2 else None)
    assert all(r.get("disconnected") for r in results[1::2])
    assert all(len(r["tokens"]) == 8 for r in results[0::2])
    stats = server.wait_aborted()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    assert stats["num_requests_finished"] - before["num_requests_finished"] == 32  # the others were aborted
    assert stats["num_generation_tokens_total"] - before["num_generation_tokens_total"] >= 32 * 8 + 32 * 2

    async def give_up():  # a non-streaming client that gives up is aborted too
        async with httpx.AsyncClient(base_url=server.url, headers=_bearer(API_KEY), timeout=120) as client:
            body = {"prompt": RAW[0], "max_tokens": LONG, "ignore_eos": True, "temperature": 0.0}
            post = asyncio.create_task(client.post("/v1/completions", json=body))
            await _poll(client, "/stats", lambda s: s["num_running"] == 1)
            post.cancel()
            with pytest.raises(asyncio.CancelledError):
                await post

    before = stats
    asyncio.run(give_up())
    stats = server.wait_aborted()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    assert stats["num_requests_finished"] == before["num_requests_finished"]
    assert stats["num_generation_tokens_total"] > before["num_generation_tokens_total"]

    metrics = server.user.get("/metrics").text
    assert "fp8engine_num_preemptions_total" in metrics
    assert _metric(metrics, "fp8engine_time_to_first_token_seconds_count") >= 264
    assert 'fp8engine_kv_scale{layer="model.layers.0.self_attn",tensor="k"} 1.0' in metrics


# ------------------------------------------------------------------ weight updates
@pytest.fixture(scope="module")
def new_weights(default_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Layer 0's o_proj and norms with seeded noise (perturbing only these keeps the test fast)."""
    subset = tmp_path_factory.mktemp("subset")
    save_file(dict(iter_safetensors(default_dir, lambda name: name in UPDATED)), str(subset / "model.safetensors"))
    return perturbed_state(str(subset), seed=7)


UPDATE_PROMPTS = RAW[:4]


def _greedy_rollouts(engine, prompts) -> dict[str, tuple[list[int], list[float]]]:
    outs = generate(engine, prompts, SamplingParams(**GREEDY, logprobs=0, logprobs_mode="raw"))
    return {p: (o.outputs[0].token_ids, o.outputs[0].logprobs) for p, o in zip(prompts, outs)}


@pytest.fixture(scope="module")
def update_rollouts(reference, new_weights) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """Greedy rollouts of UPDATE_PROMPTS by the in-process engine on the original and on the new
    weights, and the original tensors (the reference engine is left on them)."""
    originals = {name: reference.get_weights_by_name(name).clone() for name in UPDATED}
    old = _greedy_rollouts(reference, UPDATE_PROMPTS)
    reference.update_weights(new_weights, weight_version=1)
    new = _greedy_rollouts(reference, UPDATE_PROMPTS)
    reference.update_weights(originals, weight_version=0)
    # the greedy tokens happen to survive the noise; their logprobs move by far more than the tolerances
    assert all(max(abs(a - b) for a, b in zip(old[p][1], new[p][1])) > 1e-2 for p in UPDATE_PROMPTS)
    return old, new, originals


def _server_greedy(server: ServerHandle) -> dict[str, tuple[list[int], list[float], int]]:
    """UPDATE_PROMPTS in one request, so that they share every step as in the reference generate()."""
    request = {"prompt": UPDATE_PROMPTS, "logprobs": 0, "logprobs_mode": "raw", "return_token_ids": True, **GREEDY}
    body = server.user.post("/v1/completions", json=request).json()
    return {p: (c["token_ids"], c["logprobs"]["token_logprobs"], c["weight_version"])
            for p, c in zip(UPDATE_PROMPTS, body["choices"])}


def _assert_rollouts(got: dict, expected: dict, version: int, tolerance: float) -> None:
    for prompt, (token_ids, logprobs, got_version) in got.items():
        assert token_ids == expected[prompt][0] and got_version == version, prompt
        assert max(abs(a - b) for a, b in zip(logprobs, expected[prompt][1])) <= tolerance, prompt


def test_single_shot_update_equals_the_in_process_update(server, update_rollouts, new_weights):
    old, new, originals = update_rollouts
    updates = server.update_count()
    _assert_rollouts(_server_greedy(server), old, version=0, tolerance=1e-5)

    response = server.admin.post("/update_weights?weight_version=3", content=save(new_weights))
    assert response.status_code == 200, response.text
    report = response.json()
    assert report.pop("seconds") > 0
    num_bytes = sum(t.numel() * t.element_size() for t in new_weights.values())
    assert report == {"num_tensors": 3, "num_bytes": num_bytes, "num_quantized": 0, "weight_version": 3,
                      "num_aborted": 0, "num_kv_recomputed": 0}
    assert server.admin.get("/weight_version").json() == {"weight_version": 3}
    _assert_rollouts(_server_greedy(server), new, version=3, tolerance=1e-5)

    restored = server.admin.post("/update_weights?weight_version=0", content=save(originals)).json()
    assert (restored["num_tensors"], restored["weight_version"]) == (3, 0)
    _assert_rollouts(_server_greedy(server), old, version=0, tolerance=1e-5)
    assert server.update_count() == updates + 2


def _traffic(server: ServerHandle, prompts: list[str], control) -> list[dict]:
    """Greedy n=2 requests from 8 clients (retrying 503s) while `control(client, results)` runs."""
    async def run():
        results, done = [], asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url, headers=_bearer(API_KEY), timeout=120) as client:
            async def worker(k):
                i = k
                while not done.is_set():
                    prompt = prompts[i % len(prompts)]
                    response = await client.post("/v1/completions", json={
                        "prompt": prompt, "n": 2, "logprobs": 0, "logprobs_mode": "raw", "return_token_ids": True,
                        **GREEDY})
                    if response.status_code == 503:
                        await asyncio.sleep(0.05)
                        continue
                    assert response.status_code == 200, response.text
                    results.append((prompt, response.json()))
                    i += 1
            workers = [asyncio.create_task(worker(k)) for k in range(8)]
            try:
                await control(client, results)
            finally:
                done.set()
                await asyncio.gather(*workers)
        return results
    return asyncio.run(run())


def _version(result: tuple[str, dict]) -> int:
    return result[1]["choices"][0]["weight_version"]


async def _until(results, predicate, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while sum(map(predicate, results)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} results wanted after {TIMEOUT:.0f} s, got these weight versions: "
                                 f"{[_version(r) for r in results]}")
        await asyncio.sleep(0.05)


def test_bucketed_update_during_traffic_with_pause_wait(server, update_rollouts, new_weights):
    old, new, originals = update_rollouts
    updates = server.update_count()

    async def update(client: httpx.AsyncClient, results):
        admin = _bearer(ADMIN_KEY)
        await _until(results, lambda r: True, 8)
        assert (await client.post("/pause", json={"mode": "wait"}, headers=admin)).json()["paused"] == "wait"
        stats = (await client.get("/stats", headers=admin)).json()
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert (await client.post("/update_weights?bucket=start", headers=admin)).status_code == 200
        names = list(new_weights)
        for bucket in (names[:1], names[1:]):
            body = save({n: new_weights[n] for n in bucket})
            added = await client.post("/update_weights?bucket=add", content=body, headers=admin)
            assert added.status_code == 200, added.text
        report = (await client.post("/update_weights?bucket=commit&weight_version=1", headers=admin)).json()
        assert report["weight_version"] == 1 and report["num_tensors"] == 3
        assert (await client.post("/resume", headers=admin)).status_code == 200
        await _until(results, lambda r: _version(r) == 1, 8)

    results = _traffic(server, UPDATE_PROMPTS, update)
    versions = {_version(r) for r in results}
    assert versions == {0, 1}
    for prompt, body in results:  # batch shapes follow live traffic: float32 logprobs move by ~2e-5
        assert len({c["weight_version"] for c in body["choices"]}) == 1
        expected = (old if _version((prompt, body)) == 0 else new)[prompt]
        for choice in body["choices"]:
            assert choice["token_ids"] == expected[0]
            assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], expected[1])) <= 1e-4
    assert server.admin.get("/weight_version").json() == {"weight_version": 1}

    restore_dir = os.path.join(server.weight_dir, "restore")
    os.makedirs(restore_dir)
    save_file({n: t.contiguous() for n, t in originals.items()}, os.path.join(restore_dir, "model.safetensors"))
    restored = server.admin.post("/update_weights_from_disk", json={"path": restore_dir, "weight_version": 0})
    assert restored.status_code == 200 and restored.json()["weight_version"] == 0
    _assert_rollouts(_server_greedy(server), old, version=0, tolerance=1e-5)
    assert server.update_count() == updates + 2


# ------------------------------------------------------------------ pause modes
async def _poll(client: httpx.AsyncClient, path: str, predicate) -> dict:
    deadline = time.monotonic() + TIMEOUT
    while not predicate(body := (await client.get(path, headers=_bearer(ADMIN_KEY))).json()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not satisfy the condition within {TIMEOUT:.0f} s: {body}")
        await asyncio.sleep(0.05)
    return body


def test_pause_abort_keep_and_wait(server, reference):
    """Requests that must still be running when a pause lands ask for LONG tokens, and the rest are
    checked for what holds at any speed, so no assert depends on how fast the server is."""
    fields = {"temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    aborted_body = dict(fields, prompt=RAW[3], max_tokens=LONG)
    kept_body = dict(fields, prompt=RAW[6], max_tokens=LONG)
    held_body = dict(fields, prompt=RAW[5], max_tokens=4, stream=False)
    waited_body = dict(fields, prompt=RAW[7], max_tokens=8)
    seen = {}

    async def run():
        admin = _bearer(ADMIN_KEY)
        async with httpx.AsyncClient(base_url=server.url, headers=_bearer(API_KEY), timeout=120) as client:
            async def pause(mode: str) -> dict:
                return (await client.post("/pause", json={"mode": mode}, headers=admin)).json()

            async def stats() -> dict:
                return (await client.get("/stats", headers=admin)).json()

            async def started(body: dict) -> tuple[list[int], AsyncIterator[str]]:
                request = client.build_request("POST", "/v1/completions", json=body)
                response = await client.send(request, stream=True)
                lines = response.aiter_lines()
                return json.loads((await anext(lines))[6:])["choices"][0]["token_ids"], lines  # it is running

            first, lines = await started(aborted_body)
            seen["aborted"] = await pause("abort")
            seen["refused"] = await client.post("/v1/completions", json=dict(aborted_body, stream=False))
            seen["cut"] = first, await _read_events(lines)
            await client.post("/resume", headers=admin)

            first, lines = await started(kept_body)
            seen["kept"] = await pause("keep")
            seen["frozen"] = await _poll(client, "/stats", lambda s: s["num_running"] + s["num_waiting"] == 1)
            held = asyncio.create_task(client.post("/v1/completions", json=held_body))  # accepted, not stepped
            seen["held"] = await _poll(client, "/stats", lambda s: s["num_running"] + s["num_waiting"] == 2)
            await client.post("/resume", headers=admin)
            seen["held_done"] = (await held).json()
            seen["kept_aborted"] = await pause("abort")
            seen["resumed"] = first, await _read_events(lines)
            await client.post("/resume", headers=admin)

            before = await stats()
            first, lines = await started(waited_body)
            seen["wait"] = await pause("wait")  # answers once nothing runs
            seen["before_wait"], seen["after_wait"] = before, await stats()
            seen["refused_wait"] = await client.post("/v1/completions", json=held_body)
            seen["waited"] = first, await _read_events(lines)
            await client.post("/resume", headers=admin)

    asyncio.run(run())
    assert seen["aborted"] == {"paused": "abort", "num_aborted": 1}
    assert seen["refused"].status_code == 503 and seen["refused"].json()["error"]["code"] == "paused"
    first, cut = seen["cut"]
    assert cut["reasons"] == ["abort"] and len(first + cut["tokens"]) < LONG

    assert seen["kept"] == {"paused": "keep", "num_aborted": 0} and seen["frozen"]["paused"] == "keep"
    assert seen["held"]["num_generation_tokens_total"] == seen["frozen"]["num_generation_tokens_total"]
    assert seen["kept_aborted"] == {"paused": "abort", "num_aborted": 1}
    first, rest = seen["resumed"]
    kept_ids = first + rest["tokens"]
    assert rest["reasons"] == ["abort"] and len(kept_ids) < LONG

    assert seen["wait"] == {"paused": "wait", "num_aborted": 0}
    assert seen["after_wait"]["num_running"] == seen["after_wait"]["num_waiting"] == 0
    assert seen["after_wait"]["num_requests_finished"] == seen["before_wait"]["num_requests_finished"] + 1
    assert seen["refused_wait"].status_code == 503
    first, rest = seen["waited"]
    assert rest["reasons"] == ["length"]

    # greedy: the kept request resumed exactly where it was, and the held one ran from its start
    expected = generate(reference, [RAW[6], RAW[5], RAW[7]],
                        [SamplingParams(**dict(GREEDY, max_tokens=n)) for n in (len(kept_ids), 4, 8)])
    assert kept_ids == expected[0].outputs[0].token_ids
    assert seen["held_done"]["choices"][0]["token_ids"] == expected[1].outputs[0].token_ids
    assert first + rest["tokens"] == expected[2].outputs[0].token_ids
    assert server.user.get("/health").json() == {"status": "ok", "paused": None}


# ------------------------------------------------------------------ bad input
def _error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, tmp_path):
    user, admin = server.user, server.admin
    ok = {"prompt": RAW[0], "max_tokens": 2}
    assert _error(user.post("/v1/completions", content=b"{not json"), 400)["code"] == "invalid_json"
    _error(user.post("/v1/completions", json=dict(ok, max_tokens=-1)), 400, "max_tokens")
    _error(user.post("/v1/completions", json=dict(ok, n=100_000)), 400, "n")
    _error(user.post("/v1/completions", json=dict(ok, top_p=0.0)), 400, "top_p")
    _error(user.post("/v1/completions", json=dict(ok, prompt=[10**9])), 400, "prompt")
    _error(user.post("/v1/chat/completions", json=chat_body([{"role": "user"}])), 400, "messages")
    _error(user.post("/v1/chat/completions", json=chat_body(CHATS[0], top_logprobs=2)), 400, "top_logprobs")
    assert _error(user.post("/v1/completions", json=dict(ok, model="gpt-4")), 404, "model")["code"] == \
        "model_not_found"
    _error(user.post("/v1/completions", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}'), 413)

    _error(httpx.post(server.url + "/v1/completions", json=ok), 401)
    _error(httpx.post(server.url + "/v1/completions", json=ok, headers=_bearer("wrong")), 401)
    _error(user.post("/pause", json={"mode": "abort"}), 401)
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in server.openai.models.list().data] == ["default"]

    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"x": torch.zeros(1)}, str(outside / "model.safetensors"))
    link = os.path.join(server.weight_dir, "link")
    os.symlink(outside, link)
    for path in (str(outside), os.path.join(server.weight_dir, "..", "outside"), link, "/etc"):
        _error(admin.post("/update_weights_from_disk", json={"path": path}), 403, "path")

    version = admin.get("/weight_version").json()["weight_version"]
    assert admin.post("/update_weights?bucket=start").status_code == 200
    _error(admin.post("/update_weights?bucket=add", content=b"not safetensors"), 400, "body")
    assert _error(admin.post("/update_weights?bucket=commit"), 409)["code"] == "no_open_update"
    wrong_shape = save({UPDATED[1]: torch.ones(7)})
    assert admin.post("/update_weights?bucket=start").status_code == 200
    assert UPDATED[1] in _error(admin.post("/update_weights?bucket=add", content=wrong_shape), 400)["message"]
    assert UPDATED[1] in _error(admin.post("/update_weights", content=wrong_shape), 400)["message"]
    _error(admin.post("/update_weights?bucket=sometimes", content=wrong_shape), 400, "bucket")
    assert admin.get("/weight_version").json()["weight_version"] == version

    assert admin.post("/pause", json={"mode": "wait"}).status_code == 200
    _error(user.post("/v1/completions", json=ok), 503)
    assert admin.post("/resume").status_code == 200
    assert user.post("/v1/completions", json=ok).json()["usage"]["completion_tokens"] == 2
