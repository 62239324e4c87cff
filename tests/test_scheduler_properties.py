"""A hypothesis state machine drives a real engine (tiny random model, 6 KV blocks of 8 tokens, a
16-token step budget, at most 8 sequences) with random add / step / abort / preempt / flush / weight-update sequences;
prompts share prefixes (prefix-cache hits) and n > 1 forks. After every rule the BlockManager and
Scheduler must be consistent: free + used = total, reference counts >= 0 and equal to the block-table
references of live sequences, the prefix-hash map consistent with block contents, per-sequence
preemptions summing to the total, no sequence both running and waiting; after a drain, everything is
freed. The engine must also never stall (schedule nothing with work queued)."""

import collections

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fp8engine import SamplingParams
from fp8engine.request import SeqStatus
from tests.conftest import make_engine

BLOCK_SIZE, NUM_BLOCKS = 8, 6
PREFIX = list(range(100, 124))  # shared prompt prefix: prompts cut from it hit each other's blocks
_engine = None


@pytest.fixture(scope="module", autouse=True)
def engine(tiny_qwen3_dir):
    global _engine
    _engine = make_engine(tiny_qwen3_dir, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
                          max_num_batched_tokens=16, max_num_seqs=8)
    yield _engine
    _engine = None


class EngineMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.engine = _engine
        assert not self.engine.has_unfinished_requests()
        self.engine.flush_prefix_cache()
        self.seqs = {}  # every sequence of this run that was preempted (or is live), by id
        self.preemptions_before = self.engine.scheduler.num_preemptions_total
        scheduler = self.engine.scheduler
        preempt = type(scheduler).preempt

        def recording_preempt(seq):
            self.seqs[seq.seq_id] = seq
            preempt(scheduler, seq)

        scheduler.preempt = recording_preempt

    # ---------------------------------------------------------------- rules
    @rule(shared=st.integers(0, len(PREFIX)), tail=st.lists(st.integers(1, 60), max_size=8),
          n=st.integers(1, 3), max_tokens=st.integers(1, 16), greedy=st.booleans(), seed=st.integers(0, 99))
    def add(self, shared, tail, n, max_tokens, greedy, seed):
        prompt = PREFIX[:shared] + tail or [7]
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0 if greedy else 1.0, seed=seed,
                                ignore_eos=True)
        self.engine.add_request(prompt, params)

    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            self.engine.step()

    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.engine.requests)))
        assert self.engine.abort_request(request_id).finished

    @precondition(lambda self: self.engine.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        running = self.engine.scheduler.running
        self.engine.scheduler.preempt(running[data.draw(st.integers(0, len(running) - 1))])

    @rule()
    def flush(self):
        self.engine.flush_prefix_cache()

    @rule(in_flight=st.sampled_from(["wait", "abort"]))
    def update_weights(self, in_flight):
        norm = self.engine.get_weights_by_name("model.norm.weight")
        report = self.engine.update_weights({"model.norm.weight": norm}, in_flight=in_flight)
        assert not self.engine.has_unfinished_requests() and report.weight_version == self.engine.weight_version
        self.engine.step()  # hands over the outputs the update finished or aborted

    # ---------------------------------------------------------------- invariants
    @invariant()
    def blocks_add_up(self):
        bm = self.engine.block_manager
        refs = collections.Counter(b for seq in self.live() for b in seq.block_table)
        assert all(block.ref_count >= 0 for block in bm.blocks)
        assert {b.block_id: b.ref_count for b in bm.blocks if b.ref_count} == dict(refs)
        assert set(bm.free) == {b.block_id for b in bm.blocks if b.ref_count == 0}
        assert bm.num_free_blocks + len(refs) == bm.num_blocks

    @invariant()
    def prefix_map_matches_block_contents(self):
        bm = self.engine.block_manager
        assert all(bm.blocks[b].hash == h and len(bm.blocks[b].token_ids) == BLOCK_SIZE
                   for h, b in bm.cached.items())
        assert all(bm.cached.get(b.hash) == b.block_id for b in bm.blocks if b.hash is not None)
        for seq in self.live():
            for i in range(seq.num_hashed_blocks):
                block = bm.blocks[seq.block_table[i]]
                if block.hash == bm.block_hash(seq, i):
                    assert block.token_ids == seq.block_tokens(i, BLOCK_SIZE)

    @invariant()
    def queues_are_consistent(self):
        scheduler = self.engine.scheduler
        running, waiting = [s.seq_id for s in scheduler.running], [s.seq_id for s in scheduler.waiting]
        assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting)
        assert not set(running) & set(waiting)
        assert all(s.status == SeqStatus.RUNNING for s in scheduler.running)
        assert all(s.status == SeqStatus.WAITING and s.num_computed_tokens == 0 and not s.block_table
                   for s in scheduler.waiting)
        assert len(scheduler.running) <= self.engine.config.max_num_seqs

    @invariant()
    def preemptions_sum_to_the_total(self):
        for request in self.engine.requests.values():
            self.seqs.update((s.seq_id, s) for s in request.seqs)
        assert all(s.is_finished and not s.block_table for s in self.seqs.values()
                   if s.request.request_id not in self.engine.requests)
        total = self.engine.scheduler.num_preemptions_total - self.preemptions_before
        assert sum(s.num_preemptions for s in self.seqs.values()) == total

    def teardown(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        for _ in range(10_000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        del engine.scheduler.preempt
        self.preemptions_sum_to_the_total()
        bm = engine.block_manager
        assert not engine.has_unfinished_requests() and not engine.scheduler.has_work()
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)

    def live(self):
        return list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting)


def test_forks_count_toward_max_num_seqs(engine):
    """A prefilling first sample becomes n sequences when it forks: admitting two such requests as two
    sequences ran 9 > max_num_seqs = 8 (found by the machine below)."""
    engine.add_request([5, 6, 7], SamplingParams(n=5, max_tokens=2, ignore_eos=True))
    engine.add_request([8, 9], SamplingParams(n=4, max_tokens=2, ignore_eos=True))
    engine.step()
    assert len(engine.scheduler.running) == 5 and len(engine.scheduler.waiting) == 1
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= engine.config.max_num_seqs


EngineMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, derandomize=True,
                                           database=None, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestEngineMachine = EngineMachine.TestCase
