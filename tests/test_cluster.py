"""Scale-out: RolloutCluster on a local Ray (2 replicas of 1 thread) equals one engine, syncs all replicas or
none, survives a replica killed mid-rollout; the weight-update group (gloo) in-process and over HTTP equals
update_weights. Every engine here is batch invariant, so "equal" means bit for bit, logprobs included."""

import hashlib
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import save_file

from fp8engine import EngineConfig, SamplingParams
from fp8engine.bench.serve_load import free_port, serving
from fp8engine.rl import RolloutClient, RolloutCluster, RolloutEngine
from fp8engine.rl.cluster import assign
from fp8engine.rl.episodes import rollout_episodes
from fp8engine.weights.dist_update import tensor_specs
from fp8engine.weights.loader import iter_safetensors
from tests.checkpoints import perturbed_state
from tests.prompts import CHATS, RAW

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(dtype="bfloat16", batch_invariant=True, kv_cache_memory_bytes=64 << 20)
PROMPTS = [RAW[0], CHATS[0], [1, 504, 3458, 282, 6687, 314], RAW[1]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs_mode="raw")
SEEDED = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3)
UPDATED = ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight",
           "model.layers.0.post_attention_layernorm.weight")
# The fault test kills a replica KILL_AFTER_S after the prompts were dispatched: its share (4 prompts x n=2 x 64
# tokens, 64 decode steps) takes longer than that on any CPU (2.5-5 s here, on 2 shared cores).
FAULT_TOKENS, KILL_AFTER_S = 64, 0.2

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas run this module's functions


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The replicas run 1 thread each; batch-invariant results are bitwise only for a fixed thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cluster = RolloutCluster(EngineConfig(**CONFIG), num_replicas=2, num_cpus_per_replica=1, bucket_bytes=32 << 20)
    yield cluster
    cluster.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference() -> RolloutEngine:
    """An in-process engine with the replicas' config; every test leaves it on the cluster's weights."""
    return RolloutEngine(EngineConfig(**CONFIG))


def digest(engine) -> str:
    """sha256 of every parameter's bytes, as the engine stores them."""
    h = hashlib.sha256()
    for name, param in engine.named_parameters():
        h.update(name.encode())
        h.update(param.detach().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def replica_digests(cluster) -> list[str]:
    return ray.get([r.call.remote(digest) for r in cluster.replicas])


def assert_same(batch, expected) -> None:
    for name in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "rollout_logprobs",
                 "num_preemptions"):
        assert torch.equal(getattr(batch, name), getattr(expected, name)), name
    assert (batch.log_kept_mass is None) == (expected.log_kept_mass is None)
    assert batch.log_kept_mass is None or torch.equal(batch.log_kept_mass, expected.log_kept_mass)
    assert (batch.finish_reasons, batch.response_texts, batch.weight_version) == (
        expected.finish_reasons, expected.response_texts, expected.weight_version)


def test_importing_the_adapter_does_not_import_ray():
    code = "import sys, fp8engine.rl; assert fp8engine.rl.RolloutCluster and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_groups_go_to_the_replica_with_the_fewest_outstanding_tokens():
    assert assign([100, 10, 10, 10, 100, 5], 2) == [0, 1, 1, 1, 1, 0]  # round-robin: [0, 1, 0, 1, 0, 1]
    assert assign([5, 5, 5, 5], 3) == [0, 1, 2, 0]
    assert assign([5, 5, 5, 5], 2, [1, None, 1, None]) == [1, 0, 1, 0]  # pinned sessions count in the load


def test_rollouts_equal_one_engine_in_prompt_order_with_each_prompts_samples_on_one_replica(cluster, reference):
    prompts = [" ".join(RAW * 2), *PROMPTS]  # the long one outweighs the others together
    for params, n in ((GREEDY, 2), (SEEDED, 3)):
        before = cluster.get_stats()
        batch = cluster.rollout(prompts, n=n, sampling_params=params)
        expected = reference.rollout(prompts, n=n, sampling_params=params)
        assert_same(batch, expected)

        prompt_ids = expected.prompts_and_responses()[0][::n]
        plan = assign([len(ids) + n * params.max_tokens for ids in prompt_ids], 2)
        assert plan == [0, 1, 1, 1, 1]
        assert batch.stats["replica_of_prompt"] == [before.replica_ids[r] for r in plan]
        after = cluster.get_stats()
        for i, (old, new) in enumerate(zip(before.replicas, after.replicas)):
            mine = plan.count(i)  # one request per prompt, its n samples all generated on this replica
            assert new.num_requests_finished - old.num_requests_finished == mine
            assert new.num_generation_tokens_total - old.num_generation_tokens_total == mine * n * params.max_tokens
        assert after.num_requests_finished - before.num_requests_finished == len(prompts)


def test_pause_blocks_rollouts_until_resume(cluster):
    cluster.pause("abort")
    with pytest.raises(RuntimeError, match="paused"):
        cluster.rollout(PROMPTS[:1])
    cluster.resume()
    assert cluster.rollout(PROMPTS[:2], sampling_params=GREEDY).batch_size == 2


def test_sleep_and_wake_reach_every_replica(cluster, reference, default_dir):
    # weights the object store keeps, whatever the tests before left (a distributed sync keeps none), for the
    # replica added below to take
    state = perturbed_state(default_dir, seed=15)
    version = cluster.weight_version + 1
    cluster.sync_weights(state, weight_version=version)
    reference.sync_weights(state, weight_version=version)
    before = cluster.rollout(PROMPTS[:2], sampling_params=GREEDY).response_ids
    reports = cluster.sleep(1, ["kv_cache"])
    assert [r.tags for r in reports] == [["kv_cache"]] * 2
    with pytest.raises(RuntimeError, match="asleep"):
        cluster.rollout(PROMPTS[:1], sampling_params=GREEDY)
    assert [r.tags for r in cluster.wake_up()] == [["kv_cache"]] * 2
    assert torch.equal(cluster.rollout(PROMPTS[:2], sampling_params=GREEDY).response_ids, before)
    # a replica added while the cluster sleeps sleeps too, and wakes with the others
    cluster.sleep(1, ["kv_cache"])
    try:
        cluster.remove_replica(1)  # room for one more on this 2-CPU Ray
        added = cluster.add_replica()
        assert ray.get(added.get_stats.remote()).sleeping == {"kv_cache": 1}
    finally:  # the next tests take a cluster that is awake
        woken = cluster.wake_up()
    assert [r.tags for r in woken] == [["kv_cache"]] * 2
    assert torch.equal(cluster.rollout(PROMPTS[:2], sampling_params=GREEDY).response_ids, before)


def test_partial_rollouts_stop_every_replica_and_resume_as_one_engine_would(cluster, reference):
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    prompts = [RAW[0], RAW[1] * 3, RAW[2], RAW[3] * 3, RAW[4], RAW[5]]
    first = cluster.rollout(prompts, n=2, sampling_params=params, min_groups=2)
    done = len(first.group_prompts)
    assert done >= 2 and len(first.partial) == 6 - done and first.response_lengths.eq(24).all()
    assert sorted(first.group_prompts + [g.prompt for g in first.partial]) == sorted(prompts)
    heads = [s for g in first.partial for s in g.samples]
    assert all(len(s.token_ids) == len(s.logprobs) == len(s.token_weight_versions) < 24 for s in heads)
    stats = cluster.get_stats()
    assert stats.num_running == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks_total

    second = cluster.rollout([RAW[6]], n=2, sampling_params=params, resume=first.partial)
    assert second.group_prompts == [g.prompt for g in first.partial] + [RAW[6]] and not second.partial
    for row, head in enumerate(heads):
        k = len(head.token_ids)
        assert second.response_ids[row, :k].tolist() == head.token_ids
        assert second.rollout_logprobs[row, :k].tolist() == head.logprobs
    # batch invariant, same seeds: one engine continues the same partial groups bit for bit alike
    assert_same(second, reference.rollout([RAW[6]], n=2, sampling_params=params, resume=first.partial))


def test_sync_of_a_perturbed_policy_equals_an_engine_with_those_weights(cluster, reference, default_dir):
    state = perturbed_state(default_dir, seed=11)
    old = cluster.rollout(PROMPTS, sampling_params=GREEDY)
    version = cluster.weight_version + 1
    report = cluster.sync_weights(state, weight_version=version)
    reference.sync_weights(state, weight_version=version)

    assert (report.num_tensors, report.weight_version) == (len(state), version)
    assert report.num_bytes == sum(t.numel() * t.element_size() for t in state.values()) and report.num_buckets > 1
    assert replica_digests(cluster) == [digest(reference.engine)] * 2
    batch = cluster.rollout(PROMPTS, n=2, sampling_params=GREEDY)
    assert_same(batch, reference.rollout(PROMPTS, n=2, sampling_params=GREEDY))
    assert batch.weight_version == version
    assert [s.weight_version for s in cluster.get_stats().replicas] == [version, version]
    assert not torch.equal(batch.rollout_logprobs[::2], old.rollout_logprobs)


@pytest.mark.parametrize("fault", ["wrong_shape", "nan"])
def test_a_bad_tensor_in_a_sync_changes_no_replica(cluster, default_dir, fault):
    state = perturbed_state(default_dir, seed=12)  # every tensor differs from what the replicas hold
    if fault == "wrong_shape":
        name = "model.norm.weight"
        state.pop(name)
        state[name] = torch.ones(7, dtype=torch.bfloat16)  # last, after every other bucket was staged
    else:
        name = "model.layers.10.mlp.down_proj.weight"
        state[name][3, 5] = float("nan")
    before, version = replica_digests(cluster), cluster.weight_version

    with pytest.raises(ValueError, match=rf"replica \d+ refused .*{re.escape(name)}.*no replica changed"):
        cluster.sync_weights(state, weight_version=version + 1)
    assert replica_digests(cluster) == before
    assert cluster.weight_version == version
    assert [s.weight_version for s in cluster.get_stats().replicas] == [version] * len(before)


def test_distributed_sync_equals_the_object_store_sync(cluster, reference, default_dir):
    state = perturbed_state(default_dir, seed=14)
    version = cluster.weight_version + 1
    cluster.sync_method = "distributed"
    try:
        report = cluster.sync_weights(state, weight_version=version)
    finally:
        cluster.sync_method = "object_store"
    reference.sync_weights(state, weight_version=version)
    assert (report.num_tensors, report.weight_version) == (len(state), version)
    assert replica_digests(cluster) == [digest(reference.engine)] * len(cluster.replicas)
    assert [s.weight_version for s in cluster.get_stats().replicas] == [version] * len(cluster.replicas)
    with pytest.raises(ValueError, match="distributed"):  # nothing kept to bring a new replica up with
        cluster.add_replica()


def test_a_replica_killed_mid_rollout(cluster, reference, default_dir, monkeypatch):
    params = SamplingParams(temperature=1.0, max_tokens=FAULT_TOKENS, ignore_eos=True, seed=5)
    [survivor, victim] = cluster.get_stats().replica_ids
    killed_at = []

    def kill():
        killed_at.append(time.perf_counter())
        ray.kill(cluster.replicas[1])

    killer, dispatch = threading.Timer(KILL_AFTER_S, kill), cluster._dispatch

    def dispatch_then_kill(groups):
        streams = dispatch(groups)
        if killer.ident is None:  # the first dispatch, not the rerun
            killer.start()
        return streams

    monkeypatch.setattr(cluster, "_dispatch", dispatch_then_kill)
    start = time.perf_counter()
    batch = cluster.rollout(RAW[:8], n=2, sampling_params=params)
    end = time.perf_counter()
    killer.join()
    monkeypatch.undo()
    expected = reference.rollout(RAW[:8], n=2, sampling_params=params)
    print(f"rollout {end - start:.1f} s with the kill at {killed_at[0] - start:.1f} s; "
          f"{batch.stats['num_prompt_groups_rerun']} prompt groups rerun; one engine alone {expected.stats['seconds']:.1f} s")

    assert start < killed_at[0] < end
    assert_same(batch, expected)
    stats = cluster.get_stats()
    assert stats.replica_ids == [survivor] and stats.replicas_lost[-1].startswith(f"replica {victim} (")
    rerun = batch.stats["num_prompt_groups_rerun"]
    victims_share = assign([len(ids) + 2 * FAULT_TOKENS for ids in expected.prompts_and_responses()[0][::2]], 2)
    assert rerun >= 1 and set(batch.stats["replica_of_prompt"]) <= {survivor, victim}
    assert batch.stats["replica_of_prompt"].count(victim) == victims_share.count(1) - rerun

    state = perturbed_state(default_dir, seed=13)
    version = cluster.weight_version + 1
    cluster.sync_weights(state, weight_version=version)  # reaches the survivor
    reference.sync_weights(state, weight_version=version)
    assert [s.weight_version for s in cluster.get_stats().replicas] == [version]

    start = time.perf_counter()
    new = cluster.add_replica()
    print(f"add_replica: {time.perf_counter() - start:.1f} s")
    assert len(cluster.replicas) == 2 and ray.get(new.weight_version.remote()) == version
    assert replica_digests(cluster) == [digest(reference.engine)] * 2
    batch = cluster.rollout(PROMPTS, n=2, sampling_params=SEEDED)
    assert_same(batch, reference.rollout(PROMPTS, n=2, sampling_params=SEEDED))
    assert len(set(batch.stats["replica_of_prompt"])) == 2


class Chat:
    """An episode of user turns ("Say more."); `on_step` runs after each model turn (a kill, below)."""

    def __init__(self, on_step=lambda turn: None):
        self.on_step = on_step

    def reset(self, prompt):
        return [{"role": "user", "content": prompt}]

    def step(self, turn):
        self.on_step(turn)
        return [{"role": "user", "content": "Say more."}], float(len(turn.token_ids)), False


def test_episodes_stay_on_one_replica_and_move_with_their_history_when_it_dies(cluster, reference, default_dir):
    state = perturbed_state(default_dir, seed=31)  # an object-store sync: add_replica() below starts from it
    version = cluster.weight_version + 1
    cluster.sync_weights(state, weight_version=version)
    reference.sync_weights(state, weight_version=version)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=6)
    prompts = RAW[:4]
    expected = rollout_episodes(reference, Chat, prompts, n=2, sampling_params=params, max_turns=3)
    fields = ("prompt_ids", "response_ids", "response_mask", "rollout_logprobs", "token_weight_versions", "rewards")

    batch = rollout_episodes(cluster, Chat, prompts, n=2, sampling_params=params, max_turns=3)
    for name in fields:
        assert torch.equal(getattr(batch, name), getattr(expected, name)), name
    placement = batch.stats["replicas_of_episode"]
    assert all(len(set(turns)) == 1 for turns in placement) and len({turns[0] for turns in placement}) == 2
    sent, computed = batch.stats["prompt_tokens_by_turn"], batch.stats["prefill_tokens_by_turn"]
    assert all(c < s for c, s in zip(computed[1:], sent[1:]))  # each history was in its replica's prefix cache

    [survivor, victim] = cluster.get_stats().replica_ids
    killed = []

    def kill(turn):
        if not killed:
            killed.append(turn.turn)
            ray.kill(cluster.replicas[1])
    batch = rollout_episodes(cluster, lambda: Chat(kill), prompts, n=2, sampling_params=params, max_turns=3)
    for name in fields:
        assert torch.equal(getattr(batch, name), getattr(expected, name)), name
    placement = batch.stats["replicas_of_episode"]
    assert killed == [0] and {turns[0] for turns in placement} == {survivor, victim}
    assert all(set(turns[1:]) == {survivor} for turns in placement)
    cluster.add_replica()
    assert len(cluster.replicas) == 2


# ---------------------------------------------------------------------- the weight-update group
@pytest.fixture(scope="module")
def broadcast(default_dir, tmp_path_factory) -> tuple[str, str, dict[str, torch.Tensor]]:
    """Files for a trainer to broadcast: layer 0's o_proj and norms with seeded noise, and as they are in
    the checkpoint; and the noisy tensors."""
    out = tmp_path_factory.mktemp("broadcast")
    original = out / "model.safetensors"
    save_file(dict(iter_safetensors(default_dir, lambda name: name in UPDATED)), str(original))
    tensors = dict(sorted(perturbed_state(str(out), seed=21).items()))
    save_file(tensors, str(out / "perturbed.safetensors"))
    return str(out / "perturbed.safetensors"), str(original), tensors


@pytest.fixture(scope="module")
def checkpoint_rollouts() -> RolloutEngine:
    """An in-process engine with the replicas' config and the checkpoint's weights (as the server starts)."""
    return RolloutEngine(EngineConfig(**CONFIG))


def trainer(port: int, path: str, *flags: str) -> subprocess.Popen:
    """tests/broadcast_trainer.py as rank 0 of a group of 2; it exits once its stdin closes."""
    return subprocess.Popen([sys.executable, "-m", "tests.broadcast_trainer", str(port), "2", path, *flags],
                            cwd=ROOT, stdin=subprocess.PIPE)


def finish(process: subprocess.Popen) -> int:
    process.stdin.close()
    return process.wait(timeout=120)


def test_weight_update_group_in_process_equals_update_weights(checkpoint_rollouts, broadcast):
    path, _, tensors = broadcast
    engine, version = checkpoint_rollouts.engine, checkpoint_rollouts.engine.weight_version
    originals = {name: engine.get_weights_by_name(name).clone() for name in tensors}
    port = free_port()
    rank0 = trainer(port, path)
    try:
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, timeout_s=120)
        report = engine.update_weights_from_distributed(*tensor_specs(tensors.items()), weight_version=version + 100)
    finally:
        engine.destroy_weights_update_group()
        assert finish(rank0) == 0
    assert (report.num_tensors, report.weight_version) == (len(tensors), version + 100)
    received = {name: engine.get_weights_by_name(name) for name in tensors}
    via_group = checkpoint_rollouts.rollout(PROMPTS, n=2, sampling_params=SEEDED)

    engine.update_weights(originals, weight_version=version)
    engine.update_weights(tensors, weight_version=version + 100)
    via_update = checkpoint_rollouts.rollout(PROMPTS, n=2, sampling_params=SEEDED)
    engine.update_weights(originals, weight_version=version)
    for name, tensor in tensors.items():
        assert torch.equal(received[name], tensor) and not torch.equal(tensor, originals[name]), name
    assert_same(via_group, via_update)
    assert via_group.weight_version == version + 100


@pytest.fixture(scope="module")
def server_url():
    flags = ["--dtype", CONFIG["dtype"], "--batch-invariant", "--kv-cache-memory-bytes", str(CONFIG["kv_cache_memory_bytes"])]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # as the reference runs
        with serving(flags, startup_timeout=600) as url:
            yield url


def test_weight_update_group_over_http_and_a_trainer_that_dies(server_url, checkpoint_rollouts, broadcast):
    path, original_path, tensors = broadcast
    client = RolloutClient(server_url)
    port = free_port()
    rank0 = trainer(port, path, "--group-name", "http")
    try:
        client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="http", timeout_s=120)
        report = client.update_weights_from_distributed(*tensor_specs(tensors.items()), weight_version=7)
    finally:
        client.destroy_weights_update_group()
        assert finish(rank0) == 0
    assert (report["num_tensors"], report["weight_version"]) == (len(tensors), 7)
    remote = client.rollout(PROMPTS, n=2, sampling_params=SEEDED)

    engine, version = checkpoint_rollouts.engine, checkpoint_rollouts.engine.weight_version
    originals = {name: engine.get_weights_by_name(name).clone() for name in tensors}
    engine.update_weights(tensors, weight_version=7)
    local = checkpoint_rollouts.rollout(PROMPTS, n=2, sampling_params=SEEDED)
    engine.update_weights(originals, weight_version=version)
    assert_same(remote, local)

    # The checkpoint's tensors, had they landed, would change the weights back: the trainer dies after one.
    port = free_port()
    rank0 = trainer(port, original_path, "--group-name", "dies", "--die-after", "1")
    client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="dies", timeout_s=120)
    with pytest.raises(RuntimeError, match="500.*broadcast failed"):
        client.update_weights_from_distributed(*tensor_specs(tensors.items()), weight_version=8)
    assert rank0.wait(timeout=120) == 3
    assert client.get_stats().weight_version == 7
    assert_same(client.rollout(PROMPTS, n=2, sampling_params=SEEDED), local)
    client.destroy_weights_update_group()  # already closed by the failure: a no-op
    client.close()


def test_a_client_on_a_weight_update_group_syncs_by_broadcast(server_url, checkpoint_rollouts, broadcast):
    """RolloutClient.use_weights_update_group: sync_weights broadcasts the tensors instead of POSTing them, with
    the update options of the HTTP path, and the server ends where an in-process update of the same tensors
    does; close() leaves the group."""
    _, _, tensors = broadcast
    client = RolloutClient(server_url, sync_dtype=None)
    version = client.weight_version() + 1
    client.use_weights_update_group()
    try:
        with pytest.raises(ValueError, match="in_flight"):
            client.sync_weights(tensors, weight_version=version, in_flight="later")
        report = client.sync_weights(tensors, weight_version=version, in_flight="keep", kv_on_update="recompute")
        remote = client.rollout(PROMPTS, n=2, sampling_params=SEEDED)
    finally:
        client.close()
    assert client.group is None
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert (report.num_tensors, report.num_bytes, report.weight_version) == (len(tensors), num_bytes, version)
    assert remote.weight_version == version

    engine, before = checkpoint_rollouts.engine, checkpoint_rollouts.engine.weight_version
    originals = {name: engine.get_weights_by_name(name).clone() for name in tensors}
    engine.update_weights(tensors, weight_version=version)
    local = checkpoint_rollouts.rollout(PROMPTS, n=2, sampling_params=SEEDED)
    engine.update_weights(originals, weight_version=before)
    assert_same(remote, local)
