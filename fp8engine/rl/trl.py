"""TRL's GRPOTrainer on fp8engine rollouts, with TRL's own importance-sampling correction.

    from fp8engine.rl import RolloutEngine
    from fp8engine.rl.trl import make_rollout_func
    rollouts = RolloutEngine(EngineConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3"))
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=dataset,
                          rollout_func=make_rollout_func(rollouts))      # use_vllm stays False

What TRL 1.16 does (trl/trainer/grpo_trainer.py, grpo_config.py), and what this module does about it:

- `GRPOTrainer._generate` calls `rollout_func(prompts, trainer)` with the process's prompts as the
  dataset holds them (text, or chat messages: untemplated), each repeated `num_generations` times in
  a row (`RepeatSampler`), and expects lists `prompt_ids`, `completion_ids`, `logprobs` (one float
  per completion token); other keys reach the reward functions as per-sample keyword arguments.
- Its importance-sampling correction (`vllm_importance_sampling_correction`, on by default; modes
  token_truncate / token_mask / sequence_truncate / sequence_mask; bounds
  `vllm_importance_sampling_clip_min` / `_clip_max`, `vllm_importance_sampling_cap` being the
  deprecated name of `_clip_max`) runs only where `trainer.use_vllm` is true: it then computes
  `old_per_token_logps` = log_softmax(logits / temperature) of the completions (no top-k/top-p),
  takes ratio = exp(old - rollout logprob) per token (or summed per sequence), clips or masks it,
  logs `sampling/sampling_logp_difference/{mean,max}` and
  `sampling/importance_sampling_ratio/{min,mean,max}`, and multiplies the per-token loss by it.
- With `use_vllm` true and a rollout_func, `_generate` first calls
  `trainer.vllm_generation.sync_weights()` whenever `state.global_step != trainer._last_loaded_step`.

`GRPOConfig(use_vllm=True)` would start vLLM, so the trainer is built with use_vllm=False and the
rollout function's first call switches it on (`_attach`, the one place that touches TRL's private
state; `check_trl` verifies the source lines it relies on and raises if they changed): use_vllm,
vllm_generation (an object whose sync_weights() syncs the engine, so TRL's own trigger drives the
sync), _last_loaded_step, and a wrapper on `_get_per_token_logps_and_entropies` that logs
fp8engine's mismatch metrics (`correction.mismatch_metrics` of TRL's old logprobs against the
engine's) through `_log_metric`, the hook TRL hands reward functions as `log_metric`.
"""

import dataclasses
import functools
import inspect
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fp8engine.rl.batch import RolloutBatch, pad_float
from fp8engine.rl.correction import mismatch_metrics
from fp8engine.sampling_params import SamplingParams

MISMATCH_METRICS = ("k1", "k3", "is_mean", "is_min", "is_max", "ess")
"""Keys of `correction.mismatch_metrics` logged to TRL as `fp8engine/<key>` each generation."""

TRL_CONTRACT = {
    "_generate": ("if self.use_vllm and self.state.global_step != self._last_loaded_step:",
                  "self.vllm_generation.sync_weights()",
                  "self._last_loaded_step = self.state.global_step",
                  "output = self.rollout_func(prompts, self)"),
    "_generate_and_score_completions": (
        "self.use_vllm and self.vllm_importance_sampling_correction",
        "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(",
        "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
        "self._pending_metrics.clear()"),
    "_compute_loss": ('if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":',
                      'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]'),
    "_log_metric": ("self._pending_metrics[name].append(value)",),
}
"""GRPOTrainer method -> source lines this module relies on (`check_trl`)."""
LOGPS_PARAMETERS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep")
"""The leading parameters of GRPOTrainer._get_per_token_logps_and_entropies (`check_trl`)."""


def make_rollout_func(rollouts, sampling_params: SamplingParams | None = None, *, colocate: bool = False,
                      sleep_level: int = 1) -> "TRLRolloutFunc":
    """A `rollout_func` for `trl.GRPOTrainer` that generates with fp8engine.

    rollouts: a RolloutEngine, RolloutClient or RolloutCluster (anything with `sync_weights(model,
        weight_version)` and `rollout(prompts, n, sampling_params) -> RolloutBatch`).
    sampling_params: what the trainer's config does not set (stop, stop_token_ids, ignore_eos,
        min_tokens; seed, used as is on every call: None lets the engine draw each request's
        seed, reproducibly from EngineConfig.seed). temperature, top_p, top_k, min_p,
        repetition_penalty and max_tokens come from the trainer's GRPOConfig (the same names,
        top_k 0 = off, max_completion_length), then its `generation_kwargs` (SamplingParams field
        names) override, as TRL's do for vLLM. Logprobs are "processed": TRL's
        log_softmax(logits / temperature), and with top-k/top-p or a penalty the distribution
        actually sampled from (renormalised over the kept tokens), as vLLM's processed_logprobs
        that TRL asks for.

    Each call syncs the trainer's weights into the engine first when `trainer.state.global_step`
    moved since the last sync (weight_version = global_step; the model unwrapped through
    accelerate; a PEFT model's adapter alone when the rollouts take one — a RolloutEngine with
    max_lora_rank > 0 —, else its adapters merged in as TRL does for vLLM), switches TRL's
    importance-sampling correction on for the engine's logprobs, and returns per completion:
    prompt_ids, completion_ids, logprobs (lists), and the extra fields num_preemptions,
    weight_version, token_weight_versions (one per completion token), finish_reason ("stop" |
    "length" | "abort"), which reward functions receive as keyword arguments. Metrics logged to TRL: fp8engine/{k1, k3, is_mean, is_min, is_max, ess}
    (the engine's logprobs vs TRL's old_per_token_logps, while vllm_importance_sampling_correction
    is on: TRL computes those only then), fp8engine/{weight_version, num_preemptions,
    rollout_seconds, sync_seconds, sync_bytes}. One trainer process (no multi-GPU data parallelism yet); no
    tools or environments.

    colocate: the engine shares the trainer's machine and sleeps while the trainer steps (TRL's
    vllm_enable_sleep_mode): it wakes the weights for a sync, then the KV cache for the rollout, and
    sleeps at `sleep_level` once the rollout is done (1 keeps the weights, so a call that does not
    sync, within one global step, finds them; 2 drops them, for a trainer that syncs before every
    rollout). fp8engine/sleep_seconds and wake_seconds are logged.
    """
    return TRLRolloutFunc(rollouts, sampling_params, colocate=colocate, sleep_level=sleep_level)


class TRLRolloutFunc:
    """The callable `make_rollout_func` returns; see there."""

    def __init__(self, rollouts, sampling_params: SamplingParams | None = None, *, colocate: bool = False,
                 sleep_level: int = 1):
        if not (callable(getattr(rollouts, "rollout", None)) and callable(getattr(rollouts, "sync_weights", None))):
            raise TypeError(f"rollouts must be a RolloutEngine, RolloutClient or RolloutCluster, got "
                            f"{type(rollouts).__name__}")
        if sampling_params is not None and sampling_params.logprobs_mode != "processed":
            raise ValueError(f"TRL compares the rollout logprobs with log_softmax(logits / temperature): "
                             f"logprobs_mode must be 'processed', got {sampling_params.logprobs_mode!r}")
        if colocate and not callable(getattr(rollouts, "sleep", None)):
            raise TypeError(f"colocate=True needs rollouts that sleep and wake_up, got {type(rollouts).__name__}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level!r}")
        self.rollouts = rollouts
        self.colocate, self.sleep_level = colocate, sleep_level
        self.base_params = sampling_params or SamplingParams()
        self.synced_step: int | None = None
        self._pending: tuple[list[list[int]], list[list[float]]] | None = None

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        _attach(trainer, self)
        self.sync(trainer)
        if self.colocate:
            trainer._log_metric("fp8engine/wake_seconds", _seconds(self.rollouts.wake_up()))
        params = generation_params(trainer.args, self.base_params)
        heads, runs = _runs(prompts)
        head_ids = prompt_ids(trainer, heads)
        start = time.perf_counter()
        samples: list[dict] = [{} for _ in prompts]
        for n in sorted(set(len(run) for run in runs)):  # one rollout per run length: num_generations
            chosen = [i for i, run in enumerate(runs) if len(run) == n]
            batch = self.rollouts.rollout([head_ids[i] for i in chosen], n=n, sampling_params=params)
            for row, sample in enumerate(_samples(batch)):
                samples[runs[chosen[row // n]][row % n]] = sample
        out = {key: [s[key] for s in samples] for key in samples[0]}
        self._pending = out["completion_ids"], out["logprobs"]
        trainer._log_metric("fp8engine/rollout_seconds", time.perf_counter() - start)
        trainer._log_metric("fp8engine/weight_version", float(self.synced_step))
        trainer._log_metric("fp8engine/num_preemptions", float(sum(out["num_preemptions"])))
        if self.colocate:  # the trainer's step runs with the engine's memory handed back
            trainer._log_metric("fp8engine/sleep_seconds", _seconds(self.rollouts.sleep(self.sleep_level)))
        return out

    def sync(self, trainer) -> None:
        """Sync the trainer's weights into the engine as version `global_step`, unless done already."""
        step = trainer.state.global_step
        if step == self.synced_step:
            return
        start = time.perf_counter()
        if self.colocate:
            self.rollouts.wake_up(["weights"])  # the KV cache stays asleep while the weights arrive
        model = trainer.accelerator.unwrap_model(trainer.model)
        if getattr(self.rollouts, "takes_lora", False) and hasattr(model, "peft_config"):
            report = self.rollouts.sync_weights(model, weight_version=step)  # the adapter alone, unmerged
        else:
            with hf_weights(model) as weights:
                report = self.rollouts.sync_weights(weights, weight_version=step)
        self.synced_step = step
        trainer._log_metric("fp8engine/sync_seconds", time.perf_counter() - start)
        trainer._log_metric("fp8engine/sync_bytes", float(report.num_bytes))

    def log_mismatch(self, trainer, completions: torch.Tensor, train_logprobs: torch.Tensor) -> None:
        """Log mismatch metrics when `completions` [B, T] (right-padded) are the last rollout's."""
        if self._pending is None:
            return
        completion_ids, logprobs = self._pending
        if len(completion_ids) != completions.shape[0] or any(
                completions[i, :len(ids)].tolist() != ids for i, ids in enumerate(completion_ids)):
            return
        self._pending = None
        width = completions.shape[1]
        mask = pad_float([[1.0] * len(ids) for ids in completion_ids], width)
        if not mask.any():
            return
        metrics = mismatch_metrics(train_logprobs.cpu(), pad_float(logprobs, width), mask)
        for name in MISMATCH_METRICS:
            trainer._log_metric(f"fp8engine/{name}", metrics[name])


def _seconds(report) -> float:
    """A sleep's or a wake's seconds: a RolloutCluster's replicas' reports give the slowest one's."""
    return max(r.seconds for r in report) if isinstance(report, list) else report.seconds


def generation_params(args, base: SamplingParams) -> SamplingParams:
    """`base` with the sampling settings of a GRPOConfig `args` and processed logprobs on."""
    if args.max_completion_length is None:
        raise ValueError("GRPOConfig.max_completion_length must be set (it is the rollouts' max_tokens)")
    extra = args.generation_kwargs or {}
    extra = json.loads(extra) if isinstance(extra, str) else dict(extra)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"GRPOConfig.generation_kwargs has keys fp8engine's SamplingParams lacks: {unknown}")
    configured = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or -1,
                      min_p=args.min_p or 0.0, repetition_penalty=args.repetition_penalty,
                      max_tokens=args.max_completion_length)
    return dataclasses.replace(base, **configured | extra, logprobs=base.logprobs or 0, logprobs_mode="processed")


def prompt_ids(trainer, prompts: list) -> list[list[int]]:
    """Token ids of prompts as TRL's own generation path makes them: chat messages through the
    processing class's chat template (the trainer's chat_template and chat_template_kwargs, a
    generation prompt added), text through the processing class as is."""
    from trl.data_utils import is_conversational

    processing = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        return processing.apply_chat_template(conversation=prompts, chat_template=trainer.chat_template,
                                              add_generation_prompt=True, tokenize=True, return_dict=True,
                                              **trainer.chat_template_kwargs)["input_ids"]
    return processing(text=prompts)["input_ids"]


@contextmanager
def hf_weights(model: nn.Module) -> Iterator[nn.Module | dict[str, torch.Tensor]]:
    """The model, or for a PEFT model its adapters merged in and the base model's parameter names
    (unmerged again on exit), as TRL's vLLM sync names them."""
    from accelerate.utils import is_peft_model

    if not is_peft_model(model):
        yield model
        return
    model.merge_adapter()
    try:
        yield dict(_peft_base_parameters(model))
    finally:
        model.unmerge_adapter()


def _peft_base_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in model.named_parameters():
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if model.prefix in name or "original_module" in name:
            continue
        yield name.replace("modules_to_save.default.", ""), param.data


def check_trl(trainer_class=None) -> None:
    """Raise RuntimeError if GRPOTrainer lacks a source line of TRL_CONTRACT (TRL changed)."""
    import trl

    trainer_class = trainer_class or trl.GRPOTrainer
    missing = []
    for method, lines in TRL_CONTRACT.items():
        source = inspect.getsource(getattr(trainer_class, method, None) or (lambda: None))
        missing += [f"{method}: {line!r}" for line in lines if line not in source]
    logps = getattr(trainer_class, "_get_per_token_logps_and_entropies", None)
    if logps is None or tuple(inspect.signature(logps).parameters)[:5] != LOGPS_PARAMETERS:
        missing.append(f"_get_per_token_logps_and_entropies{LOGPS_PARAMETERS}")
    if missing:
        raise RuntimeError(f"fp8engine.rl.trl was written against TRL 1.16's GRPOTrainer; TRL {trl.__version__} "
                           f"lacks: " + "; ".join(missing))


def _attach(trainer, func: TRLRolloutFunc) -> None:
    """Turn TRL's vLLM-gated importance-sampling correction and weight-sync trigger on for the engine
    (see the module docstring), or point them at `func` where another rollout function did; the only
    place that writes TRL's private state."""
    if isinstance(getattr(trainer, "vllm_generation", None), _EngineSync):
        trainer.vllm_generation.func = func  # attached before, by another rollout function
        return
    check_trl(type(trainer))
    if trainer.use_vllm:
        raise ValueError("make_rollout_func replaces vLLM: build the trainer with GRPOConfig(use_vllm=False)")
    if trainer.accelerator.num_processes > 1:
        raise ValueError("make_rollout_func supports one trainer process; got "
                         f"{trainer.accelerator.num_processes}")
    if trainer.tools or trainer.environment_factories is not None:
        raise ValueError("make_rollout_func does not run tool calls or environments")
    trainer.use_vllm = True
    trainer.vllm_generation = _EngineSync(func, trainer)
    trainer._last_loaded_step = trainer.state.global_step
    trainer._get_per_token_logps_and_entropies = _logging_mismatch(
        trainer._get_per_token_logps_and_entropies, trainer.vllm_generation)


class _EngineSync:
    """Stands in for TRL's `trainer.vllm_generation`, whose sync_weights() TRL calls when the step moved."""

    def __init__(self, func: TRLRolloutFunc, trainer):
        self.func, self.trainer = func, trainer

    def sync_weights(self) -> None:
        self.func.sync(self.trainer)


def _logging_mismatch(per_token_logps: Callable, sync: _EngineSync) -> Callable:
    """Wrap `_get_per_token_logps_and_entropies` so that its no-grad call on the policy over the
    last rollout's completions (TRL's old_per_token_logps) also logs the mismatch metrics."""
    trainer = sync.trainer

    @functools.wraps(per_token_logps)
    def wrapped(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = per_token_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if model is trainer.model and not torch.is_grad_enabled() and trainer.vllm_importance_sampling_correction:
            sync.func.log_mismatch(trainer, input_ids[:, -logits_to_keep:], out[0])
        return out

    return wrapped


def _runs(prompts: Sequence) -> tuple[list[Any], list[list[int]]]:
    """Runs of equal consecutive prompts (TRL repeats each num_generations times): each run's
    prompt and the indices it covers."""
    heads, runs = [], []
    for i, prompt in enumerate(prompts):
        if runs and prompt == heads[-1]:
            runs[-1].append(i)
        else:
            heads.append(prompt)
            runs.append([i])
    return heads, runs


def _samples(batch: RolloutBatch) -> list[dict]:
    prompts, responses = batch.prompts_and_responses()
    return [{"prompt_ids": prompt, "completion_ids": response,
             "logprobs": batch.rollout_logprobs[i, :len(response)].tolist(),
             "num_preemptions": int(batch.num_preemptions[i]), "weight_version": batch.weight_version,
             "token_weight_versions": batch.token_weight_versions[i, :len(response)].tolist(),
             "finish_reason": batch.finish_reasons[i]}
            for i, (prompt, response) in enumerate(zip(prompts, responses))]
