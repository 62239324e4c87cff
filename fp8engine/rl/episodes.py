"""Multi-turn episodes: rollouts in which an environment answers each model turn, kept as exact token histories.

    class Calculator:
        tools = [...]                                   # optional: OpenAI tool specs, rendered with the first turn
        def reset(self, prompt): return [{"role": "user", "content": prompt}]      # messages or token ids
        def step(self, turn): return observation, reward, done                    # see Turn, below
    batch = rollout_episodes(rollouts, Calculator, prompts, n=8, sampling_params=params, max_turns=4)

Each episode's history is the token ids the model saw: the first prompt rendered once (with the environment's
tools), then for every turn the tokens sampled and the observation's tokens appended (tools.continuation_ids
renders only the new messages). Earlier turns are never rendered or tokenized again, so the trainer scores exactly
what was sampled from. Every turn of every live episode goes to the engine in one rollout call, with the episode
as its session (a RolloutCluster keeps it on one replica, where its history is in the prefix cache).
"""

import dataclasses
import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fp8engine.rl.batch import RolloutBatch, Sample, collate, pad_float
from fp8engine.rl.rollout import batch_versions
from fp8engine.sampling_params import SamplingParams
from fp8engine.tools import ToolCall, continuation_ids, default_parser, parse, render_ids

OBSERVATION_VERSION = -1  # token_weight_versions of observation tokens: no weights sampled them


@dataclass(slots=True)
class Turn:
    """One model turn as the environment receives it: text (decoded), content (the text without tool calls),
    tool_calls (parsed by the model family's parser, tools.py), token_ids, finish_reason, turn (0, 1, ...)."""

    text: str
    content: str
    tool_calls: list[ToolCall]
    token_ids: list[int]
    finish_reason: str
    turn: int


@dataclass(slots=True)
class _Episode:
    env: object
    group: int
    index: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # after the prompt: model turns and observations
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[float] | None = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    replicas: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    done: bool = False

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def add(self, sample: Sample) -> None:
        self.tokens += sample.token_ids
        self.mask += [1] * len(sample.token_ids)
        self.logprobs += sample.logprobs
        self.kept = None if self.kept is None or sample.log_kept_mass is None else self.kept + sample.log_kept_mass
        self.versions += sample.token_weight_versions or [sample.weight_version] * len(sample.token_ids)
        self.num_preemptions += sample.num_preemptions
        self.finish_reason = sample.finish_reason

    def observe(self, token_ids: list[int]) -> None:
        self.tokens += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.kept = None if self.kept is None else self.kept + [0.0] * len(token_ids)
        self.versions += [OBSERVATION_VERSION] * len(token_ids)


def rollout_episodes(rollouts, env_factory: Callable[[], object], prompts: Sequence, n: int = 1,
                     sampling_params: SamplingParams | Callable[[int], SamplingParams] | None = None,
                     max_turns: int = 4, *,
                     tool_call_parser: str | None = None) -> RolloutBatch:
    """Run n episodes per prompt for at most max_turns model turns each; a RolloutBatch of B = len(prompts) * n
    rows, prompt-major.

    rollouts: a RolloutEngine, RolloutClient or RolloutCluster. env_factory() makes one environment per episode:
    env.reset(prompt) -> chat messages (rendered with env.tools, if it has them) or token ids; env.step(turn: Turn)
    -> (observation, reward, done), the observation being new chat messages (a tool result: {"role": "tool",
    "tool_call_id": ..., "content": ...}), token ids appended as they are, or None when done. sampling_params
    applies to each turn (max_tokens per turn), or is a function of the turn (0, 1, ...) giving its params (e.g.
    a forced call on the first turn: SamplingParams(grammar=tools.forced_call_grammar(...))); each episode and
    turn draws its own noise (a seed derived from the params' seed, or a random one).

    In the batch, response_ids hold everything after the prompt (model turns and observations); response_mask
    is 1 on model tokens and 0 on observations, as are rollout_logprobs and log_kept_mass (0 there);
    token_weight_versions is -1 on observations; rewards [B] sums each episode's step rewards and num_turns [B]
    counts its model turns. From a RolloutEngine, batch.scorer replays it (response_logprobs(..., exact=True),
    observations as context): bitwise the sampled logprobs with batch_invariant=True when every turn had the same
    params, without penalties or min_tokens (which would count the observations as output). stats: per turn the
    prompt tokens sent (whole histories) and the prefill tokens the engine computed (the rest came from its
    prefix cache), model and observation tokens, episodes cut by the context, and with a RolloutCluster the
    replica of each episode's turns.
    """
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    params_of = sampling_params if callable(sampling_params) else lambda turn: sampling_params or SamplingParams()
    tokenizer = rollouts.tokenizer
    parser = tool_call_parser or default_parser(tokenizer)
    random_seed = int(torch.randint(0, 2**62, (1,)))
    episodes = [_start(env_factory(), tokenizer, prompt, g, j) for g, prompt in enumerate(prompts) for j in range(n)]
    limit = getattr(rollouts, "max_model_len", None)
    stats = {"num_model_calls": 0, "num_cut_by_context": 0, "prompt_tokens_by_turn": [], "prefill_tokens_by_turn": []}
    run = uuid.uuid4().hex
    for turn in range(max_turns):
        live = [e for e in episodes if not e.done and _fits(e, limit, stats)]
        if not live:
            break
        params = params_of(turn)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params({turn}) must return SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params, n=1)
        seed = random_seed if params.seed is None else params.seed
        computed = rollouts.get_stats().num_prompt_tokens_total
        batch = rollouts.rollout([e.history for e in live], n=1, sessions=[(run, e.group, e.index) for e in live],
                                 sampling_params=[_turn_params(params, seed, e, turn, limit) for e in live])
        stats["num_model_calls"] += 1
        stats["prompt_tokens_by_turn"].append(sum(len(e.history) for e in live))
        stats["prefill_tokens_by_turn"].append(rollouts.get_stats().num_prompt_tokens_total - computed)
        if "replica_of_prompt" in batch.stats:  # a RolloutCluster: where each episode's turn ran
            for episode, replica in zip(live, batch.stats["replica_of_prompt"]):
                episode.replicas.append(replica)
        end_ids = {tokenizer.eos_token_id} | set(params.stop_token_ids)
        for episode, sample in zip(live, _samples(batch)):
            _advance(episode, sample, turn, tokenizer, parser, end_ids, last=turn == max_turns - 1)
    batch = _batch(episodes, n, rollouts.pad_token_id, stats)
    if getattr(rollouts, "engine", None) is not None:  # in process: response_logprobs(..., exact=True) replays it
        batch.scorer = functools.partial(rollouts._score, batch_versions(batch))
    return batch


def _start(env, tokenizer, prompt, group: int, index: int) -> _Episode:
    first = env.reset(prompt)
    if isinstance(first, list) and first and all(isinstance(m, dict) for m in first):
        ids = render_ids(tokenizer, first, getattr(env, "tools", None))
    elif isinstance(first, list) and first and all(isinstance(t, int) for t in first):
        ids = list(first)
    else:
        raise ValueError(f"env.reset must return chat messages or token ids, got {first!r:.80}")
    return _Episode(env, group, index, ids)


def _fits(episode: _Episode, limit: int | None, stats: dict) -> bool:
    if limit is None or len(episode.history) < limit:
        return True
    episode.done, episode.finish_reason = True, "length"
    stats["num_cut_by_context"] += 1
    return False


def _turn_params(params: SamplingParams, base_seed: int, episode: _Episode, turn: int,
                 limit: int | None) -> SamplingParams:
    """The episode's params this turn: its own seed, max_tokens cut to what the context has left."""
    seed = (base_seed * 1_000_003 + 7919 * (episode.group * 65_537 + episode.index + 1) + 104_729 * turn) % (1 << 62)
    room = params.max_tokens if limit is None else min(params.max_tokens, limit - len(episode.history))
    return dataclasses.replace(params, seed=seed, max_tokens=room, min_tokens=min(params.min_tokens, room))


def _samples(batch: RolloutBatch) -> list[Sample]:
    prompts, responses = batch.prompts_and_responses()
    rows = []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        width = len(response)
        kept = None if batch.log_kept_mass is None else batch.log_kept_mass[i, :width].tolist()
        rows.append(Sample(prompt, response, batch.rollout_logprobs[i, :width].tolist(), kept,
                           batch.finish_reasons[i], int(batch.num_preemptions[i]), batch.weight_version,
                           batch.response_texts[i], None, batch.token_weight_versions[i, :width].tolist()))
    return rows


def _advance(episode: _Episode, sample: Sample, turn: int, tokenizer, parser: str, end_ids: set[int],
             last: bool) -> None:
    episode.add(sample)
    text = sample.text or tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    content, calls = parse(parser, text)
    observation, reward, done = episode.env.step(Turn(text, content, calls, sample.token_ids, sample.finish_reason,
                                                      turn))
    episode.rewards.append(float(reward))
    if done or last or not observation:
        episode.done = True
        return
    if all(isinstance(m, dict) for m in observation):
        episode.observe(continuation_ids(tokenizer, episode.history, list(observation), end_ids))
    elif all(isinstance(t, int) for t in observation):
        episode.observe(list(observation))
    else:
        raise ValueError(f"env.step must return new chat messages or token ids as its observation, got "
                         f"{observation!r:.80}")


def _batch(episodes: list[_Episode], n: int, pad_token_id: int, stats: dict) -> RolloutBatch:
    samples = [Sample(e.prompt_ids, e.tokens, e.logprobs, e.kept, e.finish_reason, e.num_preemptions,
                      max([v for v in e.versions if v >= 0], default=0), "", None, e.versions) for e in episodes]
    batch = collate(samples, n, pad_token_id)
    width = batch.response_ids.shape[1]
    batch.response_mask = pad_float([e.mask for e in episodes], width).to(torch.int64)
    batch.rewards = torch.tensor([sum(e.rewards) for e in episodes], dtype=torch.float32)
    batch.num_turns = torch.tensor([len(e.rewards) for e in episodes], dtype=torch.int64)
    batch.response_texts = [""] * len(episodes)
    model_tokens = int(batch.response_mask.sum())
    batch.stats = stats | {"num_episodes": len(episodes), "model_tokens": model_tokens,
                           "replicas_of_episode": [e.replicas for e in episodes],
                           "observation_tokens": int(batch.attention_mask[:, -width:].sum()) - model_tokens
                           if width else 0, "mean_turns": float(batch.num_turns.float().mean())}
    return batch
