"""RolloutBatch: rollouts as padded tensors ready for a policy-gradient loss."""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fp8engine.outputs import EngineStats


@dataclass(slots=True)
class Sample:
    """One generated sequence, as either adapter receives it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    log_kept_mass: list[float] | None
    finish_reason: str
    num_preemptions: int
    weight_version: int
    text: str = ""
    routed_experts: Tensor | None = None  # [positions fed, MoE layers, top_k] (return_routed_experts)
    token_weight_versions: list[int] | None = None  # per token; None: every token is weight_version's


@dataclass(slots=True)
class RolloutBatch:
    """B = num_prompts * n sequences, prompt-major (row i * n + j is sample j of prompt i).

    prompt_ids: [B, P] int64, left-padded with pad_token_id.
    response_ids: [B, R] int64, right-padded with pad_token_id.
    attention_mask: [B, P + R] int64, 1 on real prompt and response tokens.
    response_mask: [B, R] int64, 1 on real response tokens.
    rollout_logprobs: [B, R] float32, the engine's logprob of each response token in the
        requested mode (processed by default), 0 on padding.
    log_kept_mass: [B, R] float32 (processed mode), log of the probability mass kept by
        top-k/top-p/min-p per token, 0 on padding; None in raw mode.
    num_preemptions: [B] int64. weight_version: the newest weights any token came from.
    token_weight_versions: [B, R] int64, the weight version that sampled each response token, -1 on padding (a
        batch spans versions only when a sync ran with in_flight="keep" while it was generated).
    finish_reasons / response_texts: per sequence. n: samples per prompt.
    routed_experts: with SamplingParams(return_routed_experts=True) on a MoE model, int32
        [B, P + R, num_moe_layers, top_k] aligned with `input_ids`: column j holds the experts the engine
        routed the token at input_ids[:, j] to, for routing replay in the trainer; 0 on padding and on
        each response's last token (the engine never fed it). None otherwise.
    group_prompts: the prompt (as given) of each group of n rows, in row order: with min_groups or resume the
        rows follow the groups that finished (resumed ones first), not the prompts passed.
    partial: with rollout(..., min_groups=K), the groups stopped unfinished (fp8engine.rl.groups.PartialGroup,
        with their tokens, logprobs and versions so far), to pass as rollout(..., resume=batch.partial).
    rewards / num_turns: [B] float32 / int64 from rl.episodes.rollout_episodes (each episode's summed reward and
        its model turns; its response_ids then hold observation tokens too, with response_mask 0 on them);
        None for single-turn rollouts.
    stats: rollout statistics of this call (see `rollout_stats`).
    scorer: (prompts, responses, params) -> per-token logprobs from the engine that made the batch, with
        its weights and numerics (`response_logprobs(..., exact=True)`); None where there is none (HTTP).
    """

    prompt_ids: Tensor
    response_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    log_kept_mass: Tensor | None
    num_preemptions: Tensor
    weight_version: int
    finish_reasons: list[str]
    response_texts: list[str]
    n: int
    pad_token_id: int
    routed_experts: Tensor | None = None
    token_weight_versions: Tensor | None = None
    group_prompts: list = field(default_factory=list)
    partial: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    scorer: Callable | None = field(default=None, repr=False, compare=False)
    rewards: Tensor | None = None
    num_turns: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> Tensor:
        """[B, P + R] prompt and response side by side."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def position_ids(self) -> Tensor:
        """[B, P + R] positions that skip the left padding (what the engine used)."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def prompts_and_responses(self) -> tuple[list[list[int]], list[list[int]]]:
        """Each row's prompt and response token ids (an episode's observation tokens included), without padding."""
        width = self.prompt_ids.shape[1]
        prompt_mask, response_mask = self.attention_mask[:, :width].bool(), self.attention_mask[:, width:].bool()
        return ([row[m].tolist() for row, m in zip(self.prompt_ids, prompt_mask)],
                [row[m].tolist() for row, m in zip(self.response_ids, response_mask)])

    @property
    def response_lengths(self) -> Tensor:
        """[B] int64 number of generated tokens per sequence."""
        return self.response_mask.sum(-1)

    def select(self, rows: Sequence[int] | Tensor) -> "RolloutBatch":
        """The given rows (in that order) as a batch of their own, padding trimmed to the longest prompt and
        response among them: whole groups a trainer keeps (n and the groups' prompts stay), or micro-batches
        of any rows (n is then 1 and group_prompts holds each row's prompt). partial and stats are dropped;
        the scorer is kept (it scores the rows it is given)."""
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.batch_size):
            raise ValueError(f"select: rows must lie in [0, {self.batch_size}); got {rows.tolist()}")
        starts = rows[::self.n]
        whole = (rows.numel() % self.n == 0 and bool((starts % self.n == 0).all())
                 and torch.equal(rows, (starts[:, None] + torch.arange(self.n)).reshape(-1)))
        n = self.n if whole else 1
        prompts = ([self.group_prompts[r // self.n] for r in rows[::n].tolist()] if self.group_prompts else [])
        width = self.prompt_ids.shape[1]
        mask = self.attention_mask[rows]
        keep_p = int(mask[:, :width].sum(-1).max()) if rows.numel() else 0  # prompts are left-padded
        real_r = mask[:, width:].bool()
        keep_r = int((real_r * torch.arange(1, real_r.shape[1] + 1)).amax()) if real_r.numel() else 0
        columns = torch.cat([torch.arange(width - keep_p, width), torch.arange(width, width + keep_r)])

        def pick(t: Tensor | None, cols: Tensor | slice) -> Tensor | None:
            return None if t is None else t[rows][:, cols]

        return RolloutBatch(
            prompt_ids=pick(self.prompt_ids, slice(width - keep_p, width)),
            response_ids=pick(self.response_ids, slice(0, keep_r)), attention_mask=pick(self.attention_mask, columns),
            response_mask=pick(self.response_mask, slice(0, keep_r)),
            rollout_logprobs=pick(self.rollout_logprobs, slice(0, keep_r)),
            log_kept_mass=pick(self.log_kept_mass, slice(0, keep_r)), num_preemptions=self.num_preemptions[rows],
            weight_version=self.weight_version, finish_reasons=[self.finish_reasons[r] for r in rows.tolist()],
            response_texts=[self.response_texts[r] for r in rows.tolist()], n=n, pad_token_id=self.pad_token_id,
            routed_experts=pick(self.routed_experts, columns),
            token_weight_versions=pick(self.token_weight_versions, slice(0, keep_r)), group_prompts=prompts,
            scorer=self.scorer, rewards=None if self.rewards is None else self.rewards[rows],
            num_turns=None if self.num_turns is None else self.num_turns[rows])


def micro_batches(batch: RolloutBatch, max_tokens: int, rows: Sequence[int] | Tensor | None = None
                  ) -> Iterator[tuple[Tensor, RolloutBatch]]:
    """Split `rows` of `batch` (default: all) into micro-batches of similar length, longest first, each at
    most `max_tokens` padded prompt + response positions (a row longer than that goes alone): (rows, the
    batch's `select` of them). A trainer sums their losses (accumulating gradients) instead of padding every
    row to the longest response of the whole batch."""
    if max_tokens < 1:
        raise ValueError(f"micro_batches: max_tokens must be >= 1; got {max_tokens}")
    rows = torch.arange(batch.batch_size) if rows is None else torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
    width = batch.prompt_ids.shape[1]
    prompt_len = batch.attention_mask[:, :width].sum(-1)
    real_r = batch.attention_mask[:, width:].bool()
    response_len = (real_r * torch.arange(1, real_r.shape[1] + 1)).amax(-1) if real_r.shape[1] else prompt_len * 0
    order = rows[torch.argsort(response_len[rows], descending=True, stable=True)]
    chunk: list[int] = []
    longest_p = longest_r = 0
    for row in order.tolist():
        p, r = max(longest_p, int(prompt_len[row])), max(longest_r, int(response_len[row]))
        if chunk and (len(chunk) + 1) * (p + r) > max_tokens:
            yield torch.tensor(chunk), batch.select(chunk)
            chunk, p, r = [], int(prompt_len[row]), int(response_len[row])
        chunk.append(row)
        longest_p, longest_r = p, r
    if chunk:
        yield torch.tensor(chunk), batch.select(chunk)


def collate(samples: Sequence[Sample], n: int, pad_token_id: int) -> RolloutBatch:
    """Pad samples (already prompt-major) into a RolloutBatch; stats are left empty."""
    token_versions = [s.token_weight_versions if s.token_weight_versions is not None
                      else [s.weight_version] * len(s.token_ids) for s in samples]
    prompt_ids, prompt_mask = _pad([s.prompt_ids for s in samples], pad_token_id, left=True)
    response_ids, response_mask = _pad([s.token_ids for s in samples], pad_token_id, left=False)
    kept = [s.log_kept_mass for s in samples]
    return RolloutBatch(
        prompt_ids=prompt_ids, response_ids=response_ids,
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1), response_mask=response_mask,
        rollout_logprobs=pad_float([s.logprobs for s in samples], response_ids.shape[1]),
        log_kept_mass=None if None in kept else pad_float(kept, response_ids.shape[1]),
        num_preemptions=torch.tensor([s.num_preemptions for s in samples], dtype=torch.int64),
        weight_version=max(s.weight_version for s in samples), finish_reasons=[s.finish_reason for s in samples],
        response_texts=[s.text for s in samples], n=n, pad_token_id=pad_token_id,
        routed_experts=_pad_routed(samples, prompt_ids.shape[1], response_ids.shape[1]),
        token_weight_versions=_pad_ints(token_versions, response_ids.shape[1], -1))


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token, else its EOS token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def rollout_stats(batch: RolloutBatch, seconds: float, engine: EngineStats) -> dict:
    """Per-call rollout statistics: throughput (tokens/s over `seconds`), preemptions, KV state."""
    num_tokens = int(batch.response_mask.sum())
    preemptions = batch.num_preemptions.float()
    return {
        "seconds": seconds,
        "num_sequences": batch.batch_size,
        "num_tokens": num_tokens,
        "tokens_per_s": num_tokens / seconds if seconds > 0 else float("nan"),
        "preemptions_total": int(preemptions.sum()),
        "preemptions_mean": float(preemptions.mean()),
        "preemptions_max": int(preemptions.max()),
        "engine_preemptions_total": engine.num_preemptions_total,
        "kv_blocks_total": engine.num_kv_blocks_total,
        "kv_blocks_free": engine.num_kv_blocks_free,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "kv_scales": dict(engine.kv_scales),
        "prefix_cache_hit_rate": engine.prefix_cache_hit_rate,
    }


def _pad(rows: list[list[int]], pad: int, left: bool) -> tuple[Tensor, Tensor]:
    width = max(map(len, rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, cols] = torch.tensor(row, dtype=torch.int64)
        mask[i, cols] = 1
    return ids, mask


def _pad_routed(samples: Sequence[Sample], prompt_width: int, response_width: int) -> Tensor | None:
    """Each sample's routed experts placed under its tokens in the [P + R] input layout, 0 elsewhere."""
    routed = [s.routed_experts for s in samples]
    if not routed or any(r is None for r in routed):
        return None
    out = torch.zeros((len(samples), prompt_width + response_width, *routed[0].shape[1:]), dtype=torch.int32)
    for i, (sample, r) in enumerate(zip(samples, routed)):
        start = prompt_width - len(sample.prompt_ids)
        out[i, start:start + len(r)] = r
    return out


def _pad_ints(rows: list[list[int]], width: int, pad: int) -> Tensor:
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


def pad_float(rows: list[list[float]], width: int) -> Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """Several batches (e.g. the groups `stream` yields) as one, re-padded: prompts left, responses right.
    Their n and pad token must agree; weight_version is the newest; stats and scorer are dropped (the exact
    scorer replays one call's batch only)."""
    if not batches:
        raise ValueError("concat needs at least one batch")
    first = batches[0]
    for b in batches[1:]:
        if (b.n, b.pad_token_id) != (first.n, first.pad_token_id):
            raise ValueError(f"concat needs batches with one n and pad token; got n={b.n}, pad={b.pad_token_id} "
                             f"beside n={first.n}, pad={first.pad_token_id}")
    width_p = max(b.prompt_ids.shape[1] for b in batches)
    width_r = max(b.response_ids.shape[1] for b in batches)

    def cat(get, left: int | None, value):
        """get(b) [B, W, ...] padded to width_p (left=True) or width_r (left=False), then stacked."""
        parts = []
        for b in batches:
            t = get(b)
            extra = (width_p if left else width_r) - t.shape[1]
            pad = torch.full((t.shape[0], extra, *t.shape[2:]), value, dtype=t.dtype)
            parts.append(torch.cat([pad, t] if left else [t, pad], dim=1))
        return torch.cat(parts)

    def split(get, value):
        """A [B, P + R, ...] tensor: its prompt columns left-padded, its response columns right-padded."""
        prompt = cat(lambda b: get(b)[:, :b.prompt_ids.shape[1]], True, value)
        response = cat(lambda b: get(b)[:, b.prompt_ids.shape[1]:], False, value)
        return torch.cat([prompt, response], dim=1)

    kept = None if any(b.log_kept_mass is None for b in batches) else cat(lambda b: b.log_kept_mass, False, 0.0)
    routed = (None if any(b.routed_experts is None for b in batches)
              else split(lambda b: b.routed_experts, 0))
    versions = cat(lambda b: (b.token_weight_versions if b.token_weight_versions is not None
                              else torch.where(b.response_mask.bool(), b.weight_version, -1)), False, -1)
    return RolloutBatch(
        prompt_ids=cat(lambda b: b.prompt_ids, True, first.pad_token_id),
        response_ids=cat(lambda b: b.response_ids, False, first.pad_token_id),
        attention_mask=split(lambda b: b.attention_mask, 0), response_mask=cat(lambda b: b.response_mask, False, 0),
        rollout_logprobs=cat(lambda b: b.rollout_logprobs, False, 0.0), log_kept_mass=kept,
        num_preemptions=torch.cat([b.num_preemptions for b in batches]),
        weight_version=max(b.weight_version for b in batches),
        finish_reasons=[r for b in batches for r in b.finish_reasons],
        response_texts=[t for b in batches for t in b.response_texts], n=first.n, pad_token_id=first.pad_token_id,
        routed_experts=routed, token_weight_versions=versions,
        group_prompts=[p for b in batches for p in b.group_prompts], partial=[g for b in batches for g in b.partial])
