"""Partial rollouts, over-sampling and streaming groups in process: rollout(min_groups=K) returns once K prompt
groups finished and keeps the rest with what they generated; rollout(resume=batch.partial) continues them with
their first tokens, logprobs and versions intact; stream() yields groups as they finish while another thread
syncs weights with in_flight="keep"."""

import threading

import pytest
import torch

from fp8engine import EngineConfig, SamplingParams
from fp8engine.rl import RolloutEngine
from fp8engine.rl.batch import concat
from fp8engine.rl.groups import PartialGroup
from tests.test_async_updates import _new_weights
from tests.tiny_models import tiny_dir  # noqa: F401 (a fixture)

PROMPTS = [[5, 6, 7], list(range(100, 140)), [40, 41, 42], list(range(2000, 2023))]
PARAMS = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5)


@pytest.fixture(scope="module")
def model(tiny_dir):  # noqa: F811
    return tiny_dir("llama-llama3")


@pytest.fixture()
def rollouts(model):
    """Two groups of n=2 at a time, 16 tokens a step: group 1's 40-token prompt takes three chunked prefill
    steps, so group 0 finishes two steps ahead of it while groups 2 and 3 wait."""
    return RolloutEngine(EngineConfig(model=model, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16))


def _no_leak(rollouts: RolloutEngine) -> None:
    stats = rollouts.get_stats()
    assert not rollouts.engine.has_unfinished_requests() and not rollouts.finished
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_min_groups_returns_the_first_groups_and_keeps_the_rest_with_their_tokens(rollouts):
    batch = rollouts.rollout(PROMPTS, n=2, sampling_params=PARAMS, min_groups=1)
    assert batch.group_prompts == [PROMPTS[0]] and batch.batch_size == 2
    assert batch.response_lengths.tolist() == [8, 8] and batch.finish_reasons == ["length"] * 2
    assert [g.prompt for g in batch.partial] == PROMPTS[1:]
    started = batch.partial[0]
    assert [len(s.token_ids) for s in started.samples] == [6, 6] and started.num_unfinished == 2
    assert [s.token_weight_versions for s in started.samples] == [[0] * 6] * 2
    assert all(len(s.logprobs) == 6 for s in started.samples)
    assert all(len(s.token_ids) == 0 and s.finish_reason == "abort" for g in batch.partial[1:] for s in g.samples)
    _no_leak(rollouts)


@pytest.mark.parametrize("sync", [False, True], ids=["same-weights", "after-a-sync"])
def test_resume_continues_the_partial_groups_first_with_their_first_part_intact(rollouts, model, sync):
    first = rollouts.rollout(PROMPTS, n=2, sampling_params=PARAMS, min_groups=1)
    partial = first.partial
    heads = [(list(s.token_ids), list(s.logprobs)) for g in partial for s in g.samples]
    assert [len(t) for t, _ in heads] == [6, 6, 0, 0, 0, 0]
    if sync:
        rollouts.sync_weights(_new_weights(model), weight_version=1)
    hits = rollouts.engine.block_manager.num_prefix_hits
    second = rollouts.rollout([[7, 8, 9, 10]], n=2, sampling_params=PARAMS, resume=partial)
    assert second.group_prompts == PROMPTS[1:] + [[7, 8, 9, 10]]
    assert second.response_lengths.tolist() == [8] * 8 and not second.partial
    version = int(sync)
    for row, (tokens, logprobs) in enumerate(heads):
        k = len(tokens)
        assert second.response_ids[row, :k].tolist() == tokens
        assert second.rollout_logprobs[row, :k].tolist() == logprobs
        assert second.token_weight_versions[row].tolist() == [0] * k + [version] * (8 - k)
    # group 1's two continuations (its 40-token prompt + 6 tokens each) find its prompt's 2 full blocks cached:
    # 4 hits on the same weights; after a sync only the second finds the blocks the first computed anew
    assert rollouts.engine.block_manager.num_prefix_hits - hits == (2 if sync else 4)
    _no_leak(rollouts)


def test_a_predicate_drives_dynamic_sampling(rollouts):
    seen = []

    def two_groups_that_differ(groups):  # DAPO keeps groups whose samples (so rewards) are not all equal
        seen.append([g.batch_size for g in groups])
        return sum(not torch.equal(g.response_ids[0], g.response_ids[1]) for g in groups) >= 2

    batch = rollouts.rollout(PROMPTS, n=2, sampling_params=PARAMS, min_groups=two_groups_that_differ)
    assert len(batch.group_prompts) == 2 and seen[-1] == [2, 2] and len(batch.partial) == 2
    assert batch.group_prompts == PROMPTS[:2]
    _no_leak(rollouts)


def test_stream_yields_each_group_as_it_finishes(rollouts):
    groups = list(rollouts.stream(iter(PROMPTS), n=2, sampling_params=PARAMS, max_groups_in_flight=2))
    assert sorted(map(str, (g.group_prompts[0] for g in groups))) == sorted(map(str, PROMPTS))
    whole = RolloutEngine(rollouts.engine.config).rollout(PROMPTS, n=2, sampling_params=PARAMS)
    for g in groups:
        i = PROMPTS.index(g.group_prompts[0])
        assert g.batch_size == 2 and g.response_lengths.tolist() == [8, 8]
        assert torch.equal(g.response_ids, whole.response_ids[2 * i:2 * i + 2])
    _no_leak(rollouts)


def test_closing_a_stream_aborts_what_still_runs(rollouts):
    stream = rollouts.stream(PROMPTS, n=2, sampling_params=PARAMS)
    next(stream)
    stream.close()
    _no_leak(rollouts)


def test_a_sync_from_another_thread_lands_while_the_stream_runs(model):
    rollouts = RolloutEngine(EngineConfig(model=model, num_kv_blocks=64, max_num_seqs=2))
    prompts = [[i, i + 1, i + 2] for i in range(100, 130, 3)]  # 10 groups, one at a time
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1)
    got, synced_at = [], []

    def consume():
        for group in rollouts.stream(prompts, n=2, sampling_params=params):
            got.append(group)
            if len(got) == 1:
                started.set()

    started = threading.Event()
    consumer = threading.Thread(target=consume)
    consumer.start()
    assert started.wait(120)
    rollouts.sync_weights(_new_weights(model), weight_version=1, in_flight="keep")
    synced_at.append(len(got))
    consumer.join(300)
    assert len(got) == 10 and synced_at[0] < 10  # the sync did not wait for the stream to end
    versions = [g.token_weight_versions.tolist() for g in got]
    assert all(row == sorted(row) for v in versions for row in v)  # a sample switches once, old to new
    assert any(0 in row and 1 in row for v in versions for row in v) or synced_at[0] < len(got) - 1
    assert got[-1].token_weight_versions.eq(1).all() and all(g.response_lengths.tolist() == [12, 12] for g in got)
    _no_leak(rollouts)


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_groups=0), "min_groups must be"),
    (dict(min_groups=5), r"in \[1, 4\]"),
    (dict(min_groups=True), "min_groups must be"),
    (dict(resume=[PartialGroup([1, 2], [])]), "resume\\[0\\] has 0 samples but n=2"),
    (dict(resume=["x"]), "resume\\[0\\] is a str"),
])
def test_bad_partial_arguments_are_refused_and_change_nothing(rollouts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        rollouts.rollout(PROMPTS, n=2, sampling_params=PARAMS, **kwargs)
    _no_leak(rollouts)
    assert rollouts.rollout(PROMPTS[:1], n=2, sampling_params=PARAMS).response_lengths.tolist() == [8, 8]


def test_a_refused_prompt_aborts_the_resumed_ones_too(rollouts):
    partial = rollouts.rollout(PROMPTS, n=2, sampling_params=PARAMS, min_groups=1).partial
    with pytest.raises(ValueError, match="prompt"):
        rollouts.rollout([list(range(10_000))], n=2, sampling_params=PARAMS, resume=partial)
    _no_leak(rollouts)


@pytest.fixture(scope="module")
def client(model):
    from fp8engine.bench.serve_load import serving
    from fp8engine.rl import RolloutClient
    flags = ["--model", model, "--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "16"]
    with serving(flags, startup_timeout=600) as url:
        client = RolloutClient(url, tokenizer=model, sync_dtype=None)
        yield client
        client.close()


def test_partial_rollouts_over_http_resume_with_their_first_part_intact(client, model):
    version = client.weight_version()  # the module's server: the other test may have synced first
    first = client.rollout(PROMPTS, n=2, sampling_params=PARAMS, min_groups=1)
    assert first.batch_size == 2 and first.response_lengths.tolist() == [8, 8] and len(first.partial) == 3
    assert sorted(map(str, first.group_prompts + [g.prompt for g in first.partial])) == sorted(map(str, PROMPTS))
    heads = [s for g in first.partial for s in g.samples]
    # a group's stream may end in the moment between the first group's end and the client's abort (on a fast
    # CPU group 1 is two engine steps behind group 0): it comes back whole, and resume hands it on as it is
    assert all(len(s.token_ids) == len(s.logprobs) == len(s.token_weight_versions) for s in heads)
    assert all(len(s.token_ids) <= 8 if s.finish_reason == "abort" else  # 8: cut before its finish chunk came
               (len(s.token_ids), s.finish_reason) == (8, "length") for s in heads)
    assert sum(s.finish_reason == "abort" for s in heads) >= 2  # group 3 starts only after group 1 ends
    client.sync_weights(_new_weights(model), weight_version=version + 1, in_flight="keep")
    second = client.rollout([], n=2, sampling_params=PARAMS, resume=first.partial)
    assert second.group_prompts == [g.prompt for g in first.partial] and not second.partial
    assert second.response_lengths.tolist() == [8] * 6
    for row, head in enumerate(heads):
        k = len(head.token_ids)
        assert second.response_ids[row, :k].tolist() == head.token_ids
        assert second.rollout_logprobs[row, :k].tolist() == pytest.approx(head.logprobs, abs=1e-6)
        assert second.token_weight_versions[row].tolist() == [version] * k + [version + 1] * (8 - k)
    stats = client.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_an_http_stream_goes_on_through_a_sync_from_another_thread(client, model):
    prompts = [[i, i + 1, i + 2] for i in range(100, 130, 3)]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1)
    version = client.weight_version() + 1
    got, started = [], threading.Event()

    def consume():
        for group in client.stream(prompts, n=2, sampling_params=params, max_groups_in_flight=2):
            got.append(group)
            started.set()

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert started.wait(120)
    client.sync_weights(_new_weights(model, scale=0.2), weight_version=version, in_flight="keep")
    synced_at = len(got)
    consumer.join(300)
    assert len(got) == 10 and synced_at < 10
    assert all(g.response_lengths.tolist() == [12, 12] for g in got)
    assert all(row == sorted(row) for g in got for row in g.token_weight_versions.tolist())
    assert got[-1].token_weight_versions.eq(version).all()


def test_concat_joins_streamed_groups_into_one_training_batch(rollouts):
    groups = list(rollouts.stream(PROMPTS, n=2, sampling_params=PARAMS))
    batch = concat(groups)
    assert batch.batch_size == 8 and batch.n == 2 and batch.group_prompts == [g.group_prompts[0] for g in groups]
    prompts, responses = batch.prompts_and_responses()
    assert prompts == [p for g in groups for p in g.prompts_and_responses()[0]]
    assert responses == [r for g in groups for r in g.prompts_and_responses()[1]]
    assert batch.prompt_ids.shape[1] == 40 and batch.attention_mask.sum().item() == sum(
        g.attention_mask.sum().item() for g in groups)
    rows = [(g, i) for g in groups for i in range(g.batch_size)]
    for row, (g, i) in enumerate(rows):
        k = int(g.response_mask[i].sum())
        assert batch.rollout_logprobs[row, :k].tolist() == g.rollout_logprobs[i, :k].tolist()
        assert batch.token_weight_versions[row].tolist() == g.token_weight_versions[i].tolist()
    one = concat(groups[:1])
    assert torch.equal(one.input_ids, groups[0].input_ids) and torch.equal(one.position_ids, groups[0].position_ids)
    with pytest.raises(ValueError, match="at least one batch"):
        concat([])
    other = rollouts.rollout(PROMPTS[:1], n=1, sampling_params=PARAMS)
    with pytest.raises(ValueError, match="one n and pad token"):
        concat([groups[0], other])
