"""LoRA on a RolloutCluster (local Ray, 2 replicas of 1 thread, batch invariant): a PEFT policy's adapter goes to
every replica or none, a replica added later loads it, and the rollouts equal one engine's given that adapter.
A module of its own: its replicas need the Ray CPUs that test_cluster's cluster holds."""

import hashlib
import sys

import pytest
import ray
import torch

from fp8engine import EngineConfig
from fp8engine.rl import RolloutCluster, RolloutEngine
from tests.test_cluster import CONFIG, PROMPTS, SEEDED, assert_same, one_thread  # noqa: F401 (a fixture)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas run lora_digest


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def lora_digest(engine) -> str:
    """sha256 of every LoRA buffer's bytes and its ranks."""
    h = hashlib.sha256()
    for path, lora in engine.runner.lora_layers.items():
        h.update(f"{path}{lora.ranks}".encode())
        for t in (lora.lora_a, lora.lora_b):
            h.update(t.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def test_a_peft_policy_syncs_its_adapter_to_every_replica_or_none(local_ray, default_dir):
    """Replicas with LoRA buffers take a PEFT model's adapter alone, all or none, and a replica added later
    loads it too (without a sync of whole weights before); the rollouts equal one engine's given the adapter."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    config = EngineConfig(**CONFIG, max_lora_rank=8)
    loras = RolloutCluster(config, num_replicas=2, num_cpus_per_replica=1)
    try:
        torch.manual_seed(0)
        policy = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32)
        policy = peft.get_peft_model(policy, peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                             target_modules=["q_proj", "v_proj", "down_proj"]))
        one = RolloutEngine(config)
        one.sync_weights(policy, weight_version=1)
        report = loras.sync_weights(policy, weight_version=1)
        adapter_bytes = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
        assert (report.num_bytes, report.num_tensors, report.weight_version) == (adapter_bytes, 180, 1)
        assert ray.get([r.call.remote(lora_digest) for r in loras.replicas]) == [lora_digest(one.engine)] * 2
        assert_same(loras.rollout(PROMPTS, n=2, sampling_params=SEEDED),
                    one.rollout(PROMPTS, n=2, sampling_params=SEEDED))
        weight = policy.base_model.model.model.layers[3].self_attn.v_proj.lora_B["default"].weight
        kept = float(weight[2, 1])
        with torch.no_grad():
            weight[2, 1] = float("nan")
        with pytest.raises(ValueError, match=r"replica \d+ refused .*layers\.3\.self_attn\.v_proj\.lora_B.*NaN"):
            loras.sync_weights(policy, weight_version=2)
        with torch.no_grad():
            weight[2, 1] = kept
        assert ray.get([r.call.remote(lora_digest) for r in loras.replicas]) == [lora_digest(one.engine)] * 2
        assert [s.weight_version for s in loras.get_stats().replicas] == [1, 1]
        loras.remove_replica(1)  # its CPU for the new one
        loras.add_replica()
        assert ray.get([r.call.remote(lora_digest) for r in loras.replicas]) == [lora_digest(one.engine)] * 2
        assert [s.weight_version for s in loras.get_stats().replicas] == [1, 1]
        loras.remove_replica(1)
        loras.add_replica(policy)  # the PEFT model itself: its adapter, the base as the others hold it
        assert ray.get([r.call.remote(lora_digest) for r in loras.replicas]) == [lora_digest(one.engine)] * 2
    finally:
        loras.shutdown()
