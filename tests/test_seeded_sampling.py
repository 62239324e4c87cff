"""Stateless seeded sampling: a token's noise is a function of (seed, sample index, position) alone."""

import torch

from fp8engine import SamplingParams
from fp8engine.model_executor.layers import sampler as sampler_mod
from fp8engine.model_executor.layers.sampler import SampleRow, sample, sampling_uniforms
from tests.conftest import cpu_kernels, make_engine
from tests.prompts import RAW

KERNEL = cpu_kernels().sample_rows  # the fused C++ sampler an engine is given (None where it is not built)

SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)


def test_uniforms_are_pinned_and_pure():
    # A seed reported today must reproduce tomorrow: the hash's values are part of the contract.
    got = sampling_uniforms([0, 0, 0, 7, -1], [0, 0, 1, 3, 0], [0, 5, 5, 40, 0])
    assert got.dtype == torch.float32
    assert (got * 2**24).tolist() == [16509320, 2468166, 15451785, 5045796, 1236514]
    assert torch.equal(sampling_uniforms([0, 0, 0, 7, -1], [0, 0, 1, 3, 0], [0, 5, 5, 40, 0]), got)
    assert torch.equal(sampling_uniforms([2**64 - 1, 2**64], [0, 0], [0, 0]), got[[4, 0]])  # seeds mod 2**64


def test_int_and_tensor_hashes_agree(monkeypatch):
    """A few rows hash on Python ints, more on tensors: the same bits either way, huge and negative seeds too."""
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-2**62, 2**62, (300,), generator=gen).tolist() + [2**64 - 1, -1, 0, 2**70 + 5]
    indices = torch.randint(0, 64, (304,), generator=gen).tolist()
    positions = torch.randint(0, 2**20, (304,), generator=gen).tolist()
    by_tensor = sampling_uniforms(seeds, indices, positions)  # 304 rows: the tensor hash
    rows = sampler_mod._INT_HASH_MAX_ROWS
    by_int = torch.cat([sampling_uniforms(seeds[i:i + rows], indices[i:i + rows], positions[i:i + rows])
                        for i in range(0, 304, rows)])
    assert by_int.dtype == torch.float32 and torch.equal(by_int, by_tensor)
    monkeypatch.setattr(sampler_mod, "_INT_HASH_MAX_ROWS", 0)  # the pinned values through the tensor hash too
    got = sampling_uniforms([0, 0, 0, 7, -1], [0, 0, 1, 3, 0], [0, 5, 5, 40, 0])
    assert (got * 2**24).tolist() == [16509320, 2468166, 15451785, 5045796, 1236514]


def test_changing_any_coordinate_changes_the_uniform():
    grid = torch.cartesian_prod(torch.arange(10), torch.arange(4), torch.arange(25)).tolist()
    values = sampling_uniforms(*map(list, zip(*grid)))
    assert len(set(values.tolist())) == len(grid)


def test_uniforms_are_uniform_and_uncorrelated_along_positions():
    n = 100_000
    for seeds, indices, positions in [([3] * n, [0] * n, list(range(n))),           # one sample's stream
                                      (list(range(n)), [0] * n, [17] * n),          # across requests
                                      ([3] * n, list(range(n)), [17] * n)]:         # across samples
        u = sampling_uniforms(seeds, indices, positions).double()
        assert 0.0 <= u.min() and u.max() < 1.0
        assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
        counts = torch.bincount((u * 100).long(), minlength=100).double()
        assert ((counts - n / 100) ** 2 / (n / 100)).sum() < 160  # chi-square, 99 dof
        assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 0.015


def test_fused_and_reference_paths_invert_the_cdf_at_the_same_uniform():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    n = 3000
    rows = [SampleRow(SamplingParams(temperature=1.0), seed=i % 7, index=i % 3, position=i) for i in range(n)]
    u = sampling_uniforms([r.seed for r in rows], [r.index for r in rows], [r.position for r in rows])
    expected = torch.searchsorted(probs.double().cumsum(0), (1 - u.double())[:, None]).squeeze(1).tolist()
    logits = probs.log()[None].repeat(n, 1)
    reference = sample(logits, rows).token_ids
    assert sample(logits, rows, kernel=KERNEL).token_ids == reference == expected


def test_a_rows_token_and_logprobs_do_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 3000) * 3
    plain = SamplingParams(temperature=1.0, logprobs=0)
    others = [SampleRow(SamplingParams(temperature=0.8, top_p=0.5, logprobs=2), seed=1),  # reference path
              SampleRow(SamplingParams(temperature=1.0, top_k=5), seed=2),
              SampleRow(SamplingParams(temperature=1.0), seed=3, banned_token_ids=(0, 1))]
    for position in range(40):
        row = SampleRow(plain, seed=5, index=1, position=position)
        alone = sample(logits[:1], [row], kernel=KERNEL)
        batched = sample(logits, [row] + others, kernel=KERNEL)
        assert (alone.token_ids[0], alone.logprobs[0]) == (batched.token_ids[0], batched.logprobs[0])


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_engine_draws_at_the_position_of_each_new_token(engine_fp32, monkeypatch):
    calls = []
    real = sampler_mod.sampling_uniforms
    monkeypatch.setattr(sampler_mod, "sampling_uniforms",
                        lambda *args: calls.append(tuple(map(list, args))) or real(*args))
    prompt = list(range(1000, 1013))
    out = engine_fp32.generate([prompt], SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True,
                                                        seed=9))[0]
    assert calls[0] == ([9, 9], [0, 1], [13, 13])  # the prompt's last logits fork into both samples
    assert [sorted(zip(*c)) for c in calls[1:]] == [[(9, 0, 14), (9, 1, 14)], [(9, 0, 15), (9, 1, 15)]]
    assert [c.seed for c in out.outputs] == [9, 9]


def test_seeded_sampling_survives_preemption():
    """The noise is a function of (seed, index, position): a preempted, recomputed sample draws the same tokens.
    Both engines are batch invariant, so the logits are the same bits too: a float32 engine's GEMM (oneDNN) picks
    its blocking by the batch's rows, and a near-tie at one of 320 draws then flipped a token (seen on AVX-512
    without AMX)."""
    prompts = RAW[:8]
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=7)
    reference = make_engine(batch_invariant=True, num_kv_blocks=256).generate(prompts, params)
    small = make_engine(batch_invariant=True, num_kv_blocks=14, max_num_batched_tokens=64)
    outs = small.generate(prompts, params)
    assert sum(o.outputs[0].num_preemptions > 0 for o in outs) >= 2
    assert _tokens(outs) == _tokens(reference)


def test_seeded_sampling_alone_equals_batched(engine_fp32):
    batched = engine_fp32.generate(RAW[:6], SAMPLED)
    alone = [engine_fp32.generate([p], SAMPLED)[0] for p in RAW[:2]]
    assert _tokens(alone) == _tokens(batched[:2])


def test_an_unseeded_request_reports_the_seed_that_reproduces_it(engine_fp32):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first, second = (engine_fp32.generate([RAW[0]], params)[0].outputs[0] for _ in range(2))
    assert isinstance(first.seed, int) and first.seed != second.seed and first.token_ids != second.token_ids
    again = engine_fp32.generate([RAW[0]], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                          seed=first.seed))[0].outputs[0]
    assert again.token_ids == first.token_ids and again.seed == first.seed


def test_n_samples_of_one_seed_differ_and_each_reproduces(engine_fp32):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=21)
    out = engine_fp32.generate([RAW[1]], params)[0]
    tokens = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in tokens}) == 4
    assert [c.seed for c in out.outputs] == [21] * 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in engine_fp32.generate([RAW[1]], params)[0].outputs] == tokens
    fewer = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=21)
    assert [c.token_ids for c in engine_fp32.generate([RAW[1]], fewer)[0].outputs] == tokens[:2]

