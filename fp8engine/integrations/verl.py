"""veRL rollout backend: `actor_rollout_ref.rollout.name=fp8engine` runs veRL's rollouts on fp8engine.

Written against veRL 0.9.1 (verl/workers/rollout/replica.py, base.py, llm_server.py and the vLLM backend as
the model of what veRL calls). veRL loads this module through the `verl.plugins` entry point (pyproject.toml;
`VERL_USE_EXTERNAL_PLUGINS=none` turns discovery off, `VERL_USE_EXTERNAL_MODULES=fp8engine.integrations.verl`
loads it explicitly), which registers three pieces:

- `FP8EngineReplica` (`RolloutReplicaRegistry`, name "fp8engine"): launches one `FP8EngineServer` actor per
  replica, on the node of the replica's worker; veRL's inherited replica methods call the actor's methods by name.
- `FP8EngineServer`: a Ray actor that owns an `LLMEngine` driven by an `AsyncEngine` (an engine thread, so
  veRL's concurrent `generate` calls batch continuously). Token in, `TokenOutput` out.
- `FP8EngineRollout` (`_ROLLOUT_REGISTRY[("fp8engine", "async")]`): lives in veRL's FSDP worker process (hybrid
  mode). `update_weights` hands the generator's tensors to the actor as shared-memory handles
  (`weights/tensor_handles.py`, never the Ray object store) in buckets of
  `rollout.checkpoint_engine.update_weights_bucket_megabytes` (each bucket copied into one flat tensor: SGLang's
  flattened bucket); the actor stages them and commits once, at the end, with `weight_version=global_steps` (all
  or nothing). `release()` / `resume(tags)` are sleep / wake.
- `FP8EngineCheckpointEngine` (`CheckpointEngineRegistry`, backend "fp8engine"): standalone mode's weight sync
  (`rollout.checkpoint_engine.backend=fp8engine`, the rollout on its own workers). The trainer's rank 0 broadcasts
  the weights over a torch.distributed group of its own (gloo on CPU, NCCL on GPUs) straight into each replica's
  engine, which joins it as LLMEngine.init_weights_update_group does (fp8engine's weight-update group): bucket by
  bucket, a JSON header naming the bucket's tensors, then the tensors; the engine stages them as they arrive and
  commits once at the end with `weight_version=global_steps` (all or nothing), then leaves the group. veRL's
  rollout-side worker only hands the engine its place in the group (FP8EngineRollout.update_weights).

Engine options: `actor_rollout_ref.rollout.engine_kwargs.fp8engine.<EngineConfig field>=value` (quantization,
kv_cache_dtype, batch_invariant, ...), over what the rollout config implies (model path, dtype, lengths, seed,
`rollout.quantization=fp8`, `load_format=dummy`). One engine per replica: tensor_model_parallel_size,
data_parallel_size and pipeline_model_parallel_size must be 1 (run more replicas for more workers). No HTTP
server: `server_address` is the actor's name, so agent loops that call an OpenAI endpoint are not covered.
"""

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import (
    RolloutMode,
    RolloutReplica,
    RolloutReplicaRegistry,
    TokenOutput,
)

from fp8engine.config import EngineConfig
from fp8engine.engine import LLMEngine
from fp8engine.entrypoints.async_engine import AsyncEngine, EnginePaused
from fp8engine.outputs import RequestOutput
from fp8engine.rl.sync import buckets, cast_for_sync
from fp8engine.sampling_params import SamplingParams
from fp8engine.weights import tensor_handles
from fp8engine.weights.dist_update import (
    DEFAULT_TIMEOUT_S,
    broadcast_header,
    broadcast_weights,
    dtype_name,
    free_port,
    init_process_group,
    parse_dtype,
)

logger = logging.getLogger(__name__)

NAME = "fp8engine"
BROADCAST = "fp8engine_broadcast"  # the wire format of FP8EngineCheckpointEngine: the engine receives itself
WIRE_FORMATS = ("named_tensors", "delta_flush", BROADCAST)
SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty", "ignore_eos", "seed", "stop", "stop_token_ids", "min_tokens",
                           "logprobs", "max_tokens", "max_new_tokens"})
"""The sampling_params keys `FP8EngineServer.generate` takes (veRL's agent loop sends temperature, top_p, top_k,
repetition_penalty and logprobs: a bool)."""


# ----------------------------------------------------------------------------- configuration
def engine_config(rollout, model_path: str, lora_rank: int = 0) -> EngineConfig:
    """The EngineConfig a veRL RolloutConfig asks for: its lengths, dtype, seed, prefix caching, quantization and
    load format, then `engine_kwargs.fp8engine` (EngineConfig field names) over them. ValueError names an
    unknown option or a parallel size other than 1."""
    for name in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        if getattr(rollout, name, 1) != 1:
            raise ValueError(f"rollout.{name}={getattr(rollout, name)!r}: the fp8engine backend runs one engine per "
                             f"replica; set it to 1 (veRL then starts one replica per worker)")
    if rollout.quantization not in (None, "fp8"):
        raise ValueError(f"rollout.quantization={rollout.quantization!r}: fp8engine takes none or 'fp8' (or "
                         f"engine_kwargs.fp8engine.quantization)")
    options = dict(model=model_path, dtype=rollout.dtype, seed=rollout.seed,
                   max_model_len=rollout.max_model_len or rollout.prompt_length + rollout.response_length,
                   max_num_batched_tokens=rollout.max_num_batched_tokens,
                   enable_prefix_caching=rollout.enable_prefix_caching, quantization=rollout.quantization,
                   load_format="dummy" if rollout.load_format == "dummy" else "auto", max_lora_rank=lora_rank)
    overrides = dict((rollout.engine_kwargs or {}).get(NAME) or {})
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"rollout.engine_kwargs.fp8engine: unknown option(s) {unknown}; EngineConfig takes "
                         f"{sorted(known)}")
    return EngineConfig(**(options | overrides))


def to_sampling_params(params: Mapping[str, Any], prompt_len: int, rollout, max_model_len: int,
                    return_routed_experts: bool = False) -> SamplingParams:
    """veRL's per-request sampling dict as SamplingParams. Without max_tokens (veRL sends none) a response may take
    `rollout.response_length` tokens, less what a multi-turn prompt already used of prompt_length +
    response_length; always at least 1 and within max_model_len. `logprobs` is veRL's bool: the sampled token's
    processed logprob (the distribution actually sampled from)."""
    unknown = sorted(set(params) - SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"sampling_params: unsupported key(s) {unknown}; fp8engine takes {sorted(SAMPLING_KEYS)}")
    values = dict(params)
    max_tokens = values.pop("max_tokens", values.pop("max_new_tokens", None))
    if max_tokens is None:
        max_tokens = min(rollout.response_length, rollout.prompt_length + rollout.response_length - prompt_len)
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room to generate within max_model_len "
                         f"{max_model_len}")
    values.setdefault("repetition_penalty", rollout.repetition_penalty)
    values.setdefault("ignore_eos", rollout.ignore_eos)
    if rollout.full_determinism:
        values.setdefault("seed", rollout.seed)
    logprobs = values.pop("logprobs", False)
    if not isinstance(logprobs, bool):
        raise TypeError(f"sampling_params['logprobs'] must be a bool (veRL's calculate_log_probs), got {logprobs!r}")
    return SamplingParams(max_tokens=max(1, min(int(max_tokens), room)), logprobs=0 if logprobs else None,
                          logprobs_mode="processed", return_routed_experts=return_routed_experts,
                          detokenize=False, **values)


def token_output(out: RequestOutput) -> TokenOutput:
    """A finished (or aborted) RequestOutput as veRL's TokenOutput: extra_fields global_steps (the weight version
    of the last token), min_global_steps / max_global_steps (over every token's version) and num_cached_tokens."""
    sample = out.outputs[0]
    versions = sample.token_weight_versions or [out.weight_version]
    routed = sample.routed_experts
    return TokenOutput(
        token_ids=list(sample.token_ids), log_probs=None if sample.logprobs is None else list(sample.logprobs),
        routed_experts=None if routed is None else routed.numpy(),
        stop_reason="aborted" if sample.finish_reason == "abort" else "completed",
        num_preempted=sample.num_preemptions,
        extra_fields={"global_steps": versions[-1], "min_global_steps": min(versions),
                      "max_global_steps": max(versions), "num_cached_tokens": out.num_cached_tokens})


def lora_rank_of(model_config) -> int:
    """The adapter rank veRL syncs as an adapter (LoRA not merged), 0 when it syncs whole weights."""
    lora = getattr(model_config, "lora", None) or {}
    rank = max(int(getattr(model_config, "lora_rank", 0) or 0), int(lora.get("rank", 0) or 0))
    return 0 if lora.get("merge", False) else rank


# ----------------------------------------------------------------------------- the server actor
class FP8EngineServer:
    """One replica's engine, as a Ray actor; veRL calls its methods by name."""

    def __init__(self, config, model_config, rollout_mode: RolloutMode, replica_rank: int,
                 visible_devices: tuple[str, str] | None = None):
        if visible_devices is not None:
            os.environ[visible_devices[0]] = visible_devices[1]
        self.config = config
        self.model_config = omega_conf_to_dataclass(model_config)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.lora_rank = lora_rank_of(self.model_config)
        self.engine: AsyncEngine | None = None
        self._staged: list[tuple[str, torch.Tensor]] = []
        self._gate = asyncio.Event()
        self._gate.set()
        self._rejecting = False

    async def launch_server(self) -> None:
        config = engine_config(self.config, self.model_config.local_path, self.lora_rank)
        self.engine = AsyncEngine(await asyncio.to_thread(LLMEngine, config))
        self.engine.start()
        logger.info("fp8engine replica %d: %s", self.replica_rank, config)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data=None, video_data=None, **kwargs) -> TokenOutput:
        """Token in, token out. Multimodal data and other keyword arguments are refused (ValueError naming them)."""
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise ValueError("fp8engine serves text models: image_data / video_data / audio_data must be None")
        extra = sorted(k for k, v in kwargs.items() if v is not None and k not in ("audio_data", "priority"))
        if extra:
            raise ValueError(f"generate: unsupported argument(s) {extra}")
        prompt_ids = [int(t) for t in prompt_ids]
        params = to_sampling_params(sampling_params, len(prompt_ids), self.config,
                                    self.engine.engine.max_model_len, self.config.enable_rollout_routing_replay)
        while True:
            if not self._gate.is_set():
                if self._rejecting:
                    return TokenOutput(token_ids=[], stop_reason="aborted",
                                       extra_fields={"global_steps": self.engine.engine.weight_version})
                await self._gate.wait()
                continue
            try:
                stream = await self.engine.add([prompt_ids], params, request_id)
                break
            except EnginePaused:  # abort_all_requests closed the gate while this one was on its way in
                continue
        final = None
        try:
            async for _, out in stream:
                final = out
        finally:
            stream.close()
        return token_output(final)

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """Abort every in-flight request (each returns its tokens so far, stop_reason "aborted") and hold new ones
        until resume_generation (reject_request=True: answer them "aborted" at once instead)."""
        self._gate.clear()
        self._rejecting = reject_request
        num_aborted = await self.engine.pause("abort")
        await self.engine.call(LLMEngine.flush_prefix_cache)
        return {"aborted_count": num_aborted, "request_ids": []}

    async def resume_generation(self) -> None:
        await self.engine.resume()
        self._rejecting = False
        self._gate.set()

    async def sleep(self) -> None:
        """veRL's sleep: nothing in standalone mode or without rollout.free_cache_engine; in hybrid mode level 2
        (veRL re-syncs every weight before the next rollout), level 1 where it syncs an adapter only (and in
        colocated mode, where nothing re-syncs)."""
        if not self.config.free_cache_engine or self.rollout_mode == RolloutMode.STANDALONE:
            return
        level = 2 if self.rollout_mode == RolloutMode.HYBRID and not self.lora_rank else 1
        report = await self.engine.sleep(level, None, "wait")
        logger.info("fp8engine replica %d: sleep level %d, %s released in %.3f s", self.replica_rank, level,
                    report.tags, report.seconds)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.rollout_mode == RolloutMode.STANDALONE:
            return
        await self.engine.call(lambda engine: engine.wake_up(tags))
        await self.engine.call(LLMEngine.flush_prefix_cache)

    async def clear_kv_cache(self) -> None:
        await self.engine.call(LLMEngine.flush_prefix_cache)

    async def release_kv_cache(self) -> None:
        if self.config.free_cache_engine and self.rollout_mode != RolloutMode.COLOCATED:
            await self.engine.sleep(1, ["kv_cache"], "wait")

    async def resume_kv_cache(self) -> None:
        if self.config.free_cache_engine and self.rollout_mode != RolloutMode.COLOCATED:
            await self.engine.call(lambda engine: engine.wake_up(["kv_cache"]))

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None = None,
                                         *, flush: bool = True, weight_version: int | None = None
                                         ) -> dict[str, Any] | None:
        """One bucket of SGLang's serialized_named_tensors (shared-memory handles). flush=False stages it; flush=True
        commits every staged bucket and this one as one update (validated first, all or nothing) at weight_version
        and returns the WeightUpdateReport as a dict. The sender keeps the tensors alive until the commit."""
        self._staged += tensor_handles.named_tensors(serialized_named_tensors, load_format)
        if not flush:
            return None
        staged, self._staged = self._staged, []
        report = await self.engine.update_weights(staged, weight_version=weight_version)
        return dataclasses.asdict(report)

    async def update_lora(self, serialized_named_tensors: list[str], scaling: float,
                          weight_version: int | None = None) -> dict[str, Any]:
        """A PEFT adapter (shared-memory handles, PEFT's names) into the engine's LoRA buffers."""
        adapter = tensor_handles.named_tensors(serialized_named_tensors)
        report = await self.engine.update_lora(adapter, scaling, weight_version=weight_version)
        return dataclasses.asdict(report)

    async def receive_broadcast(self, ticket: dict[str, Any], global_steps: int | None = None) -> dict[str, Any]:
        """Standalone mode's sync (FP8EngineCheckpointEngine): join the trainer's group at the ticket's rank, receive
        every bucket it broadcasts (its header, then its tensors; FP8-bound weights quantized as they arrive), commit
        them as one update at weight_version=global_steps and leave the group. A bad tensor fails the commit with a
        ValueError naming it and the engine keeps its weights; a broken transfer, a RuntimeError."""
        def receive(engine: LLMEngine) -> dict[str, Any]:
            engine.init_weights_update_group(ticket["address"], ticket["port"], ticket["rank"], ticket["world_size"],
                                             group_name=ticket["group_name"], backend=ticket["backend"],
                                             timeout_s=ticket["timeout_s"])
            try:
                group = engine.weights_update_group
                prequantizer, received, names, buckets_in = engine.prequantizer(), [], [], 0
                while True:
                    header = broadcast_header(group.group, None, group.device)
                    if header["names"]:
                        received += engine.receive_weights(header["names"], header["dtypes"], header["shapes"],
                                                           prequantizer)
                        names += header["names"]
                        buckets_in += 1
                    if header["last"]:
                        break
                report = engine.received_report(engine.update_weights(received, weight_version=global_steps),
                                                names, prequantizer)
                return dataclasses.asdict(report) | {"num_buckets": buckets_in}
            finally:
                engine.destroy_weights_update_group()
        return await self.engine.call(receive)

    async def drop_staged(self) -> None:
        """Forget buckets staged by an update that failed before its commit."""
        self._staged = []

    async def get_weights_by_name(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The engine's weights (dequantized to the model dtype, Hugging Face shapes), for a trainer that checks a
        sync (small models: they travel through Ray)."""
        return await self.engine.call(lambda engine: {n: engine.get_weights_by_name(n).cpu() for n in names})

    async def expected_weight_names(self) -> list[str]:
        """Every weight name an update must cover (a tied LM head is not among them: it is the embedding)."""
        return await self.engine.call(lambda engine: list(engine.runner.weight_names))

    async def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(await self.engine.stats())

    async def start_profile(self, **kwargs) -> None:
        logger.warning("fp8engine: rollout profiling is not supported; start_profile ignored")

    async def stop_profile(self) -> None:
        pass


# ----------------------------------------------------------------------------- the replica
def server_name(replica_rank: int, role: str = "", suffix: str = "") -> str:
    """The Ray name of a replica's server actor (role "reward_" / "teacher_" for those models' replicas)."""
    return f"{NAME}_server_{role}{replica_rank}_0{suffix}"


class FP8EngineReplica(RolloutReplica):
    """A veRL rollout replica served by one FP8EngineServer actor."""

    async def launch_servers(self) -> None:
        if self.world_size != 1:
            raise ValueError(f"the fp8engine backend runs one engine per replica (world size 1), got "
                             f"{self.world_size}: set rollout.tensor_model_parallel_size=1")
        from verl.plugin.platform import get_platform
        from verl.utils.device import get_resource_name, get_visible_devices_keyword

        options: dict[str, Any] = {"name": self._server_name(), "max_concurrency": self.max_concurrency}
        visible = None
        if self.workers:
            node_id, devices = await self.workers[0].__ray_call__.remote(_node_and_devices, get_resource_name())
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False)
            if devices:
                visible = (get_visible_devices_keyword(), ",".join(devices))
                options["runtime_env"] = {"env_vars": {var: "1" for var in get_platform().ray_noset_envvars()}}
        server = ray.remote(FP8EngineServer).options(**options).remote(
            self.config, self.model_config, self.rollout_mode, self.replica_rank, visible)
        await server.launch_server.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = self._server_name()

    def _server_name(self) -> str:
        role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        return server_name(self.replica_rank, role, self.name_suffix)


def _node_and_devices(worker, resource: str) -> tuple[str, list[str]]:
    context = ray.get_runtime_context()
    return context.get_node_id(), [str(d) for d in context.get_accelerator_ids().get(resource, [])]


# ----------------------------------------------------------------------------- the trainer side (hybrid)
class FP8EngineRollout(BaseRollout):
    """veRL's rollout handle in the FSDP worker (hybrid mode): weight syncs and sleep / wake of its replica's
    server. One replica per worker (tensor_model_parallel_size 1), so the worker's rank is its replica's rank."""

    def __init__(self, config, model_config, device_mesh, *args, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        self.replica_rank = int(os.environ.get("RANK", "0")) if replica_rank == -1 else replica_rank
        self.bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        self.sync_dtype = getattr(torch, self.config.dtype)  # what the synced floats are cast to (shared_bucket)
        self.server = None
        self.sleep_level = 2
        self.last_update: dict[str, Any] = {}

    def _server(self):
        if self.server is None:
            self.server = ray.get_actor(server_name(self.replica_rank))
        return self.server

    async def resume(self, tags: list[str]) -> None:
        if self.config.free_cache_engine:
            await self._server().wake_up.remote(tags=list(tags))

    async def release(self) -> None:
        if self.config.free_cache_engine:
            await self._server().sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], wire_format: str = "named_tensors",
                             global_steps: int | None = None, peft_config: dict | None = None,
                             base_sync_done: bool = True, **kwargs) -> dict[str, Any]:
        """Every (name, tensor) of `weights` into the engine, committed once with weight_version=global_steps (or an
        adapter, through update_lora, when peft_config is set and the base is synced). Returns what it did:
        tensors, bytes, buckets, seconds here and the engine's commit seconds."""
        if wire_format == "delta_flush":
            raise NotImplementedError("fp8engine: wire_format='delta_flush' (veRL's delta checkpoint engine) is not "
                                      "supported; use checkpoint_engine.backend=naive (full named tensors)")
        if wire_format not in WIRE_FORMATS:
            raise ValueError(f"wire_format must be one of {list(WIRE_FORMATS)}, got {wire_format!r}")
        if wire_format == BROADCAST:  # FP8EngineCheckpointEngine's: the engine joins the trainer's group itself
            start = time.perf_counter()
            report = await self._server().receive_broadcast.remote(weights, global_steps)
            report["sync_seconds"] = time.perf_counter() - start
            self.last_update = report
            return report
        if torch.multiprocessing.get_sharing_strategy() != "file_system":
            torch.multiprocessing.set_sharing_strategy("file_system")  # handles the engine's process can open
        start = time.perf_counter()
        if peft_config is not None and base_sync_done:
            report = await self._send_adapter(weights, peft_config, global_steps)
        else:
            report = await self._send_weights(weights, global_steps)
        report["sync_seconds"] = time.perf_counter() - start
        self.last_update = report
        logger.info("fp8engine: weights synced at version %s: %d tensors, %.1f MB in %d bucket(s), %.3f s "
                    "(engine commit %.3f s)", report["weight_version"], report["num_tensors"],
                    report["num_bytes"] / 1e6, report["num_buckets"], report["sync_seconds"], report["seconds"])
        return report

    async def _send_weights(self, weights, global_steps: int | None) -> dict[str, Any]:
        """Each bucket is copied once into a flat shared-memory tensor of its own (`shared_bucket`). The report splits
        the time: read_seconds reading veRL's generator (its gathers) and copying the buckets, handover_seconds in
        the actor's calls (handles, staging, the commit: the engine's own share is `seconds`)."""
        server, held, previous = self._server(), [], None
        read = handover = 0.0
        try:
            mark = time.perf_counter()
            for bucket in buckets(weights, self.bucket_bytes, None):
                if previous is not None:
                    read, mark = read + time.perf_counter() - mark, time.perf_counter()
                    await server.update_weights_from_tensor.remote([tensor_handles.dumps(previous)],
                                                                   "flattened_bucket", flush=False)
                    handover, mark = handover + time.perf_counter() - mark, time.perf_counter()
                previous = shared_bucket(bucket, self.sync_dtype)
                held.append(previous)
            if previous is None:
                raise ValueError("update_weights: the weights generator yielded no tensors")
            read, mark = read + time.perf_counter() - mark, time.perf_counter()
            report = await server.update_weights_from_tensor.remote([tensor_handles.dumps(previous)],
                                                                     "flattened_bucket", flush=True,
                                                                     weight_version=global_steps)
            handover += time.perf_counter() - mark
        except BaseException:
            await server.drop_staged.remote()
            raise
        report |= {"num_buckets": len(held), "num_bytes": sum(flat["flattened_tensor"].numel() for flat in held),
                   "read_seconds": read, "handover_seconds": handover}
        return report

    async def _send_adapter(self, weights, peft_config: dict, global_steps: int | None) -> dict[str, Any]:
        rank, alpha = peft_config.get("r"), peft_config.get("lora_alpha")
        if not rank or alpha is None:
            raise ValueError(f"peft_config must give r and lora_alpha, got r={rank!r}, lora_alpha={alpha!r}")
        adapter = [(name, t.detach().to("cpu").contiguous()) for name, t in weights]
        report = await self._server().update_lora.remote([tensor_handles.dumps(adapter)], alpha / rank,
                                                         weight_version=global_steps)
        report["num_buckets"] = 1
        return report


def shared_bucket(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> dict:
    """SGLang's flattened bucket (tensor_handles.flatten) with its flat tensor allocated in shared memory and the
    tensors copied in once: pickling it for the hand-over then copies nothing. (Pickling the yielded tensors
    themselves would move their storage into shared memory in place, with a copy: FSDP2 on one rank yields its own
    parameters, which would then live in /dev/shm.)

    dtype: floating-point tensors are cast to it on the way (the engine's model dtype), where rl.sync.cast_for_sync
    casts. veRL's FSDP2 yields its float32 master weights while its forward, and so the logprobs a rollout is
    compared with, computes with them cast to its param_dtype (bfloat16): an FP8 engine fed the float32 values
    quantized a policy the trainer never computes with, and veRL's rollout_probs_diff_mean grew with every step
    (0.026 / 0.050 / 0.077) where, fed the bfloat16 cast, it stays at the FP8 floor (docs/integrations.md). The cast
    also halves the bytes handed over."""
    cast = [(name, cast_for_sync(name, tensor, dtype)) for name, tensor in bucket]
    starts, at = [], 0
    for _, tensor in cast:
        at = -(-at // 16) * 16  # each tensor starts aligned, whatever the dtypes before it
        starts.append(at)
        at += tensor.numel() * tensor.element_size()
    flat = torch.empty(at, dtype=torch.uint8).share_memory_()
    metadata = []
    for (name, tensor), start in zip(cast, starts):
        end = start + tensor.numel() * tensor.element_size()
        flat[start:end].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        metadata.append(tensor_handles.FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, end,
                                                               tensor.numel()))
    return {"flattened_tensor": flat, "metadata": metadata}


# ----------------------------------------------------------------------------- standalone mode's weight sync
class FP8EngineCheckpointEngine(CheckpointEngine):
    """veRL's checkpoint engine for fp8engine rollouts on their own workers (standalone mode): the trainer's rank 0
    broadcasts into the engines over a group of their own. Options (`checkpoint_engine.engine_kwargs.fp8engine.*`):
    backend ("gloo" on CPU, "nccl" for CUDA tensors; default by whether the trainer has CUDA), dtype (floats are
    cast to it before they travel, the engine's model dtype: "bfloat16"; None keeps them), timeout_s.

    The group is joined when the weights move, not in init_process_group: veRL waits for every rank's
    init_process_group before it starts the transfer, and the engines join from inside it (FP8EngineServer.
    receive_broadcast). Trainer ranks but 0 walk the generator (producing each tensor is collective for FSDP)."""

    wire_format = BROADCAST

    def __init__(self, bucket_size: int, is_master: bool = False, backend: str | None = None,
                 dtype: str | None = "bfloat16", timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
        if kwargs:
            raise ValueError(f"checkpoint_engine.engine_kwargs.fp8engine: unknown option(s) {sorted(kwargs)}; "
                             f"known: backend, dtype, timeout_s")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"checkpoint_engine.engine_kwargs.fp8engine.backend must be gloo or nccl, got {backend!r}")
        self.bucket_size, self.is_master, self.timeout_s = int(bucket_size), is_master, float(timeout_s)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.dtype = None if dtype is None else parse_dtype(dtype)
        self.place: dict[str, Any] | None = None  # this worker's rank, the group's size and master

    def prepare(self) -> dict[str, Any]:
        """The master (trainer rank 0) names the group's rendezvous; the others report nothing."""
        if not self.is_master:
            return {}
        return {"address": ray.util.get_node_ip_address(), "port": free_port(), "backend": self.backend,
                "group_name": f"{NAME}-verl-{os.getpid()}-{time.monotonic_ns()}", "timeout_s": self.timeout_s}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """Trainer rank 0 is the group's rank 0, the other trainer ranks stay out (-1), rollout worker i (one per
        replica) is rank 1 + i."""
        master = metadata[0]
        if not master:
            raise ValueError("fp8engine checkpoint engine: trainer rank 0 must be the master")
        world_size = 1 + rollout_world_size
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world_size] * actor_wg_world_size,
                 "master_metadata": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world_size)), "world_size": [world_size] * rollout_world_size,
                   "master_metadata": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict[str, Any]):
        self.place = {"rank": rank, "world_size": world_size, **master_metadata}

    def finalize(self):
        self.place = None

    async def send_weights(self, weights, global_steps: int | None = None) -> dict[str, Any]:
        """Rank 0: join the group, then for each bucket of about bucket_size bytes its header and its tensors, and a
        last header; returns the bytes and seconds sent. Other trainer ranks walk the generator."""
        if self.place is None or self.place["rank"] != 0:
            for _ in weights:
                pass
            return {}
        place, start = self.place, time.perf_counter()
        group = init_process_group(place["address"], place["port"], 0, place["world_size"], place["group_name"],
                                   place["backend"], place["timeout_s"])
        device = "cuda" if place["backend"] == "nccl" else "cpu"
        num_bytes = num_buckets = 0
        try:
            for bucket in buckets(weights, self.bucket_size, self.dtype, device=None):  # on the trainer's device
                broadcast_header(group, {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype)
                                 for _, t in bucket], "shapes": [list(t.shape) for _, t in bucket], "last": False},
                                 device)
                num_bytes += broadcast_weights(group, bucket, device)
                num_buckets += 1
            broadcast_header(group, {"names": [], "dtypes": [], "shapes": [], "last": True}, device)
        finally:
            torch.distributed.destroy_process_group(group)
        return {"fp8engine/sync_bytes": num_bytes, "fp8engine/sync_buckets": num_buckets,
                "fp8engine/send_seconds": time.perf_counter() - start}

    def receive_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        """The rollout side's part: where its engine joins the group (FP8EngineRollout.update_weights hands it to
        the engine, which receives the weights itself)."""
        if self.place is None:
            raise RuntimeError("fp8engine checkpoint engine: receive_weights before init_process_group")
        return dict(self.place)


def _load_replica() -> type[RolloutReplica]:
    return FP8EngineReplica


def register() -> None:
    """Make `rollout.name=fp8engine` known to veRL (done on import)."""
    RolloutReplicaRegistry.register(NAME, _load_replica)
    _ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.FP8EngineRollout"
    CheckpointEngineRegistry.register(NAME)(FP8EngineCheckpointEngine)


register()
