"""Hostile HTTP input: request limits with 400s naming the field (prompt + max_tokens beyond the context
names both numbers, or is cut with clamp_max_tokens), a bucketed update whose trainer dies dropped after
its timeout, an /openapi.json that describes every endpoint, and schemathesis fuzzing every endpoint of
a live server from it (fixed seed, bounded examples): no 5xx, every response in the schema."""

import collections
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref

import httpx
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from safetensors.torch import save
from starlette.testclient import TestClient

from fp8engine.bench.serve_load import free_port, serving, wait_until_healthy
from fp8engine.entrypoints.server import REQUEST_BODIES, ServerSettings, create_app
from tests.conftest import make_engine
from tests.prompts import CHATS, RAW

CONTEXT = 48  # max_model_len of these servers: every generation is short, whatever a request asks
FLAGS = ["--dtype", "float32", "--max-model-len", str(CONTEXT), "--num-kv-blocks", "64"]
EXAMPLES = 25  # per operation and generation mode (positive, negative)
# Fuzzed with schema-invalid requests only: a valid /init_weights_update_group waits (up to its timeout_s) for a
# trainer's rendezvous at the address it names. /pause is resumed after every case, so that the rest of the run is
# served; the other group endpoints answer at once with no group open.
NEGATIVE_ONLY = {"/init_weights_update_group"}
# Not fuzzed: a "schema-invalid" init_info the server still takes (a port as a numeric string) waits for a trainer
# at the address it names, and holds the server's shutdown meanwhile (test_rl_stacks.py checks its bad bodies).
NOT_FUZZED = {"/init_weight_transfer_engine"}
RESUME_AFTER = {"/pause", "/pause_generation"}
# Fuzzed after the rest: a level-2 sleep leaves the server without weights, and so every generation 503.
LAST = {"/sleep", "/wake_up", "/release_memory_occupation", "/resume_memory_occupation"}


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(make_engine(dtype="float32", max_model_len=CONTEXT, num_kv_blocks=64),
                               ServerSettings())) as client:
        yield client


def error_of(response: httpx.Response, status: int, param: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


# ------------------------------------------------------------------ request limits
def test_prompt_plus_max_tokens_beyond_the_context_is_a_400_naming_both(client, tokenizer):
    num_prompt = len(tokenizer(RAW[0])["input_ids"])
    error = error_of(client.post("/v1/completions", json={"prompt": RAW[0], "max_tokens": 2**63}), 400,
                     "max_tokens")
    assert f"({num_prompt} tokens)" in error["message"] and f"({2**63})" in error["message"]
    assert f"context of {CONTEXT} tokens" in error["message"] and error["code"] == "context_length_exceeded"
    chat = {"messages": CHATS[0], "max_completion_tokens": CONTEXT}
    assert "max_completion_tokens (48)" in error_of(client.post("/v1/chat/completions", json=chat), 400,
                                                    "max_completion_tokens")["message"]
    fits = client.post("/v1/completions", json={"prompt": RAW[0], "max_tokens": CONTEXT - num_prompt,
                                                "ignore_eos": True, "temperature": 0})
    assert fits.json()["usage"]["completion_tokens"] == CONTEXT - num_prompt
    unset = client.post("/v1/completions", json={"prompt": RAW[0], "ignore_eos": True, "temperature": 0})
    assert unset.json()["choices"][0]["finish_reason"] == "length"
    assert unset.json()["usage"]["total_tokens"] == CONTEXT

    clamping = make_engine(dtype="float32", max_model_len=CONTEXT, num_kv_blocks=64)  # one app per engine
    with TestClient(create_app(clamping, ServerSettings(clamp_max_tokens=True))) as client:
        clamped = client.post("/v1/completions", json={"prompt": [RAW[0], RAW[1]], "max_tokens": 2**63,
                                                       "ignore_eos": True, "temperature": 0}).json()
        assert [c["finish_reason"] for c in clamped["choices"]] == ["length", "length"]
        assert clamped["usage"]["total_tokens"] == 2 * CONTEXT
        too_long = client.post("/v1/completions", json={"prompt": list(range(1, CONTEXT + 1)), "max_tokens": 1})
        assert f"({CONTEXT} tokens) + max_tokens (1)" in error_of(too_long, 400, "max_tokens")["message"]


LIMITS = [
    ("n", 65), ("n", 0), ("best_of", 2), ("top_k", -2), ("top_k", 1.5), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", 1.5), ("temperature", -1.0), ("temperature", 0.001), ("logprobs", 21), ("logprobs", -1),
    ("max_tokens", -1), ("min_tokens", -1), ("min_tokens", 5), ("stop", ["s"] * 33), ("stop", "x" * 257),
    ("stop_token_ids", list(range(257))), ("stop_token_ids", [-1]),
    ("logit_bias", {str(i): 1.0 for i in range(301)}), ("logit_bias", {"1": 100.5}),
    ("presence_penalty", 2.01), ("frequency_penalty", -2.01), ("repetition_penalty", -1.0),
    ("seed", "x"), ("echo", "maybe"), ("stream", 3), ("prompt", []), ("prompt", [10**9]), ("prompt", ""),
]


@pytest.mark.parametrize("field,value", LIMITS, ids=[f"{f}={str(v)[:12]}" for f, v in LIMITS])
def test_every_field_is_range_checked(client, field, value):
    error_of(client.post("/v1/completions", json={"prompt": RAW[0], "max_tokens": 2, field: value}), 400, field)
    chat = {"messages": CHATS[0], "max_tokens": 2, field: value}
    if field in ("n", "top_k", "top_p", "temperature", "stop", "logit_bias", "presence_penalty", "seed"):
        error_of(client.post("/v1/chat/completions", json=chat), 400, field)


def test_chat_logprob_caps(client):
    for top, param in ((21, "top_logprobs"), (-1, "top_logprobs")):
        body = {"messages": CHATS[0], "logprobs": True, "top_logprobs": top}
        error_of(client.post("/v1/chat/completions", json=body), 400, param)


# ------------------------------------------------------------------ faults
def test_a_bucketed_update_whose_trainer_dies_is_dropped_after_the_timeout():
    engine = make_engine(dtype="float32", max_model_len=CONTEXT, num_kv_blocks=64)
    name = "model.norm.weight"
    new = engine.get_weights_by_name(name) * 1.5
    bucket = save({name: new})
    with TestClient(create_app(engine, ServerSettings(bucket_timeout_s=0.5))) as client:
        assert client.post("/update_weights?bucket=start").status_code == 200
        assert client.post("/update_weights?bucket=add", content=bucket).status_code == 200
        assert client.get("/stats").json()["staged_update_bytes"] == new.numel() * 4
        time.sleep(1.5)  # the trainer died between buckets
        stats = client.get("/stats").json()
        assert stats["staged_update_bytes"] == 0 and stats["weight_version"] == 0
        assert error_of(client.post("/update_weights?bucket=commit&weight_version=5"), 409, "bucket")["code"] == \
            "no_open_update"
        assert client.get("/weight_version").json() == {"weight_version": 0}

        for step in ("start", "add", "commit&weight_version=5"):  # the next update works
            response = client.post(f"/update_weights?bucket={step}", content=bucket if step == "add" else b"")
            assert response.status_code == 200, response.text
        assert response.json()["weight_version"] == 5
        assert torch.equal(engine.get_weights_by_name(name), new)


def test_the_heap_is_trimmed_after_each_weight_update_request_only(monkeypatch):
    """A server updated every RL step gives the update's freed memory back (soak: RSS +17% in 10 minutes
    without it): malloc_trim after each request to an update endpoint, and after nothing else."""
    from fp8engine.entrypoints import server as server_module
    assert server_module.trim_heap() in (True, False)  # callable here (glibc: True or False; else False)
    trims = []
    monkeypatch.setattr(server_module, "trim_heap", lambda: trims.append(1) or True)
    engine = make_engine(dtype="float32", max_model_len=CONTEXT, num_kv_blocks=64)
    name = "model.norm.weight"
    bucket = save({name: engine.get_weights_by_name(name) * 1.5})
    with TestClient(create_app(engine, ServerSettings())) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json={"prompt": RAW[0], "max_tokens": 2}).status_code == 200
        assert trims == []
        assert client.post("/update_weights", content=bucket).status_code == 200
        assert len(trims) == 1
        assert client.post("/update_weights", content=b"not safetensors").status_code == 400
        assert len(trims) == 2  # a refused update allocated its body too
        assert client.get("/weight_version").json() == {"weight_version": 1} and len(trims) == 2


def test_a_closed_app_lets_its_engine_go():
    """FastAPI caches every endpoint callable process-wide: the app's handlers hold the server weakly, so once
    the app is gone its engine (weights and KV cache) is freed (a test suite had grown by one engine per app)."""
    engine = make_engine(dtype="float32", max_model_len=CONTEXT, num_kv_blocks=64)
    with TestClient(create_app(engine, ServerSettings())) as client:
        assert client.post("/v1/completions", json={"prompt": RAW[0], "max_tokens": 2}).status_code == 200
    gone = weakref.ref(engine)
    del engine, client
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_sigterm_stops_accepting_finishes_or_aborts_in_flight_and_exits_0(mode):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "fp8engine.entrypoints.cli", "serve", *FLAGS[:2], "--shutdown", mode,
               "--port", str(port)]
    body = {"prompt": RAW[0], "max_tokens": 300, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "return_token_ids": True}
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_until_healthy(url, server, log, 300)
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
                events = (line for line in response.iter_lines() if line.startswith("data: "))
                chunks = [next(events)]
                server.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                with pytest.raises(httpx.ConnectError):  # no longer accepting, while the stream goes on
                    httpx.get(url + "/health")
                chunks += list(events)
            assert server.wait(timeout=120) == 0
        finally:
            if server.poll() is None:
                server.kill()
    assert chunks[-1] == "data: [DONE]"
    choices = [c for chunk in chunks[:-1] for c in json.loads(chunk[6:])["choices"]]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length" if mode == "wait" else "abort"]
    num_tokens = sum(len(c["token_ids"]) for c in choices)
    assert num_tokens == 300 if mode == "wait" else num_tokens < 300


# ------------------------------------------------------------------ security
def test_streamed_bodies_are_cut_at_the_limit_and_errors_leak_no_details(client, monkeypatch):
    def chunks():  # no Content-Length: the limit must hold while the body streams in
        for _ in range(8):
            yield b"x" * 512

    settings = ServerSettings(max_update_bytes=2048, max_body_bytes=1024)
    limited = TestClient(create_app(client.app.state.server.engine.engine, settings))  # no lifespan: no engine
    assert error_of(limited.post("/update_weights", content=chunks()), 413, "body")["code"] == "body_too_large"
    assert error_of(limited.post("/v1/completions", content=chunks()), 413, "body")["code"] == "body_too_large"

    async def failing_stats():
        raise RuntimeError("cannot read /secret/path/model.safetensors")

    monkeypatch.setattr(client.app.state.server.engine, "stats", failing_stats)
    response = TestClient(client.app, raise_server_exceptions=False).get("/stats")
    assert response.status_code == 500
    assert "/secret" not in response.text and "Traceback" not in response.text
    assert response.json()["error"]["message"].startswith("internal error (RuntimeError)")


# ------------------------------------------------------------------ OpenAPI and fuzzing
def test_openapi_describes_every_endpoint(client):
    app = client.app
    schema = client.get("/openapi.json").json()
    server_routes = {(route.path, method.lower()) for route in app.routes if hasattr(route, "methods")
                     and route.include_in_schema for method in route.methods}
    assert server_routes == {(path, method) for path, item in schema["paths"].items() for method in item}
    for path, model in REQUEST_BODIES.items():
        [operation] = schema["paths"][path].values()
        content = operation["requestBody"]["content"]
        if model is None:
            assert "application/octet-stream" in content
        else:
            assert content["application/json"]["schema"]["$ref"].endswith("/" + model.__name__)
    completion = schema["components"]["schemas"]["CompletionRequest"]
    assert completion["additionalProperties"] is False and {"echo", "logit_bias", "max_tokens"} <= completion[
        "properties"].keys()
    assert all({"200", "400", "401"} <= op["responses"].keys() for item in schema["paths"].values()
               for op in item.values())


def test_schemathesis_finds_no_5xx_and_no_response_outside_the_schema(tiny_qwen3_dir):
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    codes: collections.Counter = collections.Counter()  # (path, status)
    refused: collections.Counter = collections.Counter()  # (path, param) of 400s to schema-valid requests
    # The tiny model: a fuzzed request may ask for hundreds of samples (10 prompts x n=22 happened)
    with serving(["--model", tiny_qwen3_dir, *FLAGS]) as base_url:
        schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
        operations = sorted((op for op in (r.ok() for r in schema.get_all_operations()) if op.path not in NOT_FUZZED),
                            key=lambda op: op.path in LAST)
        assert len(operations) >= 14
        for operation in operations:
            if operation.path not in NEGATIVE_ONLY:
                fuzz(operation, schemathesis.GenerationMode.POSITIVE, base_url, checks, codes, refused)
            if operation.body or operation.query:  # else nothing can be negated
                fuzz(operation, schemathesis.GenerationMode.NEGATIVE, base_url, checks, codes, refused)
    print(f"schemathesis: {sum(codes.values())} requests; " +
          ", ".join(f"{path} {code}: {n}" for (path, code), n in sorted(codes.items())))
    print("schema-valid requests refused, by field: " +
          ", ".join(f"{path} {param}: {n}" for (path, param), n in sorted(refused.items(), key=str)))
    assert not [key for key in codes if key[1] >= 500]
    assert codes["/v1/completions", 200] and codes["/v1/chat/completions", 200] and codes["/update_weights", 200]
    assert codes["/pause", 200] and codes["/update_weights_from_distributed", 400]
    assert codes["/destroy_weights_update_group", 200] and not codes["/init_weights_update_group", 200]


def fuzz(operation, mode, base_url: str, checks: list, codes: collections.Counter,
         refused: collections.Counter) -> None:
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call_and_validate(base_url=base_url, checks=checks, timeout=300)
        if operation.path in RESUME_AFTER:
            httpx.post(base_url + "/resume", timeout=30).raise_for_status()
        codes[operation.path, response.status_code] += 1
        if response.status_code == 400 and mode == "positive":
            refused[operation.path, response.json()["error"]["param"]] += 1

    run()


def test_onednn_keeps_few_compiled_shapes_unless_the_user_says_otherwise(monkeypatch):
    """torch's oneDNN GEMM caches a JIT kernel per shape (1024 by default): a server's prefill sees a new row
    count at almost every step, which grew RSS 14% in a 10-min soak. The engine caps it before its first GEMM."""
    from fp8engine import engine as engine_module
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    engine_module.bound_onednn_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "8"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    engine_module.bound_onednn_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
