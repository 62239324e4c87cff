"""Continuous batching with one unit of scheduling.

Every sequence moves its computed-token count toward its length under a per-step token budget,
so chunked prefill, prefill and decode share one code path and one step. When KV blocks run out
the newest running sequence is preempted by recompute: its blocks are freed, it goes back to the
front of the queue, and its preemption count goes up.
"""

from collections import deque
from dataclasses import dataclass

from fp8engine.kvcache.block_manager import BlockManager
from fp8engine.scheduler.sequence import Sequence, SeqStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0

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
        return scheduled

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

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.FINISHED

    def insert_running_after(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children of a fork run right after their parent, keeping the parent's age order."""
        i = self.running.index(parent) + 1
        self.running[i:i] = children


def _width(seq: Sequence) -> int:
    """How many running sequences seq will be: a request's first sample forks into n after its prefill."""
    return seq.params.n if seq.index == 0 and len(seq.request.seqs) < seq.params.n else 1
