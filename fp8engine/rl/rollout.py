"""RolloutEngine: the trainer adapter over an in-process LLMEngine."""

import contextlib
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Literal

import torch
from torch import nn

from fp8engine.config import EngineConfig
from fp8engine.engine import LLMEngine, Prompt, check_update_options
from fp8engine.outputs import EngineStats, RequestOutput, SleepReport
from fp8engine.rl.batch import RolloutBatch, Sample, pad_token_id, rollout_stats
from fp8engine.rl.groups import (
    UNFINISHED,
    GroupBook,
    MinGroups,
    PartialGroup,
    Slot,
    check_min_groups,
    check_resume,
    continuation,
    enough,
    finished_at_length,
    gather,
    group_batch,
)
from fp8engine.rl.sync import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    SyncDtype,
    SyncReport,
    bucket_bytes_of,
    buckets,
    check_bucket_bytes,
    check_version,
    named_tensors,
    peft_adapter,
)
from fp8engine.sampling_params import SamplingParams

PauseMode = Literal["abort", "wait", "keep"]


class RolloutEngine:
    """Trainer-facing rollouts and weight syncs on an in-process `LLMEngine`.

    Same methods as `RolloutClient` (HTTP), so a trainer switches with one line.
    bucket_bytes: size of one weight-sync bucket (bytes, default 256 MiB).
    sync_dtype: floating tensors are cast to this before a sync (pre-quantized FP8 codes and the
        scales keep theirs: rl.sync.synced_dtype); "auto" = None = the trainer's
        dtype as is (in process nothing is transferred, and the engine rounds or quantizes each
        tensor once, into its own buffers; bf16/fp16/fp32 are all accepted).
    """

    def __init__(self, config: EngineConfig, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 sync_dtype: SyncDtype = "auto"):
        self.engine = LLMEngine(config)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.sync_dtype = None if sync_dtype == "auto" else sync_dtype
        self.paused: PauseMode | None = None
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.pad_token_id = pad_token_id(self.engine.tokenizer)
        self.turns = Turns()
        self.finished: dict[str, RequestOutput] = {}  # finished outputs not yet taken by their GroupRun

    @property
    def takes_lora(self) -> bool:
        """Whether sync_weights sends a PEFT model's adapter alone (the engine has LoRA buffers)."""
        return self.engine.config.max_lora_rank > 0

    def sync_weights(self, model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
                     weight_version: int, *, in_flight: str = "wait", kv_on_update: str = "keep") -> SyncReport:
        """Stream the trainer's weights into the engine in buckets; the engine validates the
        whole stream before writing anything, then tags the tokens it samples with `weight_version`.
        Requests in flight finish on the old weights first ("wait"), are aborted ("abort"), or go on under
        the new ones ("keep"; kv_on_update "keep" | "recompute", see LLMEngine.update_weights).
        A PEFT LoRA model, on an engine with LoRA buffers (max_lora_rank > 0), sends its adapter alone
        (LLMEngine.update_lora): the base stays as the engine holds it."""
        version = check_version(weight_version)
        check_update_options(in_flight, kv_on_update)
        start = time.perf_counter()
        adapter = peft_adapter(model_or_state_dict) if self.takes_lora else None
        if adapter is not None:
            with self.turns.sync():
                report = self.engine.update_lora(adapter[0], adapter[1], weight_version=version,
                                                 in_flight=in_flight, kv_on_update=kv_on_update)
            return SyncReport(time.perf_counter() - start, report.num_bytes, report.num_tensors, 1, version)
        sizes: list[int] = []
        stream = buckets(named_tensors(model_or_state_dict), self.bucket_bytes, self.sync_dtype)
        with self.turns.sync():
            report = self.engine.update_weights(_flatten(stream, sizes), weight_version=version, in_flight=in_flight,
                                                kv_on_update=kv_on_update)
        return SyncReport(time.perf_counter() - start, sum(sizes), report.num_tensors, len(sizes),
                          version)

    def rollout(self, prompts: Sequence[Prompt], n: int = 1,
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                min_groups: MinGroups = None, resume: Sequence[PartialGroup] | None = None,
                sessions: Sequence[Hashable] | None = None) -> RolloutBatch:
        """Generate `n` samples per prompt (str, token ids or chat messages) and pad them into a
        RolloutBatch of B = len(prompts) * n rows, prompt-major, with per-token logprobs.

        min_groups: return once this many prompt groups finished (an int), or once the callable, given the
            finished groups (a RolloutBatch each, in finish order), returns True (DAPO's dynamic sampling);
            the unfinished groups are aborted and kept in batch.partial. resume: a batch.partial to continue
            first (see fp8engine.rl.groups); prompts may then be empty. Rows follow the finished groups,
            resumed ones first (batch.group_prompts names each group's prompt).
        sampling_params may be a list, one per prompt (without min_groups and resume). sessions: one key per
            prompt naming the conversation it continues (rl.episodes); a RolloutCluster keeps a session on one
            replica, one engine has nothing to route.
        """
        self._check_not_paused()
        resume = check_resume(resume, n)
        params = rollout_params(prompts, n, sampling_params, allow_empty=bool(resume),
                                per_prompt=min_groups is None and not resume)
        check_min_groups(min_groups, len(resume) + len(prompts))
        check_sessions(sessions, prompts)
        start = time.perf_counter()
        run = GroupRun(self, n)
        run.add(resume, prompts, params)
        finished: list[tuple[int, object, list[Sample]]] = []
        views: list[RolloutBatch] = []
        try:
            while run.active and not enough(min_groups, views):
                for key, prompt, samples in run.step():
                    finished.append((key, prompt, samples))
                    if callable(min_groups):
                        views.append(group_batch(samples, n, self.pad_token_id, prompt))
                    else:
                        views.append(None)
        finally:
            partial = run.abort()
        batch = gather(finished, n, self.pad_token_id, partial, self.engine.weight_version)
        batch.stats = rollout_stats(batch, time.perf_counter() - start, self.engine.get_stats())
        batch.scorer = functools.partial(self._score, batch_versions(batch))
        return batch

    def stream(self, prompts: Iterable[Prompt], n: int = 1, sampling_params: SamplingParams | None = None, *,
               max_groups_in_flight: int | None = None) -> Iterator[RolloutBatch]:
        """A RolloutBatch (n rows) per prompt group as it finishes, in finish order. `prompts` may be any
        iterable, endless too: at most max_groups_in_flight groups are in the engine at a time (default: enough
        to fill max_num_seqs twice). Another thread may call sync_weights meanwhile (in_flight="keep": the
        groups go on under the new weights); closing the iterator aborts the groups still running."""
        self._check_not_paused()
        params = rollout_params([None], n, sampling_params)
        limit = max_groups_in_flight or 2 * -(-self.engine.config.max_num_seqs // n)
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_groups_in_flight must be an integer >= 1, got {max_groups_in_flight!r}")
        source = iter(prompts)
        run = GroupRun(self, n)
        try:
            while True:
                more = list(itertools.islice(source, limit - run.book.num_running))
                if more:
                    run.add([], more, params)
                if not run.active:
                    return
                for key, prompt, samples in run.step():
                    batch = group_batch(samples, n, self.pad_token_id, prompt)
                    batch.scorer = functools.partial(self._score, batch_versions(batch))
                    yield batch
        finally:
            run.abort()

    def _score(self, versions: list[int], prompts: list[list[int]], responses: list[list[int]],
               params: SamplingParams) -> list[list[float]]:
        if len(versions) > 1:
            raise ValueError(f"the batch spans weight versions {versions} (a sync with in_flight='keep' ran while "
                             f"it was generated); exact logprobs need the one set of weights that sampled it")
        weight_version = versions[0]
        if self.engine.weight_version != weight_version:
            raise ValueError(f"the batch came from weight version {weight_version} but the engine now holds "
                             f"{self.engine.weight_version}; exact logprobs need the weights that sampled it")
        return self.engine.score(prompts, responses, params)

    def _check_not_paused(self) -> None:
        if self.paused:
            raise RuntimeError(f"the engine is paused (mode {self.paused!r}); call resume() first")
        self.engine.check_ready()

    def sleep(self, level: int = 1, tags: Sequence[str] | None = None) -> SleepReport:
        """Hand the engine's memory back while the trainer beside it steps (LLMEngine.sleep: level 1 keeps the
        weights, 2 drops them for the next sync to fill; requests in flight finish first); rollout() raises until
        wake_up()."""
        with self.turns.sync():
            return self.engine.sleep(level, tags)

    def wake_up(self, tags: Sequence[str] | None = None) -> SleepReport:
        """Take the memory back (LLMEngine.wake_up), all at once or a tag at a time: wake_up(["weights"]),
        sync_weights(...), wake_up(["kv_cache"])."""
        with self.turns.sync():
            return self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating. In-flight requests (added to `.engine` directly) are aborted
        ("abort") or run to completion ("wait"), their final outputs coming back from the next
        `engine.step()` as after a weight update; or kept queued, un-stepped, until resume()
        ("keep"; a sync meanwhile finishes them on the old weights: no rollout spans two
        versions). rollout() raises while paused."""
        if check_pause_mode(mode) != "keep":
            with self.turns.sync():
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


def rollout_params(prompts: Sequence[Prompt], n: int, sampling_params: SamplingParams | None, *,
                   allow_empty: bool = False, per_prompt: bool = False) -> SamplingParams | list[SamplingParams]:
    """`sampling_params` with n set and logprobs on; checks the arguments of a rollout call. per_prompt: a list
    of params, one per prompt, is accepted too (and returned as a list)."""
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence) or not (prompts or allow_empty):
        raise ValueError("prompts must be a non-empty list of prompts (each a str, token ids or "
                         f"chat messages), got {type(prompts).__name__}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if isinstance(sampling_params, (list, tuple)):
        if not per_prompt:
            raise ValueError("sampling_params: one SamplingParams here (a list, one per prompt, is taken without "
                             "min_groups and resume)")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts")
        return [rollout_params(prompts, n, p, allow_empty=allow_empty) for p in sampling_params]
    params = sampling_params or SamplingParams()
    if params.n not in (1, n):
        raise ValueError(f"sampling_params.n={params.n} conflicts with n={n}; set one of them")
    logprobs = 0 if params.logprobs is None else params.logprobs
    return dataclasses.replace(params, n=n, logprobs=logprobs)


def check_sessions(sessions: Sequence[Hashable] | None, prompts: Sequence[Prompt]) -> list | None:
    """sessions as a list (one hashable key per prompt), or None."""
    if sessions is None:
        return None
    if isinstance(sessions, (str, bytes)) or not isinstance(sessions, Sequence) or len(sessions) != len(prompts) \
            or not all(isinstance(k, Hashable) for k in sessions):
        raise ValueError(f"sessions must be a list of {len(prompts)} hashable keys (one per prompt), got "
                         f"{sessions!r:.80}")
    return list(sessions)


def prompt_params(params: SamplingParams | list[SamplingParams], i: int) -> SamplingParams:
    """Prompt i's params from rollout_params' result."""
    return params[i] if isinstance(params, list) else params


def _flatten(stream: Iterator[Bucket], sizes: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """The buckets' items one by one, appending each bucket's byte size to `sizes`."""
    for bucket in stream:
        sizes.append(bucket_bytes_of(bucket))
        yield from bucket


def request_samples(out: RequestOutput) -> list[Sample]:
    """A finished request's samples, as a RolloutBatch takes them."""
    return [Sample(out.prompt_token_ids, c.token_ids, c.logprobs, c.log_kept_mass, c.finish_reason,
                   c.num_preemptions, out.weight_version, c.text, c.routed_experts, c.token_weight_versions)
            for c in out.outputs]


def batch_versions(batch: RolloutBatch) -> list[int]:
    """The weight versions that sampled a batch's tokens (its own when it has no token)."""
    versions = batch.token_weight_versions[batch.response_mask.bool()].unique().tolist()
    return versions or [batch.weight_version]


class Turns:
    """One engine, several threads: rollout steps take turns, and a weight sync (or pause) waiting for its
    turn goes before the next step, so that a sync from the trainer's thread lands between two steps of a
    stream instead of waiting for the stream to end."""

    def __init__(self):
        self._cond = threading.Condition()
        self._busy = False
        self._syncs_waiting = 0

    @contextlib.contextmanager
    def step(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._busy and not self._syncs_waiting)
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def sync(self):
        with self._cond:
            self._syncs_waiting += 1
            self._cond.wait_for(lambda: not self._busy)
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._syncs_waiting -= 1
                self._cond.notify_all()


class GroupRun:
    """Prompt groups on a RolloutEngine's engine: a request per new group (its n samples), one per resumed
    unfinished sample; whole groups come out of `step()` as they finish, `abort()` keeps the rest."""

    def __init__(self, rollouts: RolloutEngine, n: int):
        self.rollouts = rollouts
        self.engine = rollouts.engine
        self.book = GroupBook(n)
        self.ready: list[tuple[int, object, list[Sample]]] = []
        self._keys = itertools.count()

    @property
    def active(self) -> bool:
        """Whether a group is still running or finished but not yet returned by step()."""
        return bool(self.book.num_running or self.ready)

    def add(self, resume: list[PartialGroup], prompts: Sequence[Prompt],
            params: SamplingParams | list[SamplingParams]) -> None:
        """Queue resumed groups, then new prompts (params: one for all, or one per prompt without resume); a prompt
        the engine refuses aborts all of this call's."""
        added: list[str | None] = []
        keys: list[int] = []
        ready = len(self.ready)
        with self.rollouts.turns.step():
            try:
                for group in resume:
                    keys.append(key := next(self._keys))
                    self.book.open(key, group.prompt, [None if s.finish_reason == UNFINISHED else s
                                                       for s in group.samples])
                    for index, sample in enumerate(group.samples):
                        if sample.finish_reason == UNFINISHED:
                            added.append(self._continue(key, index, sample, params))
                    if (done := self.book.finished_now(key)) is not None:
                        self.ready.append(done)
                for i, prompt in enumerate(prompts):
                    keys.append(key := next(self._keys))
                    self.book.open(key, prompt)
                    mine = prompt_params(params, i)
                    added.append(self.engine.add_request(prompt, mine))
                    self.book.track(added[-1], Slot(key, list(range(mine.n)), [None] * mine.n))
            except ValueError:
                for request_id in filter(None, added):
                    self.engine.abort_request(request_id)
                self.book.drop(keys)
                del self.ready[ready:]
                raise

    def _continue(self, key: int, index: int, first: Sample, params: SamplingParams) -> str | None:
        more = continuation(params, first, index)
        if more is None:
            self.book.samples[key][index] = finished_at_length(first)
            return None
        request_id = self.engine.add_request(first.prompt_ids + first.token_ids, more)
        self.book.track(request_id, Slot(key, [index], [first]))
        return request_id

    def step(self) -> list[tuple[int, object, list[Sample]]]:
        """Run one engine step; the groups that finished, as (key, prompt, samples)."""
        done, self.ready = self.ready, []
        with self.rollouts.turns.step():
            for out in self.engine.step(finished_only=True):
                self.rollouts.finished[out.request_id] = out
            mine = [self.rollouts.finished.pop(r) for r in list(self.book.slots) if r in self.rollouts.finished]
        for out in mine:
            if (group := self.book.fill(out.request_id, request_samples(out))) is not None:
                done.append(group)
        return done

    def abort(self) -> list[tuple[int, PartialGroup]]:
        """Abort every request still running; the open groups with what they generated, by key."""
        with self.rollouts.turns.step():
            outs = [self.rollouts.finished.pop(r, None) or self.engine.abort_request(r) for r in list(self.book.slots)]
        for out in outs:
            self.book.fill(out.request_id, request_samples(out), close=False)
        return self.book.partial()
