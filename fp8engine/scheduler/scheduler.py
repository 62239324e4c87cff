"""Continuous batching with one unit of scheduling.

Every sequence moves its computed-token count toward its length under a per-step token budget,
so chunked prefill, prefill and decode share one code path and one step. When KV blocks run out
the newest running sequence is preempted by recompute: its blocks are freed, it goes back to the
front of the queue, and its preemption count goes up. The scheduler owns the queues and the block
manager: whatever adds, forks, advances or ends a sequence goes through it.
"""

from collections import deque

from fp8engine.kvcache.block_manager import BlockManager
from fp8engine.request import ScheduledSeq, SeqStatus, Sequence


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, max_num_seqs: int,
                 max_num_batched_tokens: int, num_state_slots: int = 0, num_state_snapshots: int = 0,
                 spec_states_per_slot: int = 0):
        self.block_manager = self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching, num_state_slots,
                                                    num_state_snapshots, spec_states_per_slot)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0
        self.num_kv_recomputes_total = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled, preempted = self._schedule_running(budget)
        budget -= sum(s.num_new_tokens for s in scheduled)
        if not preempted:
            scheduled += self._schedule_waiting(budget)
        if self.bm.states is not None:
            for item in scheduled:
                item.snapshots = self.bm.plan_snapshots(item.seq, item.num_new_tokens)
        return scheduled

    def decodes_only(self) -> bool:
        """Whether schedule() would now run each running sequence one token and nothing else: every one has exactly
        one token to compute, the token budget and the free blocks cover them all (no preemption), and no waiting
        sequence could be admitted beside them (async scheduling schedules such a step before the host reads the
        tokens of the step before)."""
        running = self.running
        if not running or len(running) > self.max_num_batched_tokens:
            return False
        if any(s.num_tokens - s.num_computed_tokens != 1 for s in running):
            return False
        if self.waiting and sum(map(_width, running)) + _width(self.waiting[0]) <= self.max_num_seqs:
            return False
        needed = sum(self.bm.blocks_needed(s, s.num_computed_tokens + 1) for s in running)
        return needed <= self.bm.num_free_blocks

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledSeq], bool]:
        scheduled, preempted, i = [], False, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    return scheduled, preempted
            self.bm.allocate(seq, seq.num_computed_tokens + num_new)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1
        return scheduled, preempted

    def _schedule_waiting(self, budget: int) -> list[ScheduledSeq]:
        scheduled = []
        num_seqs = sum(map(_width, self.running))
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            width = _width(seq)
            if self.running and num_seqs + width > self.max_num_seqs:
                break
            hits = self.bm.match_prefix(seq)
            num_cached = len(hits) * self.bm.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.bm.can_allocate(seq, num_cached + num_new, hits):
                break
            self.bm.allocate(seq, num_cached + num_new, hits)
            seq.num_computed_tokens = num_cached
            if seq.num_output_tokens == 0:
                seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, num_cached)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            num_seqs += width
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def recompute_in_flight(self) -> list[Sequence]:
        """Drop the KV of every running sequence and queue it to be recomputed from its first token (after the
        weights changed under it): each goes back to the front of the queue, in its running order. Not a
        preemption (counted apart, per sequence in num_kv_recomputes). Returns them."""
        dropped = list(self.running)
        for seq in reversed(dropped):
            self.bm.free_seq(seq)
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            seq.num_kv_recomputes += 1
            self.waiting.appendleft(seq)
        self.running.clear()
        self.num_kv_recomputes_total += len(dropped)
        return dropped

    def live_blocks(self) -> list[int]:
        """KV blocks whose contents may be read again: held by a sequence, or cached for prefix hits."""
        return self.bm.live_blocks()

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.FINISHED

    def advance(self, item: ScheduledSeq) -> None:
        """After a step computed item's tokens: count them, and offer its newly filled blocks to the prefix cache."""
        item.seq.num_computed_tokens += item.num_new_tokens
        self.bm.cache_full_blocks(item.seq)

    def extend(self, item: ScheduledSeq, draft: list[int]) -> None:
        """Add draft tokens to a decode item, cut to the KV slots it holds or can take from free blocks without
        prefix-cache content: a draft never preempts and never evicts a cached block."""
        end = item.seq.num_computed_tokens + item.num_new_tokens
        covered = self.bm.grow_uncached(item.seq, end + len(draft))
        item.draft = tuple(draft[:covered - end])
        states = self.bm.states
        if states is not None and item.draft:  # the state after each token but the last, to roll back to
            spec = states.spec_of[item.seq.state_slot]
            item.snapshots += tuple((j, spec[j - 1]) for j in range(1, item.num_new_tokens + len(item.draft)))
            item.seq.draft_span = (end, len(item.draft))

    def accept_draft_token(self, seq: Sequence) -> None:
        """The draft token after seq's computed tokens was accepted (it is seq's next token now): its KV, written
        by the step, counts as computed."""
        seq.num_computed_tokens += 1
        self.bm.cache_full_blocks(seq)

    def release_draft_slots(self, seq: Sequence) -> None:
        """After verification: give back the blocks that only rejected drafts used (seq holds, as without
        drafts, the blocks of its computed tokens), and with state slots roll the state back to the last accepted
        token."""
        self.bm.trim(seq, seq.num_computed_tokens)
        states = self.bm.states
        if states is not None and seq.draft_span is not None:
            end, drafted = seq.draft_span
            if seq.num_computed_tokens < end + drafted:  # a draft token was rejected
                states.roll_back(seq.state_slot, seq.num_computed_tokens - end + 1)
            seq.draft_span = None

    def fork(self, seq: Sequence) -> list[Sequence]:
        """A request's first sample, prefilled, becomes its n samples: [seq] + the n - 1 new ones (just [seq] for
        any other sequence, or once forked). A child shares
        seq's full blocks and copies its partial one; a child without a free block for that copy waits at the
        front of the queue and recomputes later, through the prefix cache. Children run right after seq."""
        request = seq.request
        if seq.index != 0 or len(request.seqs) == request.params.n:
            return [seq]
        children, queued = [], []
        for i in range(len(request.seqs), request.params.n):
            child = seq.fork(i)
            if self.bm.can_fork(seq):
                self.bm.fork(seq, child)
                children.append(child)
            else:
                child.num_computed_tokens, child.status = 0, SeqStatus.WAITING
                queued.append(child)
        request.seqs += children + queued
        at = self.running.index(seq) + 1
        self.running[at:at] = children
        self.waiting.extendleft(reversed(queued))
        return [seq] + children + queued

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source, destination) KV blocks the forks since the last call need copied before the next forward."""
        return self.bm.take_pending_copies()

    def take_state_ops(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(state slot copies, slots to zero) since the last call (kvcache/state_pool.py); nothing without slots."""
        return ([], []) if self.bm.states is None else self.bm.states.take_pending()

    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()


def _width(seq: Sequence) -> int:
    """How many running sequences seq will be: a request's first sample forks into n after its prefill."""
    return seq.params.n if seq.index == 0 and len(seq.request.seqs) < seq.params.n else 1
