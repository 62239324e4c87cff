"""Prompt groups that finish as a whole: partial rollouts, over-sampling and streaming.

A prompt group is one prompt's n samples (GRPO's group). `rollout(..., min_groups=K)` returns once K
groups finished and keeps the others, aborted with what they generated, as `PartialGroup`s in
`batch.partial`; `rollout(..., resume=batch.partial)` continues their unfinished samples first: each
continues as its own request whose prompt is prompt + tokens so far (the prefix cache serves the blocks
it already computed unless a weight sync flushed them), with max_tokens and min_tokens reduced by what
it has, and is stitched back onto its first part (token ids, logprobs, log_kept_mass and weight
versions kept). The first part's stop strings are not looked for across the seam, and presence /
frequency penalties count only the continuation's own tokens.
"""

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fp8engine.rl.batch import RolloutBatch, Sample, collate
from fp8engine.sampling_params import SamplingParams

MinGroups = int | Callable[[list[RolloutBatch]], bool] | None
UNFINISHED = "abort"  # a PartialGroup sample with this finish_reason is continued on resume


@dataclass(slots=True)
class PartialGroup:
    """A prompt group stopped before it finished: its n samples in sample order, each with what it
    generated; those with finish_reason "abort" are continued by `rollout(..., resume=[...])`.

    prompt: the prompt as the caller gave it (str, token ids or chat messages).
    """

    prompt: object
    samples: list[Sample]

    @property
    def num_unfinished(self) -> int:
        return sum(s.finish_reason == UNFINISHED for s in self.samples)


@dataclass(slots=True)
class Slot:
    """Where a request's samples go: its group's key, the sample indices it fills, and the first
    part of each (None for a sample that starts from its prompt)."""

    key: int
    indices: list[int]
    firsts: list[Sample | None]


class GroupBook:
    """Which request fills which samples of which group; whole groups come out as they finish.

    Both adapters keep one: RolloutEngine for its engine's requests, RolloutClient for its HTTP streams.
    """

    def __init__(self, n: int):
        self.n = n
        self.prompts: dict[int, object] = {}
        self.samples: dict[int, list[Sample | None]] = {}
        self.slots: dict[str, Slot] = {}

    @property
    def num_running(self) -> int:
        return len(self.samples)

    def open(self, key: int, prompt, samples: list[Sample | None] | None = None) -> None:
        self.prompts[key] = prompt
        self.samples[key] = list(samples) if samples is not None else [None] * self.n

    def track(self, request_id: str, slot: Slot) -> None:
        self.slots[request_id] = slot

    def fill(self, request_id: str, samples: list[Sample], close: bool = True
             ) -> tuple[int, object, list[Sample]] | None:
        """Put a finished (or aborted) request's samples in place; (key, prompt, samples) when that completes
        its group, which is then closed (close=False: left open, for `partial`)."""
        slot = self.slots.pop(request_id)
        group = self.samples[slot.key]
        if 0 < len(samples) < len(slot.indices):  # aborted before its samples forked off the first one
            samples = samples + [unstarted(samples[0])] * (len(slot.indices) - len(samples))
        for index, first, sample in zip(slot.indices, slot.firsts, samples, strict=True):
            group[index] = sample if first is None else stitch(first, sample)
        if not close or any(s is None for s in group) or any(s.key == slot.key for s in self.slots.values()):
            return None
        del self.samples[slot.key]
        return slot.key, self.prompts.pop(slot.key), group

    def finished_now(self, key: int) -> tuple[int, object, list[Sample]] | None:
        """A group with nothing left to run (a resumed group whose samples had all finished)."""
        if any(s.key == key for s in self.slots.values()) or any(s is None for s in self.samples[key]):
            return None
        return key, self.prompts.pop(key), self.samples.pop(key)

    def drop(self, keys: Sequence[int]) -> None:
        """Forget groups (and their requests) opened by a call that failed."""
        for request_id in [r for r, slot in self.slots.items() if slot.key in keys]:
            del self.slots[request_id]
        for key in keys:
            self.prompts.pop(key, None)
            self.samples.pop(key, None)

    def partial(self) -> list[tuple[int, PartialGroup]]:
        """The groups still open, by key, once every request was aborted and filled."""
        assert not self.slots, "abort and fill every request first"
        out = [(key, PartialGroup(self.prompts[key], samples)) for key, samples in sorted(self.samples.items())]
        self.prompts.clear()
        self.samples.clear()
        return out


def unstarted(sample: Sample) -> Sample:
    """A sample of the same prompt that generated nothing (aborted before it started)."""
    return dataclasses.replace(sample, token_ids=[], logprobs=[], log_kept_mass=None if sample.log_kept_mass is None
                               else [], finish_reason=UNFINISHED, text="", routed_experts=None,
                               token_weight_versions=[])


def stitch(first: Sample, second: Sample) -> Sample:
    """A resumed sample: its first part followed by its continuation (whose prompt held the first part)."""
    kept = None if first.log_kept_mass is None or second.log_kept_mass is None \
        else first.log_kept_mass + second.log_kept_mass
    return Sample(first.prompt_ids, first.token_ids + second.token_ids, first.logprobs + second.logprobs, kept,
                  second.finish_reason, first.num_preemptions + second.num_preemptions, second.weight_version,
                  first.text + second.text, second.routed_experts,
                  _versions(first) + _versions(second))


def _versions(sample: Sample) -> list[int]:
    return list(sample.token_weight_versions) if sample.token_weight_versions is not None \
        else [sample.weight_version] * len(sample.token_ids)


def continuation(params: SamplingParams, first: Sample, index: int) -> SamplingParams | None:
    """The params that continue `first` (sample `index` of its group) as a one-sample request; None when
    it already has max_tokens tokens."""
    remaining = params.max_tokens - len(first.token_ids)
    if remaining <= 0:
        return None
    seed = None if params.seed is None else (params.seed * 1_000_003 + 7919 * (index + 1)
                                             + len(first.token_ids)) % (1 << 62)
    return dataclasses.replace(params, n=1, max_tokens=remaining, seed=seed,
                               min_tokens=max(0, params.min_tokens - len(first.token_ids)))


def finished_at_length(first: Sample) -> Sample:
    return dataclasses.replace(first, finish_reason="length")


def check_min_groups(min_groups: MinGroups, num_groups: int) -> None:
    if min_groups is None or callable(min_groups):
        return
    if not isinstance(min_groups, int) or isinstance(min_groups, bool) or not 1 <= min_groups <= num_groups:
        raise ValueError(f"min_groups must be None, a callable or an integer in [1, {num_groups}] (the number "
                         f"of prompt groups, resumed ones included), got {min_groups!r}")


def check_resume(resume: Sequence[PartialGroup] | None, n: int) -> list[PartialGroup]:
    if resume is None:
        return []
    if isinstance(resume, PartialGroup) or not isinstance(resume, Sequence):
        raise ValueError(f"resume must be a list of PartialGroup (a batch's .partial), got {type(resume).__name__}")
    for i, group in enumerate(resume):
        if not isinstance(group, PartialGroup):
            raise ValueError(f"resume[{i}] is a {type(group).__name__}, not a PartialGroup")
        if len(group.samples) != n:
            raise ValueError(f"resume[{i}] has {len(group.samples)} samples but n={n}; resume with the n it ran with")
    return list(resume)


def enough(min_groups: MinGroups, finished: list[RolloutBatch]) -> bool:
    """Whether the finished groups satisfy min_groups (None: never, every group runs to the end)."""
    if min_groups is None:
        return False
    if callable(min_groups):
        return bool(min_groups(finished))
    return len(finished) >= min_groups


def group_batch(samples: list[Sample], n: int, pad_token_id: int, prompt) -> RolloutBatch:
    batch = collate(samples, n, pad_token_id)
    batch.group_prompts = [prompt]
    return batch


def gather(groups: list[tuple[int, object, list[Sample]]], n: int, pad_token_id: int,
           partial: list[tuple[int, PartialGroup]], weight_version: int) -> RolloutBatch:
    """The finished groups in key order (resumed ones first, then the new prompts in order) as one batch."""
    groups = sorted(groups, key=lambda g: g[0])
    if groups:
        batch = collate([s for _, _, samples in groups for s in samples], n, pad_token_id)
    else:
        batch = empty_batch(n, pad_token_id, weight_version)
    batch.group_prompts = [prompt for _, prompt, _ in groups]
    batch.partial = [group for _, group in partial]
    return batch


def empty_batch(n: int, pad_token_id: int, weight_version: int) -> RolloutBatch:
    """A batch of no group (a min_groups predicate satisfied before any finished)."""
    zeros = torch.zeros((0, 0), dtype=torch.int64)
    return RolloutBatch(zeros, zeros, zeros, zeros, torch.zeros((0, 0)), None, torch.zeros(0, dtype=torch.int64),
                        weight_version, [], [], n, pad_token_id, token_weight_versions=zeros)
