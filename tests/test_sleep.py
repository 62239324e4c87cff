"""Colocated RL: sleep hands the weights' and the KV cache's memory back at once, wake_up takes it back, and a
batch-invariant engine's outputs after waking are the bits it gave before (engine.py, sleep / wake_up;
model_executor/host_memory.py)."""

import base64
import glob
import mmap
import os
import pickle
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from starlette.testclient import TestClient

from fp8engine import SamplingParams
from fp8engine.entrypoints.server import ServerSettings, create_app
from fp8engine.model_executor import host_memory
from tests.checkpoints import perturbed_state
from tests.conftest import make_engine
from tests.tiny_models import tiny_dir  # noqa: F401 (fixture)

PROMPTS = [list(range(100, 131)), [5, 6, 7], list(range(40, 60))]
PARAMS = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3, logprobs=2)
FULL_FP8 = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_attention=True)
KV_BYTES = 96 << 20
ROOT = Path(__file__).resolve().parents[1]


def _status(*keys: str) -> int:
    """The sum of /proc/self/status fields (kB) in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[k].split()[0]) for k in keys) << 10


def resident() -> int:
    return _status("RssAnon", "RssShmem")


def machine_used() -> int:
    """MemTotal - MemAvailable, less the free pages the CPUs keep on their own lists: a 6.x kernel keeps up to
    hundreds of MB there (/proc/zoneinfo's pageset counts) out of MemFree, and which pages a free lands on is
    luck (200 MB released: MemAvailable rose by 8-102 MB, by 199-200 MB counting those lists)."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) << 10 for line in f}
    with open("/proc/zoneinfo") as f:
        per_cpu = sum(int(x) for x in re.findall(r"^\s+count:\s+(\d+)", f.read(), re.M))
    return info["MemTotal"] - info["MemAvailable"] - per_cpu * mmap.PAGESIZE


def outputs(engine) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.generate(PROMPTS, PARAMS)]


def checkpoint(model: str) -> dict[str, torch.Tensor]:
    state = {}
    for path in glob.glob(f"{model}/*.safetensors"):
        state |= load_file(path)
    return state


def sleepy_engine(model: str, tmp_path, **kwargs):
    """A batch-invariant engine whose KV cache is all resident (every page written once)."""
    engine = make_engine(model, batch_invariant=True, kv_cache_memory_bytes=KV_BYTES,
                         sleep_spill_dir=str(tmp_path), **kwargs)
    engine.runner.kv_cache.view(torch.uint8).zero_()
    return engine


@pytest.mark.parametrize("mode", [{}, FULL_FP8], ids=["bf16", "full-fp8"])
def test_level_1_returns_the_memory_at_once_and_wakes_to_the_same_bits(tiny_dir, tmp_path, mode):  # noqa: F811
    engine = sleepy_engine(tiny_dir("llama-yarn"), tmp_path, **mode)
    before, scales = outputs(engine), engine.get_stats().kv_scales
    plan, where = engine.runner.model.fused, {n: p.data_ptr() for n, p in engine.named_parameters()}
    weights = engine.runner.resident_bytes("weights")
    assert engine.get_stats().resident_bytes == {"weights": weights, "kv_cache": KV_BYTES}

    rss, used = resident(), machine_used()
    report = engine.sleep(1)
    freed_rss, freed_used = rss - resident(), used - machine_used()

    assert report.tags == ["weights", "kv_cache"] and report.level == 1
    assert report.num_bytes == weights + KV_BYTES
    assert freed_rss >= 0.9 * report.num_bytes, (freed_rss, report.num_bytes)
    assert freed_used >= 0.9 * report.num_bytes, (freed_used, report.num_bytes)
    stats = engine.get_stats()
    assert engine.is_sleeping() and stats.sleeping == {"weights": 1, "kv_cache": 1}
    assert stats.resident_bytes == {"weights": 0, "kv_cache": 0}
    assert not list(tmp_path.iterdir())  # the spill file is unlinked: nothing is left if the process dies
    with pytest.raises(RuntimeError, match=r"asleep: weights \(level 1\), kv_cache \(level 1\).*wake_up"):
        engine.generate(PROMPTS, PARAMS)
    assert not engine.has_unfinished_requests()  # refused before anything was queued

    woken = engine.wake_up()
    assert woken.tags == ["weights", "kv_cache"] and not engine.is_sleeping()
    assert {n: p.data_ptr() for n, p in engine.named_parameters()} == where
    assert engine.runner.model.fused is plan and engine.get_stats().decoder_backend == "cpp-plan"
    assert engine.get_stats().kv_scales == scales
    assert outputs(engine) == before
    assert engine.get_stats().weight_version == 0


def test_kv_cache_alone_sleeps_and_the_weights_stay(tiny_dir, tmp_path):  # noqa: F811
    engine = sleepy_engine(tiny_dir("llama-yarn"), tmp_path, **FULL_FP8)
    before = outputs(engine)
    rss = resident()
    report = engine.sleep(1, tags=["kv_cache"])
    assert report.tags == ["kv_cache"] and report.num_bytes == KV_BYTES
    assert rss - resident() >= 0.9 * KV_BYTES
    assert engine.get_stats().resident_bytes["weights"] == engine.runner.resident_bytes("weights")
    assert engine.sleep(1, tags=["kv_cache"]).tags == []  # asleep already: nothing to do
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.generate(PROMPTS, PARAMS)
    assert engine.wake_up(["kv_cache"]).tags == ["kv_cache"] and engine.wake_up().tags == []
    assert outputs(engine) == before


def test_level_2_refuses_to_generate_until_every_weight_is_committed_again(tiny_dir, tmp_path):  # noqa: F811
    model = tiny_dir("llama-yarn")
    gen = torch.Generator().manual_seed(7)
    state = checkpoint(model)
    new = {n: t + (torch.randn(t.shape, generator=gen) * 0.05).to(t.dtype) for n, t in state.items()}
    engine = sleepy_engine(model, tmp_path, **FULL_FP8)
    original = outputs(engine)

    engine.sleep(2)
    assert not list(tmp_path.iterdir())  # level 2 keeps nothing
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights(new)  # the weights are not there to write into
    engine.wake_up(["weights"])
    half = dict(list(new.items())[:len(new) // 2])
    engine.update_weights(half)  # staged wake: weights, update, then the KV cache
    engine.wake_up(["kv_cache"])
    missing = engine.get_stats().weights_missing
    assert missing == len(new) - len(half)
    with pytest.raises(RuntimeError, match=rf"sleep\(level=2\) and {missing} of them"):
        engine.generate(PROMPTS, PARAMS)
    report = engine.update_weights(new, weight_version=5)
    assert report.weight_version == 5 and engine.get_stats().weights_missing == 0

    fresh = make_engine(model, batch_invariant=True, **FULL_FP8)
    fresh.update_weights(new, weight_version=5)
    assert outputs(engine) == outputs(fresh) != original

    engine.sleep(2)
    engine.wake_up()
    engine.reload_weights()  # the model directory's weights, without a trainer
    assert outputs(engine) == original


def test_three_cycles_leave_the_memory_where_it_was(tiny_dir, tmp_path):  # noqa: F811
    engine = sleepy_engine(tiny_dir("llama-yarn"), tmp_path)
    before = outputs(engine)
    after = []
    for _ in range(3):
        engine.sleep(1)
        engine.wake_up()
        assert outputs(engine) == before
        after.append(_status("RssAnon"))
    assert abs(after[2] - after[0]) <= 32 << 20, after
    assert engine.get_stats().num_sleeps_total == 3


def test_in_flight_requests_kept_are_recomputed_after_wake(tiny_dir, tmp_path):  # noqa: F811
    engine = sleepy_engine(tiny_dir("llama-yarn"), tmp_path)
    alone = outputs(engine)
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    report = engine.sleep(1, in_flight="keep")
    assert report.num_kv_recomputed == len(PROMPTS) and report.num_aborted == 0
    engine.wake_up()
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    got = [(done[i].outputs[0].token_ids, done[i].outputs[0].logprobs) for i in ids]
    assert got == alone
    assert [done[i].outputs[0].num_kv_recomputes for i in ids] == [1, 1, 1]


def test_bad_calls_change_nothing(tiny_dir, tmp_path):  # noqa: F811
    engine = make_engine(tiny_dir("llama-yarn"), num_kv_blocks=64, sleep_spill_dir="/dev/shm")
    with pytest.raises(ValueError, match="unknown sleep tag"):
        engine.sleep(1, tags=["weights", "kv"])
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        engine.sleep(3)
    with pytest.raises(ValueError, match="in_flight"):
        engine.sleep(1, in_flight="later")
    with pytest.raises(ValueError, match="unknown sleep tag"):
        engine.wake_up(["cache"])
    if host_memory.memory_filesystem("/dev/shm") == "tmpfs":
        with pytest.raises(ValueError, match="'/dev/shm' is on tmpfs"):
            engine.sleep(1)
    assert not engine.is_sleeping()
    engine.sleep(2, tags=["kv_cache"])  # no spill needed
    assert engine.get_stats().sleeping == {"kv_cache": 2}
    engine.wake_up()
    assert len(engine.generate(PROMPTS, PARAMS)) == 3


def test_http_sleep_routes_vllm_and_sglang(tiny_dir, tmp_path):  # noqa: F811
    """vLLM's /sleep, /wake_up, /is_sleeping and SGLang's /release_memory_occupation, /resume_memory_occupation:
    the admin key, 503 for generation while asleep (and after a level-2 wake until an update has every weight),
    the state in /stats and /metrics."""
    model = tiny_dir("llama-yarn")
    engine = make_engine(model, num_kv_blocks=64, sleep_spill_dir=str(tmp_path))
    admin, user = {"Authorization": "Bearer admin"}, {"Authorization": "Bearer user"}
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    with open(glob.glob(f"{model}/*.safetensors")[0], "rb") as f:
        checkpoint_bytes = f.read()
    with TestClient(create_app(engine, ServerSettings(api_key="user", admin_key="admin"))) as client:
        def complete():
            return client.post("/v1/completions", json=body, headers=user)

        expected = complete().json()["choices"][0]["token_ids"]
        assert client.post("/sleep", headers=user).status_code == 401
        assert client.get("/is_sleeping", headers=user).status_code == 401
        assert client.get("/is_sleeping", headers=admin).json() == {"is_sleeping": False}
        assert client.post("/sleep?level=1&tags=kv", headers=admin).status_code == 400
        slept = client.post("/sleep?level=1&tags=kv_cache", headers=admin).json()
        assert slept["tags"] == ["kv_cache"] and slept["is_sleeping"] and slept["num_bytes"] > 0
        refused = complete()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "sleeping"
        assert "kv_cache (level 1)" in refused.json()["error"]["message"]
        metrics = client.get("/metrics", headers=user).text
        assert 'fp8engine_resident_bytes{tag="kv_cache"} 0.0' in metrics and "fp8engine_is_sleeping 1.0" in metrics
        assert client.post("/wake_up?tags=kv_cache", headers=admin).json()["is_sleeping"] is False
        assert complete().json()["choices"][0]["token_ids"] == expected

        with ThreadPoolExecutor(1) as pool:  # a request in flight when the engine sleeps ends, it does not hang
            long = pool.submit(client.post, "/v1/completions", json=body | {"max_tokens": 400}, headers=user)
            while not client.get("/stats", headers=admin).json()["num_running"]:
                time.sleep(0.01)
            assert client.post("/sleep?mode=abort&tags=kv_cache", headers=admin).json()["num_aborted"] == 1
            aborted = long.result(timeout=60).json()["choices"][0]
        assert aborted["finish_reason"] == "abort" and len(aborted["token_ids"]) < 400
        client.post("/wake_up", headers=admin)

        released = client.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache", "cuda_graph"]},
                               headers=admin).json()
        assert released["tags"] == ["weights", "kv_cache"] and released["level"] == 2
        assert client.get("/stats", headers=admin).json()["sleeping"] == {"weights": 2, "kv_cache": 2}
        woken = client.post("/resume_memory_occupation", json={"tags": ["weights"]}, headers=admin).json()
        assert woken["tags"] == ["weights"] and woken["is_sleeping"] is True
        assert client.post("/wake_up?tags=weights&tags=kv_cache", headers=admin).json()["tags"] == ["kv_cache"]
        refused = complete()
        assert refused.status_code == 503 and "sleep(level=2)" in refused.json()["error"]["message"]
        updated = client.post("/update_weights?weight_version=3", content=checkpoint_bytes, headers=admin)
        assert updated.status_code == 200, updated.text
        assert client.get("/stats", headers=admin).json()["weights_missing"] == 0
        assert complete().json()["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_weights_from_tensor_takes_handles_from_another_process(tiny_dir, load_format):  # noqa: F811
    """A trainer process hands its tensors over as handles to shared memory (SGLang's update_weights_from_tensor
    over HTTP): the engine's weights are then those update_weights writes from the same tensors, bit for bit, and
    what crossed the pipe from the trainer is the handles, not the tensors."""
    model = tiny_dir("llama-yarn")
    trainer = subprocess.Popen([sys.executable, str(ROOT / "tests" / "tensor_handover.py"), model, "11",
                                str(load_format)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
                               env=os.environ | {"PYTHONPATH": str(ROOT)})
    try:
        line = trainer.stdout.readline()
        handed, direct = (make_engine(model, quantization="fp8", num_kv_blocks=64) for _ in range(2))
        body = {"serialized_named_tensors": [line.decode().strip()], "load_format": load_format,
                "weight_version": 2}
        with TestClient(create_app(handed, ServerSettings())) as client:
            report = client.post("/update_weights_from_tensor", json=body)
        assert report.status_code == 200, report.text
    finally:
        trainer.communicate(b"\n", timeout=60)
    state = perturbed_state(model, 11)
    direct.update_weights(state, weight_version=2)
    assert report.json()["num_tensors"] == len(state) and report.json()["weight_version"] == 2
    tensor_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert len(line) < 0.01 * tensor_bytes, (len(line), tensor_bytes)
    mine, theirs = dict(handed.named_parameters()), dict(direct.named_parameters())
    assert all(torch.equal(mine[n].view(torch.uint8), theirs[n].view(torch.uint8)) for n in mine)


class _Shell:
    def __reduce__(self):
        return os.system, ("true",)


def test_a_pickle_naming_any_other_global_is_refused_and_changes_nothing(tiny_dir):  # noqa: F811
    engine = make_engine(tiny_dir("llama-yarn"), num_kv_blocks=64)
    before = {n: p.clone() for n, p in engine.named_parameters()}
    evil = base64.b64encode(pickle.dumps([("model.norm.weight", _Shell())])).decode()
    with TestClient(create_app(engine, ServerSettings())) as client:
        refused = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
        garbage = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["not base64!"]})
    assert refused.status_code == 400 and f"{os.system.__module__}.system" in refused.json()["error"]["message"]
    assert garbage.status_code == 400 and "base64" in garbage.json()["error"]["message"]
    assert engine.get_stats().weight_version == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.named_parameters())
    with pytest.raises(ValueError, match="system"):
        engine.update_weights_from_tensor([evil])
