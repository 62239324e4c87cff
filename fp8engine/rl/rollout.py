"""RolloutEngine: the trainer adapter over an in-process LLMEngine."""

import dataclasses
import functools
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

import torch
from torch import nn

from fp8engine.config import EngineConfig
from fp8engine.engine import LLMEngine, Prompt
from fp8engine.outputs import EngineStats, RequestOutput
from fp8engine.rl.batch import RolloutBatch, Sample, collate, pad_token_id, rollout_stats
from fp8engine.rl.sync import (DEFAULT_BUCKET_BYTES, Bucket, SyncDtype, SyncReport, bucket_bytes_of,
                               buckets, check_bucket_bytes, check_version, named_tensors)
from fp8engine.sampling_params import SamplingParams

PauseMode = Literal["abort", "wait", "keep"]


class RolloutEngine:
    """Trainer-facing rollouts and weight syncs on an in-process `LLMEngine`.

    Same methods as `RolloutClient` (HTTP), so a trainer switches with one line.
    bucket_bytes: size of one weight-sync bucket (bytes, default 256 MiB).
    sync_dtype: floating tensors are cast to this before a sync; "auto" = None = the trainer's
        dtype as is (in process nothing is transferred, and the engine rounds or quantizes each
        tensor once, into its own buffers; bf16/fp16/fp32 are all accepted).
    """

    def __init__(self, config: EngineConfig, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 sync_dtype: SyncDtype = "auto"):
        self.engine = LLMEngine(config)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.sync_dtype = None if sync_dtype == "auto" else sync_dtype
        self.paused: PauseMode | None = None
        self.pad_token_id = pad_token_id(self.engine.tokenizer)

    def sync_weights(self, model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
                     weight_version: int) -> SyncReport:
        """Stream the trainer's weights into the engine in buckets; the engine validates the
        whole stream before writing anything, then tags later rollouts with `weight_version`.
        Requests in flight finish on the old weights first."""
        version = check_version(weight_version)
        start = time.perf_counter()
        sizes: list[int] = []
        stream = buckets(named_tensors(model_or_state_dict), self.bucket_bytes, self.sync_dtype)
        report = self.engine.update_weights(_flatten(stream, sizes), weight_version=version)
        return SyncReport(time.perf_counter() - start, sum(sizes), report.num_tensors, len(sizes),
                          version)

    def rollout(self, prompts: Sequence[Prompt], n: int = 1,
                sampling_params: SamplingParams | None = None) -> RolloutBatch:
        """Generate `n` samples per prompt (str, token ids or chat messages) and pad them into a
        RolloutBatch of B = len(prompts) * n rows, prompt-major, with per-token logprobs."""
        if self.paused:
            raise RuntimeError(f"the engine is paused (mode {self.paused!r}); call resume() first")
        params = rollout_params(prompts, n, sampling_params)
        start = time.perf_counter()
        outputs = self.engine.generate(list(prompts), params)
        seconds = time.perf_counter() - start
        batch = collate([s for out in outputs for s in request_samples(out)], n, self.pad_token_id)
        batch.stats = rollout_stats(batch, seconds, self.engine.get_stats())
        batch.scorer = functools.partial(self._score, batch.weight_version)
        return batch

    def _score(self, weight_version: int, prompts: list[list[int]], responses: list[list[int]],
               params: SamplingParams) -> list[list[float]]:
        if self.engine.weight_version != weight_version:
            raise ValueError(f"the batch came from weight version {weight_version} but the engine now holds "
                             f"{self.engine.weight_version}; exact logprobs need the weights that sampled it")
        return self.engine.score(prompts, responses, params)

    def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating. In-flight requests (added to `.engine` directly) are aborted
        ("abort") or run to completion ("wait"), their final outputs coming back from the next
        `engine.step()` as after a weight update; or kept queued, un-stepped, until resume()
        ("keep"; a sync meanwhile finishes them on the old weights: no rollout spans two
        versions). rollout() raises while paused."""
        if check_pause_mode(mode) != "keep":
            self.engine.drain(mode)
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()


def check_pause_mode(mode) -> PauseMode:
    if mode not in ("abort", "wait", "keep"):
        raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
    return mode


def rollout_params(prompts: Sequence[Prompt], n: int,
                   sampling_params: SamplingParams | None) -> SamplingParams:
    """`sampling_params` with n set and logprobs on; checks the arguments of a rollout call."""
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (each a str, token ids or "
                         f"chat messages), got {type(prompts).__name__}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    params = sampling_params or SamplingParams()
    if params.n not in (1, n):
        raise ValueError(f"sampling_params.n={params.n} conflicts with n={n}; set one of them")
    logprobs = 0 if params.logprobs is None else params.logprobs
    return dataclasses.replace(params, n=n, logprobs=logprobs)


def _flatten(stream: Iterator[Bucket], sizes: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """The buckets' items one by one, appending each bucket's byte size to `sizes`."""
    for bucket in stream:
        sizes.append(bucket_bytes_of(bucket))
        yield from bucket


def request_samples(out: RequestOutput) -> list[Sample]:
    """A finished request's samples, as a RolloutBatch takes them."""
    return [Sample(out.prompt_token_ids, c.token_ids, c.logprobs, c.log_kept_mass, c.finish_reason,
                   c.num_preemptions, out.weight_version, c.text, c.routed_experts) for c in out.outputs]
