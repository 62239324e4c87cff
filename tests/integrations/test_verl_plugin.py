"""fp8engine.integrations.verl without a trainer: the config and sampling mappings, and the server actor's class
driven in-process (no Ray) as veRL's replica and rollout call it: generate, abort / resume, sleep / wake, a
bucketed shared-memory sync committed once. Runs in veRL's environment (`make test-integrations`)."""

import asyncio
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("verl")
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.workers.config import RolloutConfig
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import RolloutMode, RolloutReplicaRegistry

from fp8engine import default_model_path
from fp8engine.integrations import verl as plugin
from fp8engine.weights import tensor_handles

HERE = Path(__file__).resolve().parent


def rollout_config(**overrides) -> RolloutConfig:
    values = dict(name="fp8engine", tensor_model_parallel_size=1, prompt_length=32, response_length=8,
                  load_format="auto", free_cache_engine=True, max_num_seqs=8,
                  engine_kwargs={"fp8engine": {"kv_cache_memory_bytes": 16 << 20}})
    return RolloutConfig(**(values | overrides))


def test_registered_by_import():
    assert RolloutReplicaRegistry.get("fp8engine") is plugin.FP8EngineReplica
    assert get_rollout_class("fp8engine", "async") is plugin.FP8EngineRollout


def test_engine_config_from_rollout_config():
    model = default_model_path()
    config = plugin.engine_config(rollout_config(quantization="fp8", engine_kwargs={
        "fp8engine": {"kv_cache_dtype": "fp8_e4m3", "batch_invariant": True}}), model)
    assert (config.model, config.quantization, config.kv_cache_dtype, config.batch_invariant) == (
        model, "fp8", "fp8_e4m3", True)
    assert config.max_model_len == 40 and config.seed == 42 and config.load_format == "auto"
    assert plugin.engine_config(rollout_config(load_format="dummy"), model).load_format == "dummy"
    with pytest.raises(ValueError, match="unknown option.*'kv_dtype'"):
        plugin.engine_config(rollout_config(engine_kwargs={"fp8engine": {"kv_dtype": "fp8"}}), model)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        plugin.engine_config(rollout_config(tensor_model_parallel_size=2), model)
    with pytest.raises(ValueError, match="quantization='awq'"):
        plugin.engine_config(rollout_config(quantization="awq"), model)


def test_sampling_params_mapping():
    config = rollout_config(response_length=8, prompt_length=32, repetition_penalty=1.1)
    params = plugin.to_sampling_params({"temperature": 0.7, "top_p": 0.9, "top_k": 5, "logprobs": True}, 10, config, 40)
    assert (params.max_tokens, params.logprobs, params.logprobs_mode, params.repetition_penalty, params.top_k) == (
        8, 0, "processed", 1.1, 5)
    assert plugin.to_sampling_params({"logprobs": False}, 10, config, 40).logprobs is None
    assert plugin.to_sampling_params({}, 36, config, 40).max_tokens == 4  # what the multi-turn prompt left
    assert plugin.to_sampling_params({"max_tokens": 100}, 10, config, 40).max_tokens == 30  # max_model_len
    with pytest.raises(ValueError, match="unsupported key.*'best_of'"):
        plugin.to_sampling_params({"best_of": 2}, 10, config, 40)
    with pytest.raises(TypeError, match="must be a bool"):
        plugin.to_sampling_params({"logprobs": 5}, 10, config, 40)
    with pytest.raises(ValueError, match="no room"):
        plugin.to_sampling_params({}, 40, config, 40)


@pytest.fixture(scope="module")
def server():
    model = types.SimpleNamespace(local_path=default_model_path(), lora={}, lora_rank=0)
    server = plugin.FP8EngineServer(rollout_config(), model, RolloutMode.HYBRID, 0)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(server.launch_server())
    yield server, loop
    server.engine.stop()
    loop.close()


def test_generate_token_output(server):
    server, loop = server
    prompt = server.engine.engine.tokenize("Count to five, then name three colors, two animals, four rivers and "
                                           "one mountain, slowly please:")
    assert 16 < len(prompt) <= 32  # a whole KV block of it can come from the prefix cache
    out = loop.run_until_complete(server.generate(prompt, {"temperature": 1.0, "logprobs": True, "seed": 3}, "r1"))
    again = loop.run_until_complete(server.generate(prompt, {"temperature": 1.0, "logprobs": True, "seed": 3}, "r2"))
    assert len(out.token_ids) == 8 and len(out.log_probs) == 8 and out.stop_reason == "completed"
    assert (again.token_ids, again.log_probs) == (out.token_ids, out.log_probs)  # the seed reproduces the sample
    assert all(lp <= 0 for lp in out.log_probs) and out.num_preempted == 0
    version = server.engine.engine.weight_version
    assert out.extra_fields == {"global_steps": version, "min_global_steps": version, "max_global_steps": version,
                                "num_cached_tokens": 0}
    assert again.extra_fields["num_cached_tokens"] == 16  # the prompt's first block came from the prefix cache
    with pytest.raises(ValueError, match="image_data"):
        loop.run_until_complete(server.generate(prompt, {}, "r3", image_data=[object()]))


def test_abort_holds_then_resume(server):
    server, loop = server
    prompt = server.engine.engine.tokenize("Hello")

    async def scenario():
        first = asyncio.create_task(server.generate(prompt, {"ignore_eos": True, "max_tokens": 8}, "a1"))
        await asyncio.sleep(0)
        await server.abort_all_requests()
        held = asyncio.create_task(server.generate(prompt, {"max_tokens": 2}, "a2"))
        await asyncio.sleep(0.2)
        assert not held.done()  # parked behind the closed gate
        rejected = None
        server._rejecting = True
        rejected = await server.generate(prompt, {}, "a3")
        server._rejecting = False
        await server.resume_generation()
        return await first, await held, rejected

    first, held, rejected = loop.run_until_complete(scenario())
    assert first.stop_reason == "aborted" and len(first.token_ids) < 8
    assert held.stop_reason == "completed" and len(held.token_ids) == 2
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []


def test_sleep_sync_wake_in_buckets(server):
    """veRL's hybrid order: sleep (level 2), resume(["weights"]), update_weights in buckets, resume(["kv_cache"]);
    the engine refuses to generate until every weight is committed, then holds exactly what was sent."""
    server, loop = server
    engine = server.engine.engine
    torch.multiprocessing.set_sharing_strategy("file_system")
    names = plugin.FP8EngineServer.expected_weight_names
    expected = loop.run_until_complete(names(server))
    weights = [(n, engine.get_weights_by_name(n).float() * 1.01) for n in expected]

    async def sync():
        await server.sleep()
        assert engine.sleeping == {"weights": 2, "kv_cache": 2}
        await server.wake_up(["weights"])
        half = len(weights) // 2
        assert await server.update_weights_from_tensor([tensor_handles.dumps(weights[:half])], flush=False) is None
        report = await server.update_weights_from_tensor([tensor_handles.dumps(weights[half:])], flush=True,
                                                         weight_version=7)
        await server.wake_up(["kv_cache"])
        return report

    report = loop.run_until_complete(sync())
    assert report["num_tensors"] == len(expected) and report["weight_version"] == 7 and engine.ready()
    for name, tensor in weights[:: max(1, len(weights) // 20)]:
        assert torch.equal(engine.get_weights_by_name(name), tensor.to(engine.runner.dtype)), name
    out = loop.run_until_complete(server.generate(engine.tokenize("Hi"), {}, "s1"))
    assert out.extra_fields["global_steps"] == 7


def test_shared_bucket_mixed_dtypes():
    bucket = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.randn(5, 7)), ("c", torch.arange(3)),
              ("d", torch.ones(2, 3, dtype=torch.float16))]
    flat = plugin.shared_bucket(bucket)
    assert flat["flattened_tensor"].is_shared()
    assert [(n, torch.equal(t, dict(bucket)[n])) for n, t in tensor_handles.unflatten(flat)] == [
        (n, True) for n, _ in bucket]
    cast = dict(tensor_handles.unflatten(plugin.shared_bucket(bucket, torch.bfloat16)))  # floats to the model dtype
    assert [cast[n].dtype for n in "abcd"] == [torch.bfloat16, torch.bfloat16, torch.int64, torch.bfloat16]
    assert torch.equal(cast["b"], dict(bucket)["b"].to(torch.bfloat16)) and torch.equal(cast["c"], torch.arange(3))


def test_rollout_refuses_delta_flush():
    rollout = plugin.FP8EngineRollout.__new__(plugin.FP8EngineRollout)
    with pytest.raises(NotImplementedError, match="delta_flush"):
        asyncio.run(plugin.FP8EngineRollout.update_weights(rollout, iter(()), wire_format="delta_flush"))
    with pytest.raises(ValueError, match="wire_format"):
        asyncio.run(plugin.FP8EngineRollout.update_weights(rollout, iter(()), wire_format="bytes"))


class _Handle:
    """Stands in for a Ray actor handle in-process: handle.method.remote(...) is awaitable."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        return types.SimpleNamespace(remote=getattr(self._target, name))


def test_rollout_syncs_in_flat_buckets_committed_once(server):
    """FP8EngineRollout.update_weights as veRL's worker calls it: many buckets (1 MiB), one commit at global_steps;
    the trainer's tensors stay where they were (a flat copy is shared, not their storage)."""
    server, loop = server
    engine = server.engine.engine
    rollout = plugin.FP8EngineRollout.__new__(plugin.FP8EngineRollout)
    rollout.config, rollout.bucket_bytes, rollout.server, rollout.last_update = rollout_config(), 1 << 20, \
        _Handle(server), {}
    rollout.sync_dtype = engine.runner.dtype
    names = loop.run_until_complete(server.expected_weight_names())
    weights = [(n, engine.get_weights_by_name(n).float() * 0.99) for n in names]
    report = loop.run_until_complete(rollout.update_weights(iter(weights), global_steps=11))
    assert report["weight_version"] == 11 == engine.weight_version and report["num_tensors"] == len(names)
    itemsize = engine.runner.dtype.itemsize  # handed over in the model dtype
    assert report["num_buckets"] > 10 and report["num_bytes"] >= sum(t.numel() * itemsize for _, t in weights)
    assert not any(t.is_shared() for _, t in weights)
    for name, tensor in weights[:: max(1, len(weights) // 20)]:
        assert torch.equal(engine.get_weights_by_name(name), tensor.to(engine.runner.dtype)), name
    bad = [(names[0], weights[0][1]), ("model.layers.0.no_such.weight", weights[0][1])]
    with pytest.raises(ValueError, match="no_such"):
        loop.run_until_complete(rollout.update_weights(iter(bad), global_steps=12))
    assert engine.weight_version == 11 and server._staged == []  # nothing committed, nothing left staged


def standalone_sync(loop, rollout, path, steps: int) -> tuple[dict, dict]:
    """One sync through FP8EngineCheckpointEngine as veRL's CheckpointEngineManager drives it (prepare,
    build_topology, init_process_group on every worker, then the trainer's send_weights beside the rollout worker's
    update_weights, finalize): a trainer of two ranks in a process of its own (verl_ce_trainer.py, sending `path`'s
    tensors) and one rollout worker here. Returns what the trainer reported and what the engine reported."""
    engine_cls = CheckpointEngineRegistry.get("fp8engine")
    trainer = subprocess.Popen([sys.executable, str(HERE / "verl_ce_trainer.py"), str(path), str(steps)],
                               stdout=subprocess.PIPE, text=True)
    try:
        master = json.loads(trainer.stdout.readline())
        _, rollout_kwargs = engine_cls.build_topology(2, 1, [master, {}, {}])
        worker = engine_cls(bucket_size=1 << 20)
        worker.init_process_group(**{key: values[0] for key, values in rollout_kwargs.items()})
        received = loop.run_until_complete(rollout.update_weights(
            worker.receive_weights(global_steps=steps), wire_format=worker.wire_format, global_steps=steps))
        worker.finalize()
        sent = json.loads(trainer.stdout.readline())
    finally:
        assert trainer.wait(timeout=120) == 0
    return sent, received


def test_checkpoint_engine_broadcasts_into_the_engine(server, tmp_path):
    """Standalone mode (rollout.checkpoint_engine.backend=fp8engine): float32 weights, cast to bfloat16 on the
    trainer's side, broadcast in buckets of 1 MiB over a gloo group the engine joins itself, committed once at
    global_steps; a NaN fails the commit with the tensor named, the engine keeping its weights and version."""
    server, loop = server
    engine = server.engine.engine
    rollout = plugin.FP8EngineRollout.__new__(plugin.FP8EngineRollout)
    rollout.config, rollout.server, rollout.last_update = rollout_config(), _Handle(server), {}
    names = loop.run_until_complete(server.expected_weight_names())
    weights = {n: engine.get_weights_by_name(n).float() * 1.01 for n in names}
    save_file(weights, tmp_path / "good.safetensors")
    sent, received = standalone_sync(loop, rollout, tmp_path / "good.safetensors", steps=21)
    assert received["weight_version"] == 21 == engine.weight_version and received["num_tensors"] == len(names)
    assert sent["fp8engine/sync_buckets"] == received["num_buckets"] > 10 and sent["walked"] == len(names)
    assert sent["fp8engine/sync_bytes"] == sum(t.numel() * 2 for t in weights.values())  # bfloat16 on the wire
    for name in names[:: max(1, len(names) // 20)]:
        assert torch.equal(engine.get_weights_by_name(name), weights[name].bfloat16()), name
    bad_name = names[3]
    weights[bad_name].view(-1)[7] = float("nan")
    save_file(weights, tmp_path / "bad.safetensors")
    before = engine.get_weights_by_name(bad_name).clone()
    with pytest.raises(ValueError, match=bad_name.replace(".", r"\.")):
        standalone_sync(loop, rollout, tmp_path / "bad.safetensors", steps=22)
    assert engine.weight_version == 21 and torch.equal(engine.get_weights_by_name(bad_name), before)
    assert engine.weights_update_group is None  # left after each sync
