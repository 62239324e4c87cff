"""Draft tokens from token histories: the sequence's own prompt and tokens ("ngram", prompt lookup), and with
"suffix" also its prompt group's other samples and earlier rollouts of the same prompt.

A TokenIndex maps every n-gram (n = 1..MAX_NGRAM) of a set of token lists to where it last ended; a draft is the
continuation after the longest n-gram that ends the sequence, looked up in O(MAX_NGRAM) dict reads and kept up to
date as tokens arrive (each new token adds MAX_NGRAM entries). "ngram" gives each sequence an index of its own;
"suffix" gives each prompt one, shared by every sequence of that prompt, live or finished, bounded in tokens
(per prompt, the older half of its lists dropped past MAX_INDEX_TOKENS; over all prompts, the least recently
drafted prompts dropped past MAX_REMEMBERED_TOKENS or MAX_PROMPTS), and forgotten on a weight update when the
engine is configured so.

Drafts only propose: the output processor accepts a draft token when it equals the target's own sample at its
position, so a draft source changes how many tokens a step emits, never which.

The Speculator extends a step's decode items with drafts where the step has room (tokens left in the step's
budget, KV slots in blocks that are free and hold no prefix-cache content: a draft never preempts, never evicts
a cached block) and where they pay: a draft row costs compute whether or not it is accepted, and the rule that
weighs the two (Speculator) learns both the step's cost and each sequence's acceptance as it runs.
"""

from collections import OrderedDict
from collections.abc import Callable

from fp8engine.config import SPECULATIVE
from fp8engine.request import ScheduledSeq, Sequence

MAX_NGRAM = 3
# "suffix" remembers rollouts within these bounds (an indexed token costs ~400 bytes: MAX_NGRAM dict entries)
MAX_INDEX_TOKENS = 1 << 15  # per prompt
MAX_REMEMBERED_TOKENS = 1 << 18  # over all prompts (~100 MB); the least recently drafted prompts go first
MAX_PROMPTS = 256
# The cost rule (Speculator): rho before the step-time fit has data, measured on a 2-core AVX-512 CPU with the
# default model (a decode step: ~6 ms of weights, ~0.6 ms a row; docs/speculative.md), and its bounds.
PRIOR_RHO = {"cpu": 10.0, "cuda": 256.0}  # the fit stays within a factor RHO_RANGE of it: timings are noisy
RHO_RANGE = 4.0
# Past this many decodes in a step a draft token must be nearly sure (chance >= LARGE_BATCH_CHANCE) and nothing
# probes: at 32 sequences drafts accepted at 16-27% cost 10-27% of throughput (bench --workload grpo, 4 x 8)
LARGE_BATCH, LARGE_BATCH_CHANCE = 16, 0.8
STEP_DECAY = 0.98  # forgetting of the step-time fit, per decode step
PRIOR_WEIGHT = 2.0  # pseudo-tokens of the n-gram length's engine-wide rate in a sequence's acceptance estimate
SEQ_DECAY, NGRAM_DECAY = 0.8, 0.99  # forgetting of the acceptance counts, per verification
PROBE_EVERY = 16  # decode steps without a draft after which a sequence drafts one token anyway ...
# ... where a draft token needs an acceptance chance of at most this (a compute-bound step pays for a probe's row
# in whole GEMM tiles: 4 probe rows on 128 decodes cost 5-12% of the step, measured)
MAX_PROBE_THETA = 0.5
MAX_THETA = 0.95  # past this chance no sequence drafts at all (the lookups are skipped)


class TokenIndex:
    """{n-gram: (list number, end position)} of the latest occurrence of each n-gram in a set of token lists.

    A list is indexed up to its second-to-last token, so the n-gram that ends a list is never found at its own
    end: the hit always has a continuation."""

    __slots__ = ("ends", "lists", "done", "num_tokens", "alive")

    def __init__(self):
        self.ends: dict[tuple[int, ...], int] = {}  # list number << 32 | end position
        self.lists: list[list[int]] = []
        self.done: list[int] = []
        self.num_tokens = 0
        self.alive = True  # False once forgotten or rebuilt: its sequences re-register

    def add(self, tokens: list[int], start: int = 0) -> int:
        """Track `tokens` (the list itself: it may grow), indexing n-grams that end at or after `start`."""
        self.lists.append(tokens)
        self.done.append(start)
        return len(self.lists) - 1

    def update(self, i: int) -> None:
        tokens, ends = self.lists[i], self.ends
        last = len(tokens) - 1
        for end in range(self.done[i], last):
            for n in range(1, min(MAX_NGRAM, end + 1) + 1):
                ends[tuple(tokens[end - n + 1:end + 1])] = i << 32 | end
        if last > self.done[i]:
            self.num_tokens += last - self.done[i]
            self.done[i] = last

    def draft(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest n-gram ending `tokens` (most recent occurrence), and n; or
        ([], 0)."""
        for n in range(min(MAX_NGRAM, len(tokens)), 0, -1):
            hit = self.ends.get(tuple(tokens[-n:]))
            if hit is not None:
                i, end = hit >> 32, hit & 0xFFFFFFFF
                return self.lists[i][end + 1:end + 1 + k], n
        return [], 0


class SeqDrafts:
    """A sequence's drafting state: its index (own or its prompt's) and its list there; its decayed counts of
    draft tokens accepted and rejected (the first mismatch of a verification), the n-gram length of its last
    draft, and the decode steps since it last drafted."""

    __slots__ = ("index", "slot", "accepted", "rejected", "ngram", "idle")

    def __init__(self, index: TokenIndex, slot: int, accepted: float = 0.0, rejected: float = 0.0, ngram: int = 1,
                 idle: int = 0):
        self.index, self.slot, self.accepted, self.rejected, self.ngram, self.idle = (index, slot, accepted,
                                                                                     rejected, ngram, idle)


class StepCost:
    """Seconds of a decode step as W + c * rows, fit online by least squares with exponential forgetting; `rho`
    = W / c is the row count at which the rows' compute costs what streaming the weights does (the device's prior
    until the fit has steps of more than one row count, and within a factor RHO_RANGE of it after)."""

    def __init__(self, prior_rho: float):
        self.prior_rho = prior_rho
        self.sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows*seconds

    def record(self, rows: int, seconds: float) -> None:
        w, x, y, xx, xy = (v * STEP_DECAY for v in self.sums)
        self.sums = [w + 1, x + rows, y + seconds, xx + rows * rows, xy + rows * seconds]

    @property
    def rho(self) -> float:
        w, x, y, xx, xy = self.sums
        var = w * xx - x * x
        low, high = self.prior_rho / RHO_RANGE, self.prior_rho * RHO_RANGE
        if w < 8 or var <= 1e-9 * w * w:
            return self.prior_rho
        c = (w * xy - x * y) / var
        intercept = (y - c * x) / w
        if c <= 0 or intercept <= 0:
            return high if c <= 0 else low
        return min(high, max(low, intercept / c))


class Speculator:
    """Proposes drafts for a step (`propose`), learns what they are worth (`observe`, `record_step`).

    Cost rule: a step of `rows` rows that emits one token for each of its B decodes costs W + c * rows; a draft
    token adds a row (c) and, accepted, a token worth (W + c * rows) / B. It pays when the chance it is accepted
    exceeds theta = B / (rho + rows) (rho = W / c, StepCost). The chance of the j-th token of a draft is
    estimated as p**j, p from the sequence's own counts with its n-gram length's engine-wide rate as the prior,
    so a draft is as long as p**j >= theta allows (at most num_speculative_tokens). Memory-bound steps (rows
    well under rho) draft freely; compute-bound ones (rows near or past rho, large batches, prefill chunks) draft
    only what is nearly sure, or nothing; past LARGE_BATCH decodes a draft token needs a chance of at least
    LARGE_BATCH_CHANCE whatever the fit says (measured: there a rejected row costs a whole GEMM tile). A sequence
    that has not drafted for PROBE_EVERY steps drafts one token, so its estimate can recover, in steps where
    theta <= MAX_PROBE_THETA.

    source(seq, k) -> draft, when given, replaces the lookup and the rule (tests: a source proposing garbage,
    or the right tokens)."""

    def __init__(self, method: str, num_speculative_tokens: int, max_model_len: int, device: str = "cpu",
                 source: Callable[[Sequence, int], list[int]] | None = None):
        if method not in SPECULATIVE[1:]:
            raise ValueError(f"speculative must be one of {list(SPECULATIVE)}, got {method!r}")
        self.method = method
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.source = source
        self.prompts: OrderedDict[tuple[int, ...], TokenIndex] = OrderedDict()
        self.cost = StepCost(PRIOR_RHO.get(device, PRIOR_RHO["cpu"]))
        self.by_ngram = [[1.0, 1.0] for _ in range(MAX_NGRAM + 1)]  # decayed [accepted, rejected] by n

    # ------------------------------------------------------------------ drafting
    def propose(self, scheduled: list[ScheduledSeq], budget: int, extend) -> None:
        """Give the step's decode items drafts. budget: the step's token budget (max_num_batched_tokens);
        extend(item, draft) cuts the draft to the KV room the scheduler finds and sets item.draft."""
        rows = sum(item.num_new_tokens for item in scheduled)
        room = budget - rows
        decodes = sum(item.samples for item in scheduled)
        theta = decodes / (self.cost.rho + rows)
        if decodes > LARGE_BATCH:
            theta = max(theta, LARGE_BATCH_CHANCE)
        if room <= 0 or (theta > MAX_THETA and self.source is None):  # no room, or nothing is that sure
            return
        wanted = [item for item in scheduled if _can_speculate(item)]
        for i, item in enumerate(wanted):  # the room shared evenly, what one leaves going to the next
            seq = item.seq
            allowed = min(self.k, room // (len(wanted) - i), seq.params.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens)  # k drafts emit <= k + 1 tokens; last at N + k - 1
            if allowed <= 0:
                continue
            draft = self.source(seq, allowed) if self.source is not None else self._draft(seq, allowed, theta)
            if draft:
                extend(item, draft[:allowed])
                room -= len(item.draft)

    def _draft(self, seq: Sequence, allowed: int, theta: float) -> list[int]:
        state = self._state(seq)
        draft, n = self._lookup(state, seq)
        if not draft:
            return []
        hits, misses = self.by_ngram[n]
        p = (state.accepted + PRIOR_WEIGHT * hits / (hits + misses)) / (state.accepted + state.rejected + PRIOR_WEIGHT)
        length, chance = 0, p
        while length < min(allowed, len(draft)) and chance >= theta:
            length, chance = length + 1, chance * p
        if length == 0 and state.idle >= PROBE_EVERY and theta <= MAX_PROBE_THETA:  # (never past LARGE_BATCH)
            length = 1
        state.idle = 0 if length else state.idle + 1
        state.ngram = n
        return draft[:length]

    def _lookup(self, state: SeqDrafts, seq: Sequence) -> tuple[list[int], int]:
        index = state.index
        if self.method == "suffix":  # the group's other live samples may have grown since
            for sibling in seq.request.seqs:
                sibling_state = sibling.draft_state
                if sibling_state is not None and sibling_state.index is index:
                    index.update(sibling_state.slot)
        else:
            index.update(state.slot)
        return index.draft(seq.token_ids, self.k)

    def _state(self, seq: Sequence) -> SeqDrafts:
        state = seq.draft_state
        if state is not None and state.index.alive and state.index.lists[state.slot] is seq.token_ids:
            return state
        carried = () if state is None else (state.accepted, state.rejected, state.ngram, state.idle)
        if self.method == "ngram":
            index = TokenIndex()
            slot = index.add(seq.token_ids)
        else:
            index = self._prompt_index(seq)
            slot = index.add(seq.token_ids, start=0 if not index.lists else max(0, seq.num_prompt_tokens - 1))
        seq.draft_state = SeqDrafts(index, slot, *carried)
        return seq.draft_state

    def _prompt_index(self, seq: Sequence) -> TokenIndex:
        key = tuple(seq.request.prompt_token_ids)
        index = self.prompts.get(key)
        if index is None:
            index = self.prompts[key] = TokenIndex()
            total = sum(i.num_tokens for i in self.prompts.values())
            while len(self.prompts) > MAX_PROMPTS or (total > MAX_REMEMBERED_TOKENS and len(self.prompts) > 1):
                _, dropped = self.prompts.popitem(last=False)
                dropped.alive = False
                total -= dropped.num_tokens
        else:
            self.prompts.move_to_end(key)
            if index.num_tokens > MAX_INDEX_TOKENS:
                index.alive = False
                index = self.prompts[key] = _newest_half(index)
        return index

    # ------------------------------------------------------------------ learning
    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """After seq's draft was verified: its accepted tokens and its first mismatch (none when every token was
        accepted or seq ended inside the draft) update its counts and its n-gram length's."""
        state = seq.draft_state
        if state is None:
            return
        rejected = int(accepted < drafted and not seq.is_finished)
        state.accepted = state.accepted * SEQ_DECAY + accepted
        state.rejected = state.rejected * SEQ_DECAY + rejected
        counts = self.by_ngram[state.ngram]
        counts[0] = counts[0] * NGRAM_DECAY + accepted
        counts[1] = counts[1] * NGRAM_DECAY + rejected

    def record_step(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        """A step's rows and seconds, for the cost fit (decode-only steps: a prefill chunk's rows cost otherwise)."""
        if all(item.num_new_tokens == 1 for item in scheduled):
            self.cost.record(sum(1 + len(item.draft) for item in scheduled), seconds)

    def forget(self) -> None:
        """Drop every remembered rollout (live sequences re-index themselves on their next draft)."""
        for index in self.prompts.values():
            index.alive = False
        self.prompts.clear()


def _newest_half(index: TokenIndex) -> TokenIndex:
    """A new index over the newer half of index's lists (its sequences re-register when they draft next)."""
    fresh = TokenIndex()
    for tokens in index.lists[len(index.lists) // 2:]:
        fresh.update(fresh.add(tokens))
    return fresh


def _can_speculate(item: ScheduledSeq) -> bool:
    """A decode of a sequence that has sampled already (no prefill chunk, no fork to come, no prompt logprobs), without
    a structured output (its grammar would have to follow each draft and step back from the rejected ones)."""
    seq = item.seq
    return (item.samples and item.num_new_tokens == 1 and seq.num_output_tokens > 0 and not seq.needs_prompt_logprobs
            and seq.matcher is None)
