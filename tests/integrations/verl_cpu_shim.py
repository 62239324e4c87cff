"""Test-only: what veRL 0.9.1 lacks to run its own GRPO trainer on a CPU, and a check of every weight sync.

Loaded in every veRL process (driver, task runner, FSDP workers, the fp8engine server actor) through
`VERL_USE_EXTERNAL_MODULES=verl_cpu_shim` with this directory on PYTHONPATH (test_verl_grpo.py sets both).

CPU gaps bridged here (the rest are config overrides in test_verl_grpo.py): veRL knows no CPU platform
(`get_device_name()` gives "cuda", the collective backend "nccl"), so a "cpu" platform is registered
(`VERL_PLATFORM=cpu`) with gloo collectives, torch.cpu as its device module (plus the memory and RNG calls
veRL makes on torch.cuda) and "CPU" as the device name its FLOPs counter looks up; its process group's
backend string ("cpu:gloo,cpu:gloo" there) becomes plain "gloo".

Sync check (`VERL_SYNC_CHECK`: a JSON-lines file): after each `FP8EngineRollout.update_weights`, every tensor veRL's
generator yielded is compared with the engine's `get_weights_by_name` — bitwise after the cast to the model dtype,
or, for an FP8 linear, with the dequantized blockwise quantization of that cast (what the plugin hands over) — and
one line records
the names, mismatches, the engine's commit seconds and veRL's wall seconds for the whole call.

Broadcast check (`VERL_BROADCAST_CHECK`: a JSON-lines file), for standalone mode through FP8EngineCheckpointEngine: a
digest of every tensor trainer rank 0 sends and of the engine's tensor of every name after each commit, one line per
side and sync. veRL 0.9.1's separate trainer also passes `flush=True` to a logger at start-up (a TypeError anywhere):
Logger._log drops that keyword here.

Dump (`FP8ENGINE_VERL_DUMP`: a directory; benchmarks/verl_fp8_mismatch.py reads it): every sync's yielded tensors
(`weights_v{version}.safetensors`, as yielded), every rollout the server actor answers (`rollouts_{pid}.jsonl`:
prompt ids, response ids, the engine's logprobs, the weight version of the last token) and, each step, the inputs of
veRL's `calculate_debug_metrics` (`debug_{n}.pt`: responses, response_mask, rollout_log_probs, old_log_probs), the
function that reports `training/rollout_probs_diff_mean`. Off unless the variable is set.
"""

import hashlib
import json
import logging
import os
import time
import types

import psutil
import torch
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry

FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _mem_get_info(device=None) -> tuple[int, int]:
    memory = psutil.virtual_memory()
    return memory.available, memory.total


_TORCH_CPU = {name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")}
CPU_DEVICE = types.SimpleNamespace(**(_TORCH_CPU | dict(
    empty_cache=lambda: None, synchronize=lambda device=None: None, set_device=lambda device: None,
    current_device=lambda: "cpu", device_count=lambda: 1, is_available=lambda: True,
    get_device_name=lambda device=None: "CPU", manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    get_rng_state=lambda device=None: torch.get_rng_state(),
    set_rng_state=lambda state, device=None: torch.set_rng_state(state),
    memory_allocated=lambda device=None: 0, memory_reserved=lambda device=None: 0,
    max_memory_allocated=lambda device=None: 0, max_memory_reserved=lambda device=None: 0,
    reset_peak_memory_stats=lambda device=None: None, mem_get_info=_mem_get_info,
    memory=types.SimpleNamespace(_set_allocator_settings=lambda settings: None))))


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformCUDA):
    """veRL's platform interface on the CPU: gloo collectives; Ray's "GPU" resource stands for the one CPU slot
    (`ray_init.num_gpus=1`), so the resource pools veRL builds per GPU still place one worker."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"  # veRL uses it as the device of .to(...) and device_id=; an index would mean an accelerator

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {}


def _gloo_only(init_process_group):
    """veRL asks for backend f"cpu:gloo,{device}:{collectives}", which on this platform names the CPU twice."""
    def init(*args, backend=None, **kwargs):
        if backend == "cpu:gloo,cpu:gloo":
            backend = "gloo"
        return init_process_group(*args, backend=backend, **kwargs)
    return init


torch.distributed.init_process_group = _gloo_only(torch.distributed.init_process_group)


def _without_flush(log):
    """veRL 0.9.1's separate trainer with hybrid_engine=False logs with print's flush=True, which Logger rejects (a
    TypeError at start-up on every platform): dropped here."""
    def log_(self, level, msg, args, **kwargs):
        kwargs.pop("flush", None)
        return log(self, level, msg, args, **kwargs)
    return log_


logging.Logger._log = _without_flush(logging.Logger._log)


def _check_sync(rollout, yielded: list[tuple[str, torch.Tensor]], report: dict, seconds: float) -> dict:
    server = rollout._server()
    import ray
    names = [name for name, _ in yielded]
    engine = ray.get(server.get_weights_by_name.remote(names))
    expected_names = ray.get(server.expected_weight_names.remote())
    fp8 = "fp8" in (rollout.config.quantization, (rollout.config.engine_kwargs.get("fp8engine") or {}).get(
        "quantization"))
    from fp8engine.weights.quant import (
        dequantize_weight_blockwise,
        quantize_weight_blockwise,
    )
    mismatches, quantized = [], 0
    for name, tensor in yielded:
        got = engine[name]
        if fp8 and name.endswith(tuple(f"{p}.weight" for p in FP8_LINEARS)):
            # the plugin hands over the model dtype's cast (shared_bucket), which the engine quantizes
            want = dequantize_weight_blockwise(*quantize_weight_blockwise(tensor.to(got.dtype).float())).to(got.dtype)
            quantized += 1
        else:
            want = tensor.to(got.dtype)
        if got.shape != want.shape or not torch.equal(got, want):
            diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else None
            mismatches.append({"name": name, "max_abs_diff": diff})
    tied = "lm_head.weight" in names and "lm_head.weight" not in expected_names
    stats = ray.get(server.stats.remote())
    return {"pid": os.getpid(), "weight_version": report["weight_version"], "num_tensors": len(names),
            "names": names, "engine_expected_names": expected_names, "tied_lm_head": tied,
            "tied_head_equals_embedding": bool(tied and torch.equal(engine["lm_head.weight"],
                                                                      engine["model.embed_tokens.weight"])),
            "fp8": fp8, "num_quantized_checked": quantized, "mismatches": mismatches,
            "engine_commit_seconds": report["seconds"], "update_weights_seconds": seconds,
            "num_buckets": report["num_buckets"], "num_bytes": report["num_bytes"],
            "read_seconds": report["read_seconds"], "handover_seconds": report["handover_seconds"],
            "engine_step_seconds_total": stats["step_seconds_total"],
            "engine_generation_tokens_total": stats["num_generation_tokens_total"]}


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _install_broadcast_check(path: str) -> None:
    """Standalone mode (FP8EngineCheckpointEngine): the trainer's rank 0 records a digest of every tensor it sends
    (as sent: floats in bfloat16), the rollout worker, after the engine's commit, a digest of the engine's tensor of
    each name; one JSON line per side and sync, compared by the test. Installed when the plugin registers itself
    (this module is imported while verl is, before the plugin can be)."""
    import sys

    from verl.workers.rollout.replica import RolloutReplicaRegistry
    register = RolloutReplicaRegistry.register

    def checking_register(name, *args, **kwargs):
        result = register(name, *args, **kwargs)
        if name == "fp8engine":
            _patch_broadcast(sys.modules["fp8engine.integrations.verl"], path)
        return result

    RolloutReplicaRegistry.register = checking_register
    plugin = sys.modules.get("fp8engine.integrations.verl")  # None, or being imported, or imported
    if hasattr(plugin, "register"):
        _patch_broadcast(plugin, path)


def _patch_broadcast(plugin, path: str) -> None:
    send_weights = plugin.FP8EngineCheckpointEngine.send_weights
    if getattr(send_weights, "sync_checked", False):
        return

    async def checked_send_weights(self, weights, global_steps=None):
        sent = {}

        def tee():
            for name, tensor in weights:
                if self.place is not None and self.place["rank"] == 0:
                    sent[name] = _digest(tensor.to(self.dtype) if tensor.is_floating_point() else tensor)
                yield name, tensor

        metrics = await send_weights(self, tee(), global_steps)
        if sent:
            with open(path, "a") as f:  # noqa: ASYNC230
                f.write(json.dumps({"side": "trainer", "global_steps": global_steps, "digests": sent}) + "\n")
        return metrics

    async def checked_update_weights(self, weights, wire_format="named_tensors", global_steps=None, **kwargs):
        report = await update_weights(self, weights, wire_format, global_steps, **kwargs)
        import ray
        server = self._server()
        names = ray.get(server.expected_weight_names.remote()) + ["lm_head.weight"]
        engine = ray.get(server.get_weights_by_name.remote(names))
        with open(path, "a") as f:  # noqa: ASYNC230
            f.write(json.dumps({"side": "engine", "weight_version": report["weight_version"],
                                "num_tensors": report["num_tensors"], "commit_seconds": report["seconds"],
                                "digests": {name: _digest(t) for name, t in engine.items()}}) + "\n")
        return report

    update_weights = plugin.FP8EngineRollout.update_weights
    checked_send_weights.sync_checked = True
    plugin.FP8EngineCheckpointEngine.send_weights = checked_send_weights
    plugin.FP8EngineRollout.update_weights = checked_update_weights


def _install_sync_check(path: str) -> None:
    """Wraps FP8EngineRollout.update_weights where veRL's worker gets its rollout class (get_rollout_class): this
    module is imported while verl itself is, so the plugin may not be importable yet."""
    from verl.workers.rollout import base
    get_rollout_class = base.get_rollout_class

    def get_checked_rollout_class(rollout_name: str, mode: str = "async"):
        cls = get_rollout_class(rollout_name, mode)
        if rollout_name == "fp8engine" and not getattr(cls.update_weights, "sync_checked", False):
            cls.update_weights = _checked(cls.update_weights, path)
        return cls

    base.get_rollout_class = get_checked_rollout_class


def _checked(update_weights, path: str):
    async def checked_update_weights(self, weights, *args, **kwargs):
        yielded = []

        def tee():
            for name, tensor in weights:
                yielded.append((name, tensor.detach().to("cpu").clone()))
                yield name, tensor

        start = time.perf_counter()
        report = await update_weights(self, tee(), *args, **kwargs)
        seconds = time.perf_counter() - start
        if os.environ.get("FP8ENGINE_VERL_DUMP"):
            _dump_weights(os.environ["FP8ENGINE_VERL_DUMP"], report["weight_version"], yielded)
        record = _check_sync(self, yielded, report, seconds)
        record["check_seconds"] = time.perf_counter() - start - seconds  # inside veRL's update_weights timer too
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return report

    checked_update_weights.sync_checked = True
    return checked_update_weights


def _dump_weights(directory: str, version, yielded: list[tuple[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    save_file({name: t.contiguous() for name, t in yielded}, os.path.join(directory, f"weights_v{version}.safetensors"))


def _dump_generate(generate, directory: str):
    async def dumped_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        out = await generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        record = {"request_id": str(request_id), "prompt_ids": [int(t) for t in prompt_ids],
                  "sampling_params": {k: v for k, v in sampling_params.items() if isinstance(v, int | float | bool)},
                  "token_ids": list(out.token_ids), "log_probs": out.log_probs,
                  "global_steps": (out.extra_fields or {}).get("global_steps"),
                  "min_global_steps": (out.extra_fields or {}).get("min_global_steps")}
        with open(os.path.join(directory, f"rollouts_{os.getpid()}.jsonl"), "a") as f:  # noqa: ASYNC230
            f.write(json.dumps(record) + "\n")
        return out

    dumped_generate.dumped = True
    return dumped_generate


def _install_dump(directory: str) -> None:
    """Wraps the server actor's generate once the plugin module has finished importing (it registers itself on its
    last line; this module may be imported while the plugin is, through veRL's import), and veRL's
    calculate_debug_metrics before its trainer imports it."""
    os.makedirs(directory, exist_ok=True)
    import sys

    from verl.workers.rollout.replica import RolloutReplicaRegistry
    register = RolloutReplicaRegistry.register

    def patch_server():
        module = sys.modules.get("fp8engine.integrations.verl")
        server = getattr(module, "FP8EngineServer", None)
        if server is not None and not getattr(server.generate, "dumped", False):
            server.generate = _dump_generate(server.generate, directory)

    def dumping_register(name, *args, **kwargs):
        result = register(name, *args, **kwargs)
        if name == "fp8engine":
            patch_server()
        return result

    RolloutReplicaRegistry.register = dumping_register
    patch_server()

    from verl.utils.debug import metrics
    calculate = metrics.calculate_debug_metrics
    calls = [0]

    def dumping_calculate_debug_metrics(data):
        calls[0] += 1
        batch = {k: data.batch[k].detach().cpu().clone() for k in
                 ("responses", "response_mask", "rollout_log_probs", "old_log_probs") if k in data.batch}
        result = calculate(data)
        torch.save(batch | {"metrics": result}, os.path.join(directory, f"debug_{os.getpid()}_{calls[0]}.pt"))
        return result

    metrics.calculate_debug_metrics = dumping_calculate_debug_metrics


if os.environ.get("VERL_SYNC_CHECK"):
    _install_sync_check(os.environ["VERL_SYNC_CHECK"])
if os.environ.get("VERL_BROADCAST_CHECK"):
    _install_broadcast_check(os.environ["VERL_BROADCAST_CHECK"])
if os.environ.get("FP8ENGINE_VERL_DUMP"):
    _install_dump(os.environ["FP8ENGINE_VERL_DUMP"])
