"""Draft tokens from token histories: the sequence's own prompt and tokens ("ngram", prompt lookup), and with
"suffix" also its prompt group's other samples and earlier rollouts of the same prompt.

A TokenIndex maps every n-gram (n = 1..MAX_NGRAM) of a set of token lists to where it last ended; a draft is the
continuation after the longest n-gram that ends the sequence, looked up in O(MAX_NGRAM) dict reads and kept up to
date as tokens arrive (each new token adds MAX_NGRAM entries). "ngram" gives each sequence an index of its own;
"suffix" gives each prompt one, shared by every sequence of that prompt, live or finished, bounded in tokens
(the oldest lists are dropped past MAX_INDEX_TOKENS) and in prompts (least recently used dropped past
MAX_PROMPTS), and forgotten on a weight update when the engine is configured so.

Drafts only propose: the output processor accepts a draft token when it equals the target's own sample at its
position, so a draft source changes how many tokens a step emits, never which.

The Speculator extends a step's decode items with drafts where the step has room: tokens left in the step's
budget, KV slots in blocks that are free and hold no prefix-cache content (so a draft never preempts, never
evicts a cached block), and rows under MAX_STEP_ROWS (past it the linears stop being bound by reading the
weights, and a rejected draft costs compute the plain step would not spend).
"""

from collections import OrderedDict
from collections.abc import Callable

from fp8engine.request import ScheduledSeq, Sequence

SPECULATIVE_METHODS = (None, "ngram", "suffix")
MAX_NGRAM = 3
MAX_INDEX_TOKENS = 1 << 16  # per prompt ("suffix")
MAX_PROMPTS = 256  # prompts whose rollouts "suffix" remembers
# The most rows (decode tokens and drafts) a step may reach with drafts: measured with bench --speculative at
# 1-128 sequences on a 2-core AVX-512 CPU (docs/benchmarks.md, "Speculative decoding").
MAX_STEP_ROWS = 64
MAX_BACKOFF = 16  # most decode steps a sequence sits out after drafts rejected in a row


class TokenIndex:
    """{n-gram: (list number, end position)} of the latest occurrence of each n-gram in a set of token lists.

    A list is indexed up to its second-to-last token, so the n-gram that ends a list is never found at its own
    end: the hit always has a continuation."""

    __slots__ = ("ends", "lists", "done", "num_tokens", "alive")

    def __init__(self):
        self.ends: dict[tuple[int, ...], tuple[int, int]] = {}
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
                ends[tuple(tokens[end - n + 1:end + 1])] = (i, end)
        if last > self.done[i]:
            self.num_tokens += last - self.done[i]
            self.done[i] = last

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest n-gram ending `tokens` (most recent occurrence), or []."""
        for n in range(min(MAX_NGRAM, len(tokens)), 0, -1):
            hit = self.ends.get(tuple(tokens[-n:]))
            if hit is not None:
                i, end = hit
                return self.lists[i][end + 1:end + 1 + k]
        return []


class SeqDrafts:
    """A sequence's drafting state: its index (own or its prompt's), its list there, its draft length, and the
    steps it sits out after a rejected draft (backoff doubles with each rejection in a row, up to MAX_BACKOFF)."""

    __slots__ = ("index", "slot", "draft_len", "skip", "backoff")

    def __init__(self, index: TokenIndex, slot: int, draft_len: int, skip: int = 0, backoff: int = 0):
        self.index, self.slot, self.draft_len, self.skip, self.backoff = index, slot, draft_len, skip, backoff


class Speculator:
    """Proposes drafts for a step (`propose`) and adapts each sequence's draft length (`observe`).

    source(seq, k) -> draft, when given, replaces the lookup (tests: a source proposing garbage)."""

    def __init__(self, method: str, num_speculative_tokens: int, max_model_len: int,
                 source: Callable[[Sequence, int], list[int]] | None = None):
        if method not in SPECULATIVE_METHODS[1:]:
            raise ValueError(f"speculative must be one of {list(SPECULATIVE_METHODS)}, got {method!r}")
        self.method = method
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.source = source
        self.prompts: OrderedDict[tuple[int, ...], TokenIndex] = OrderedDict()

    # ------------------------------------------------------------------ drafting
    def propose(self, scheduled: list[ScheduledSeq], budget: int, extend) -> None:
        """Give the step's decode items drafts. budget: the step's token budget (max_num_batched_tokens);
        extend(item, draft) cuts the draft to the KV room the scheduler finds and sets item.draft."""
        rows = sum(item.num_new_tokens for item in scheduled)
        room = min(budget, MAX_STEP_ROWS) - rows
        if room <= 0:
            return
        wanted = [(item, limit) for item in scheduled if _can_speculate(item) and (limit := self._limit(item.seq)) > 0]
        for i, (item, limit) in enumerate(wanted):  # the room shared evenly, what one leaves going to the next
            allowed = min(limit, room // (len(wanted) - i))
            if allowed <= 0:
                continue
            seq = item.seq
            draft = self.source(seq, allowed) if self.source is not None else self._lookup(seq, allowed)
            if draft:
                extend(item, draft[:allowed])
                room -= len(item.draft)

    def _limit(self, seq: Sequence) -> int:
        """Drafts seq may take now: its adapted length, and what max_tokens and max_model_len leave (k drafts
        emit at most k + 1 tokens; the last draft sits at position num_tokens + k - 1)."""
        state = seq.draft_state
        if state is not None and state.skip:
            state.skip -= 1
            return 0
        length = self.k if state is None else state.draft_len
        return min(length, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        state = self._state(seq)
        index = state.index
        if self.method == "suffix":  # the group's other live samples may have grown since
            for sibling in seq.request.seqs:
                sibling_state = sibling.draft_state
                if sibling_state is not None and sibling_state.index is index:
                    index.update(sibling_state.slot)
        else:
            index.update(state.slot)
        return index.draft(seq.token_ids, k)

    def _state(self, seq: Sequence) -> SeqDrafts:
        state = seq.draft_state
        if state is not None and state.index.alive and state.index.lists[state.slot] is seq.token_ids:
            return state
        carried = () if state is None else (state.draft_len, state.skip, state.backoff)
        if self.method == "ngram":
            index = TokenIndex()
            slot = index.add(seq.token_ids)
        else:
            index = self._prompt_index(seq)
            slot = index.add(seq.token_ids, start=0 if not index.lists else max(0, seq.num_prompt_tokens - 1))
        seq.draft_state = SeqDrafts(index, slot, *(carried or (self.k,)))
        return seq.draft_state

    def _prompt_index(self, seq: Sequence) -> TokenIndex:
        key = tuple(seq.request.prompt_token_ids)
        index = self.prompts.get(key)
        if index is None:
            index = self.prompts[key] = TokenIndex()
            while len(self.prompts) > MAX_PROMPTS:
                self.prompts.popitem(last=False)
        else:
            self.prompts.move_to_end(key)
            if index.num_tokens > MAX_INDEX_TOKENS:
                index.alive = False
                index = self.prompts[key] = _newest_half(index)
        return index

    # ------------------------------------------------------------------ after verification
    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Adapt seq's drafting to its last verification: the next draft is one longer than what was accepted
        (so one more after a fully accepted draft); a draft rejected outright makes seq sit out 1, 2, 4, ...
        MAX_BACKOFF decode steps (a rejected draft costs rows that emit nothing)."""
        state = seq.draft_state
        if state is None:
            return
        state.draft_len = min(self.k, accepted + 1)
        if accepted:
            state.backoff = 0
        else:
            state.backoff = min(MAX_BACKOFF, 2 * state.backoff or 1)
            state.skip = state.backoff

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
    """A decode of a sequence that has sampled already (no prefill chunk, no fork to come, no prompt logprobs)."""
    seq = item.seq
    return item.samples and item.num_new_tokens == 1 and seq.num_output_tokens > 0 and not seq.needs_prompt_logprobs
