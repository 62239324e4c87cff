"""Requests, their sequences (one per sample: the unit the scheduler moves forward) and a sequence's share of
one step. The scheduler, the block manager, the model runner and the output processor all read these; none of
them imports another for it."""

import itertools
from dataclasses import dataclass
from enum import Enum, auto

from fp8engine.detokenizer import DetokState
from fp8engine.sampling_params import SamplingParams


# A sequence's last token while the device has drawn it and the host has not read it yet (LLMEngine's
# async_scheduling): the output processor puts the token in its place a step later.
PLACEHOLDER = -1


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Request:
    """A prompt with its sampling params; its n samples start as one sequence and fork after prefill.

    seed: params.seed, or the one the engine drew for it; sample i's noise at position p is
    a function of (seed, i, p) alone.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 weight_version: int, prompt: str | None = None, seed: int = 0):
        self.request_id = request_id
        self.seed = seed
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.weight_version = weight_version
        self.seqs: list[Sequence] = []
        self.prompt_logprobs: list[float | None] | None = None
        self.partial_prompt_logprobs: list[float | None] = []
        self.prompt_top_logprobs: list[dict[int, float] | None] | None = None
        self.partial_prompt_top_logprobs: list[dict[int, float] | None] = []
        self.num_cached_tokens = 0
        self.aborted = False
        self.scoring: Scoring | None = None
        self.grammar = None  # structured output (structured.Grammar): each sample gets a matcher of it

    @property
    def finished(self) -> bool:
        done = all(s.is_finished for s in self.seqs)
        return done and (self.aborted or len(self.seqs) == self.params.n)


class Scoring:
    """A teacher-forced request (LLMEngine.score): its prompt is prompt + response[:-1], and the row at
    position j scores response[j + 1 - prompt_len] as the sampler would have reported it under `params`."""

    def __init__(self, params: SamplingParams, prompt_len: int, response: list[int], grammar=None):
        self.params = params
        self.prompt_len = prompt_len
        self.response = list(response)
        self.logprobs: list[float] = []
        self.grammar = grammar  # params' structured output (structured.Grammar), which the response follows
        self.matcher = None  # where the scored rows are in it


class Sequence:
    _ids = itertools.count()

    def __init__(self, request: Request, index: int, token_ids: list[int]):
        self.seq_id = next(Sequence._ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []  # written by the block manager
        self.num_hashed_blocks = 0
        self.state_slot: int | None = None  # hybrid models: the state pool's slot (written by the block manager)
        self.state_restore: int | None = None  # ... the snapshot a prefix hit starts it from
        # ... a verification step's (first draft position, drafts): where its state rolls back to
        self.draft_span: tuple[int, int] | None = None
        self.block_hashes: list[int] = []  # chained hashes of full blocks, memoised by the block manager
        self.status = SeqStatus.WAITING
        self.num_preemptions = 0
        self.num_kv_recomputes = 0
        self.token_weight_versions: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.log_kept_mass: list[float] = []
        self.num_draft_tokens = 0  # speculative decoding: draft tokens verified for this sample
        self.num_accepted_tokens = 0  # ... and of those, the ones equal to the sample drawn there
        self.draft_state = None  # the speculator's per-sequence state (spec/drafter.py)
        self.matcher = request.grammar.matcher() if request.grammar is not None else None  # at the sample's end
        self.routed_experts = None  # captured when the sequence finishes (its blocks are freed then)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text = ""
        self.detok = DetokState()

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.request.prompt_logprobs is None

    def block_tokens(self, i: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[i * block_size:(i + 1) * block_size])

    def fork(self, index: int) -> "Sequence":
        child = Sequence(self.request, index, list(self.token_ids))
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.block_hashes = list(self.block_hashes)
        child.token_weight_versions = list(self.token_weight_versions)
        return child


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: its next num_new_tokens tokens are computed, then its draft tokens (a
    decode with speculative decoding): the step samples a token after each of them too."""

    seq: Sequence
    num_new_tokens: int
    draft: tuple[int, ...] = ()
    snapshots: tuple[tuple[int, int], ...] = ()  # hybrid models: (after how many new tokens, snapshot slot) each

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens
