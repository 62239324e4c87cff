"""Trainer adapter: weight sync and rollouts with one interface, in-process or over HTTP.

    from fp8engine.rl import RolloutEngine, correction
    from fp8engine.rl.trainer import response_logprobs
    rollouts = RolloutEngine(EngineConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3"))
    # rollouts = RolloutClient("http://127.0.0.1:8000")      # the same methods, over HTTP
    # rollouts = RolloutCluster(config, num_replicas=4)      # the same methods, Ray replicas
    rollouts.sync_weights(policy, weight_version=step)
    batch = rollouts.rollout(prompts, n=8, sampling_params=params)
    train_lp = response_logprobs(policy, batch, params)
    w = correction.token_tis_weights(train_lp, batch.rollout_logprobs, batch.response_mask)
    episodes = rollout_episodes(rollouts, make_env, prompts, n=8, sampling_params=params, max_turns=4)
"""

from fp8engine.rl import correction
from fp8engine.rl.batch import RolloutBatch
from fp8engine.rl.client import RolloutClient
from fp8engine.rl.cluster import RolloutCluster
from fp8engine.rl.episodes import rollout_episodes
from fp8engine.rl.rollout import RolloutEngine
from fp8engine.rl.sync import SyncReport
from fp8engine.rl.trainer import response_logprobs

__all__ = ["RolloutEngine", "RolloutClient", "RolloutCluster", "RolloutBatch", "SyncReport", "correction",
           "response_logprobs", "rollout_episodes"]
