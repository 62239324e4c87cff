"""Sampler: processed/raw logprobs, kept mass, seeded draws, on hand-built distributions."""

import math

import pytest
import torch

from fp8engine import SamplingParams
from fp8engine.model_executor import kernel_set
from fp8engine.model_executor.layers import sampler as sampler_mod
from fp8engine.model_executor.layers.sampler import SampleRow, processed_logprobs, sample, truncation_mask
from tests.conftest import cpu_kernels, require_cpu_op

PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
KERNEL = cpu_kernels().sample_rows  # the fused C++ sampler an engine is given (None where it is not built)


def rows_params(n, vocab=5, **kw):
    return (torch.full((n,), kw.get("temperature", 1.0)), torch.full((n,), kw.get("top_k", vocab)),
            torch.full((n,), kw.get("top_p", 1.0)), torch.full((n,), kw.get("min_p", 0.0)))


def test_kept_mass_on_hand_built_distribution():
    logits = PROBS.log()[None]
    cases = [(dict(top_p=0.6), [0, 1], 0.7), (dict(top_k=3), [0, 1, 2], 0.85),
             (dict(min_p=0.25), [0, 1, 2], 0.85), (dict(top_p=0.5), [0], 0.5),
             (dict(top_k=4, top_p=0.72), [0, 1], 0.7)]  # renormalised after top-k
    for kw, kept, mass in cases:
        proc, log_kept = processed_logprobs(logits, *rows_params(1, **kw))
        assert math.isclose(log_kept.item(), math.log(mass), rel_tol=1e-5), kw
        finite = torch.isfinite(proc[0]).nonzero().flatten().tolist()
        assert finite == kept, kw
        expected = (PROBS[kept] / mass).log()
        assert torch.allclose(proc[0, kept], expected, atol=1e-6), kw


def test_processed_logprobs_sum_to_one_over_the_kept_set():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 3
    for kw in [dict(), dict(temperature=0.7), dict(top_p=0.9), dict(top_k=50, temperature=1.3),
               dict(min_p=0.05, top_p=0.95, temperature=0.6)]:
        proc, _ = processed_logprobs(logits, *rows_params(6, vocab=1000, **kw))
        assert torch.allclose(proc.exp().sum(-1), torch.ones(6), atol=1e-5), kw


def test_top_k_keeps_ties():
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2]])
    assert truncation_mask(probs, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0])).all()


def test_raw_and_processed_differ_as_temperature_and_top_p_say():
    torch.manual_seed(1)
    logits = torch.randn(1, 50) * 2
    for mode in ("raw", "processed"):
        params = SamplingParams(temperature=0.7, top_p=0.9, logprobs=2, logprobs_mode=mode, seed=5)
        res = sample(logits.clone(), [SampleRow(params, seed=5)], kernel=KERNEL)
        tok = res.token_ids[0]
        if mode == "raw":
            assert math.isclose(res.logprobs[0], torch.log_softmax(logits[0], -1)[tok].item(), rel_tol=1e-6)
            assert res.log_kept_mass[0] is None
        else:
            tempered = torch.log_softmax(logits[0] / 0.7, -1)
            assert res.log_kept_mass[0] < 0
            assert math.isclose(res.logprobs[0] + res.log_kept_mass[0], tempered[tok].item(), abs_tol=1e-5)
        assert tok in res.top_logprobs[0] and len(res.top_logprobs[0]) in (2, 3)


def test_greedy_processed_is_point_mass_and_raw_is_log_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    proc = sample(logits.clone(), [SampleRow(SamplingParams(temperature=0, logprobs=0), seed=0)], kernel=KERNEL)
    raw = sample(logits.clone(), [SampleRow(SamplingParams(temperature=0, logprobs=0, logprobs_mode="raw"), seed=0)],
                 kernel=KERNEL)
    assert proc.token_ids == raw.token_ids == [1]
    assert proc.logprobs == [0.0] and proc.log_kept_mass == [0.0]
    assert math.isclose(raw.logprobs[0], torch.log_softmax(logits[0], -1)[1].item(), rel_tol=1e-6)


def test_banned_tokens_never_drawn_and_draws_follow_the_distribution():
    logits = PROBS.log()[None].repeat(4000, 1)
    params = SamplingParams(temperature=1.0, seed=0)
    res = sample(logits.clone(), [SampleRow(params, seed=i, banned_token_ids=(0,)) for i in range(4000)],
                 kernel=KERNEL)
    counts = torch.bincount(torch.tensor(res.token_ids), minlength=5).float() / 4000
    assert counts[0] == 0
    assert torch.allclose(counts[1:], PROBS[1:] / 0.5, atol=0.03)


def test_seeded_draws_repeat():
    logits = torch.randn(3, 100)
    params = SamplingParams(temperature=1.0, top_p=0.8)
    draw = lambda: sample(logits.clone(), [SampleRow(params, seed=i) for i in range(3)], kernel=KERNEL).token_ids  # noqa: E731
    assert draw() == draw()


def _reference_sample(logits, rows):
    """The torch sampler (no fused CPU kernel given)."""
    return sample(logits.clone(), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_fused_kernel_matches_the_reference(dtype, temperature, mode):
    require_cpu_op("sample_rows")
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(24, 3001, generator=gen) * 3).to(dtype)
    logits[:, :7] = float("-inf")  # zero-probability tokens are never drawn
    params = SamplingParams(temperature=temperature, logprobs=0, logprobs_mode=mode)
    rows = [SampleRow(params, seed=i, position=100 + i) for i in range(24)]
    assert sampler_mod._fused_kernel(KERNEL, logits, rows) is not None
    got, want = sample(logits, rows, kernel=KERNEL), _reference_sample(logits, rows)
    uniform = sampler_mod.sampling_uniforms(list(range(24)), [0] * 24, [100 + i for i in range(24)])
    mismatched = [i for i in range(24) if got.token_ids[i] != want.token_ids[i]]
    assert len(mismatched) <= 1
    for i in mismatched:  # only where float32 summation order decides: 1 - u sits on a CDF step
        cdf = torch.softmax(logits[i].double() / temperature, -1).cumsum(-1)
        lo, hi = sorted((got.token_ids[i], want.token_ids[i]))
        assert abs(cdf[lo] - (1 - uniform[i])) < 1e-5 and abs(cdf[hi - 1] - (1 - uniform[i])) < 1e-5
    assert min(got.token_ids) >= 7
    same = [i for i in range(24) if i not in mismatched]
    assert torch.allclose(torch.tensor(got.logprobs)[same], torch.tensor(want.logprobs)[same], atol=2e-5)
    assert got.log_kept_mass == want.log_kept_mass and got.top_logprobs == want.top_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_form_of_the_fused_sampler_is_the_reference_bitwise(dtype):
    """sample_rows_torch (what a CUDA engine's fused rows take, in its decode graph too) gives each row the
    reference's token, logprob and kept mass bit for bit: greedy and tempered rows, raw and processed, mixed in
    one batch, drawn and forced (trainer replay); it syncs nothing, so its temperatures and uniforms are tensors."""
    device_kernel = kernel_set._sample_rows_on_device
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, 2053, generator=gen) * 3).to(dtype)
    logits[:, :5] = float("-inf")
    rows = [SampleRow(SamplingParams(temperature=t, logprobs=0 if i % 4 else None, logprobs_mode=m),
                      seed=i, position=50 + i)
            for i, (t, m) in enumerate([(t, m) for t in (0.0, 0.6, 1.0) for m in ("raw", "processed")] * 2)]
    assert sampler_mod._fused_kernel(device_kernel, logits, rows) is device_kernel
    got, want = sample(logits, rows, kernel=device_kernel), _reference_sample(logits, rows)
    assert got == want and min(got.token_ids) >= 5
    assert len(set(got.token_ids)) > 6 and {lp for lp in got.logprobs if lp is not None} - {0.0}
    forced = [(t + 1) % 2053 for t in got.token_ids]
    assert (sample(logits, rows, forced=forced, kernel=device_kernel)
            == sample(logits.clone(), rows, forced=forced))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_greedy_takes_the_first_of_ties(dtype):
    """A greedy row's token is the first index holding the max, wherever it lies (vector or tail lanes)."""
    require_cpu_op("sample_rows")
    logits = torch.full((6, 3001), -2.0, dtype=dtype)
    ties = [(17, 2990), (2999, 3000), (0, 1), (3000,)]
    for r, cols in enumerate(ties):
        logits[r, list(cols)] = 4.0
    logits[4] = float("-inf")  # nothing finite: the first -inf
    logits[5] = float("nan")  # nothing equals the max: token 0
    tokens, processed, _ = KERNEL(logits, torch.zeros(6), torch.zeros(6), False, None)
    assert tokens.tolist() == [17, 2999, 0, 3000, 0, 0]
    assert processed.tolist() == [0.0] * 6


def test_fused_draws_follow_the_distribution():
    logits = PROBS.log()[None].repeat(4000, 1)
    params = SamplingParams(temperature=1.0)
    res = sample(logits, [SampleRow(params, seed=i) for i in range(4000)], kernel=KERNEL)
    counts = torch.bincount(torch.tensor(res.token_ids), minlength=5).float() / 4000
    assert torch.allclose(counts, PROBS, atol=0.03)


def test_truncation_and_alternatives_take_the_reference_path():
    logits = torch.randn(2, 10)
    assert sampler_mod._fused_kernel(KERNEL, logits, [SampleRow(SamplingParams(top_p=0.9), seed=0)]) is None
    assert sampler_mod._fused_kernel(KERNEL, logits, [SampleRow(SamplingParams(logprobs=2), seed=0)]) is None
    assert sampler_mod._fused_kernel(KERNEL, logits, [SampleRow(SamplingParams(), seed=0, banned_token_ids=(3,))]) is None


def test_a_top_p_below_float32_keeps_the_most_probable_token():
    """top_p = 5e-324 is in (0, 1] but 0 in float32 (schemathesis sent it): the kept set is the top token,
    ties included, never empty."""
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.4, 0.2, 0.4]])
    ones = torch.ones(2)
    keep = truncation_mask(probs, torch.full((2,), 3), torch.tensor([5e-324, 5e-324]), torch.zeros(2))
    assert keep.tolist() == [[False, True, False], [True, False, True]]
    logp, log_kept = processed_logprobs(probs.log(), ones, torch.full((2,), 3), torch.tensor([5e-324, 1.0]),
                                        torch.zeros(2))
    assert logp[0].tolist() == [-math.inf, 0.0, -math.inf] and log_kept[0].item() == pytest.approx(math.log(0.6))
    assert SamplingParams(top_p=5e-324).top_p == 5e-324
