"""Rollout-correction math against values computed by hand on small tensors."""

import math
from types import SimpleNamespace

import pytest
import torch

from fp8engine.rl.correction import (
    mis_mask,
    mismatch_metrics,
    sequence_is_weights,
    token_tis_weights,
    trainer_logprobs,
    trainer_logprobs_from_params,
)

LN2, LN3 = math.log(2.0), math.log(3.0)
NAN, INF = math.nan, math.inf
PAD = NAN  # log-ratio slot on padding; logprob_pair puts nan / -inf logprobs there anyway

# Two sequences of 3 slots; the second has one padding slot (two in MASK_SHORT).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
MASK_SHORT = torch.tensor([[1, 1, 1], [1, 0, 0]])


def logprob_pair(log_r: list[list[float]], mask: torch.Tensor = MASK):
    """(train, rollout) with rollout = -1 and train = -1 + log r on real tokens; on padding
    train = nan and rollout = -inf, which every function must ignore."""
    rollout = torch.where(mask.bool(), -1.0, -INF)
    train = torch.where(mask.bool(), rollout + torch.tensor(log_r), NAN)
    return train, rollout


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- token TIS

def test_token_tis_clips_above_at_c():
    # r = [3, 0.25, 1], [1.5, pad, pad]: min(3, 2) = 2, the rest pass; padding -> 0.
    train, rollout = logprob_pair([[LN3, math.log(0.25), 0.0], [math.log(1.5), PAD, PAD]],
                                  MASK_SHORT)
    w = token_tis_weights(train, rollout, MASK_SHORT)
    close(w, [[2.0, 0.25, 1.0], [1.5, 0.0, 0.0]])
    assert w.dtype == torch.float32


def test_token_tis_lower_clip_and_custom_c():
    # r = 0.25 -> max(0.25, 1/2) = 0.5; r = 3 with C = 4 stays 3; r = 1.5 stays.
    train, rollout = logprob_pair([[LN3, math.log(0.25), 0.0], [math.log(1.5), PAD, PAD]],
                                  MASK_SHORT)
    close(token_tis_weights(train, rollout, MASK_SHORT, lower_clip=0.5),
          [[2.0, 0.5, 1.0], [1.5, 0.0, 0.0]])
    close(token_tis_weights(train, rollout, MASK_SHORT, clip=4.0),
          [[3.0, 0.25, 1.0], [1.5, 0.0, 0.0]])


def test_token_tis_is_detached_and_finite_on_extreme_ratios():
    # log r = +1000 overflows exp to inf -> clipped to 2; -1000 underflows to 0 -> lower clip.
    train = torch.tensor([[1000.0, -1000.0]], requires_grad=True)
    rollout, mask = torch.zeros(1, 2), torch.ones(1, 2)
    w = token_tis_weights(train, rollout, mask, lower_clip=0.5)
    assert not w.requires_grad
    close(w, [[2.0, 0.5]])
    close(token_tis_weights(train, rollout, mask), [[2.0, 0.0]])


# ---------------------------------------------------------------- sequence IS

def test_sequence_is_broadcasts_clipped_sequence_ratio():
    # seq 0: log R = ln3 - ln2 + 0 = ln 1.5 -> w = 1.5 on all three tokens.
    # seq 1: log R = ln3 + ln3 = ln 9 -> min(9, 2) = 2 on its two tokens, 0 on padding.
    train, rollout = logprob_pair([[LN3, -LN2, 0.0], [LN3, LN3, PAD]])
    w = sequence_is_weights(train, rollout, MASK)
    close(w, [[1.5, 1.5, 1.5], [2.0, 2.0, 0.0]])
    assert not w.requires_grad


def test_sequence_is_lower_clip():
    # seq 0: log R = ln 0.1 -> 0.1, lower clip 0.5 -> 0.5. seq 1: log R = ln 1.5 -> 1.5.
    train, rollout = logprob_pair([[math.log(0.1), 0.0, 0.0], [LN3, -LN2, PAD]])
    close(sequence_is_weights(train, rollout, MASK), [[0.1, 0.1, 0.1], [1.5, 1.5, 0.0]])
    close(sequence_is_weights(train, rollout, MASK, lower_clip=0.5),
          [[0.5, 0.5, 0.5], [1.5, 1.5, 0.0]])


def test_sequence_is_survives_overflow():
    # log R = +1200 (exp -> inf) clips to C = 2; log R = -1200 (exp -> 0) gives 0.
    train, rollout = logprob_pair([[400.0, 400.0, 400.0], [-600.0, -600.0, PAD]])
    close(sequence_is_weights(train, rollout, MASK), [[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]])


# ---------------------------------------------------------------- MIS

def test_mis_mask_token_level():
    # r = [3, 1.5, 0.25], [0.6, 0.6, pad]; keep r in [0.5, 2]: [0, 1, 0], [1, 1, 0].
    train, rollout = logprob_pair([[LN3, math.log(1.5), math.log(0.25)],
                                   [math.log(0.6), math.log(0.6), PAD]])
    m = mis_mask(train, rollout, MASK)
    close(m, [[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert m.dtype == torch.float32
    # Wider interval [0.2, 4] keeps every real token.
    close(mis_mask(train, rollout, MASK, lower=0.2, upper=4.0), [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_mis_mask_sequence_level():
    # seq 0: R = 3 * 1.5 * 0.25 = 1.125 in [0.5, 2] -> whole sequence kept, although two of
    # its tokens fail the token test; seq 1: R = 0.6 * 0.6 = 0.36 < 0.5 -> whole sequence masked.
    train, rollout = logprob_pair([[LN3, math.log(1.5), math.log(0.25)],
                                   [math.log(0.6), math.log(0.6), PAD]])
    close(mis_mask(train, rollout, MASK, level="sequence"), [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    # With lower = 0.3, seq 1 (0.36) is kept on its real tokens only.
    close(mis_mask(train, rollout, MASK, lower=0.3, level="sequence"),
          [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_mis_mask_rejects_bad_level_and_bounds():
    train, rollout = logprob_pair([[0.0, 0.0, 0.0], [0.0, 0.0, PAD]])
    with pytest.raises(ValueError, match="'batch'"):
        mis_mask(train, rollout, MASK, level="batch")
    with pytest.raises(ValueError, match="lower"):
        mis_mask(train, rollout, MASK, lower=2.0, upper=0.5)


# ---------------------------------------------------------------- metrics

def test_mismatch_metrics_by_hand():
    # Real tokens: rollout logprob -1 everywhere, log r = [ln3, 0, -ln3], [ln4, 0] (n = 5),
    # so r = [3, 1, 1/3, 4, 1] and sum log r = 2 ln2; sequence ratios R = [1, 4].
    train, rollout = logprob_pair([[LN3, 0.0, -LN3], [2 * LN2, 0.0, PAD]])
    got = mismatch_metrics(train, rollout, MASK)
    expected = {
        "k1": -0.27725887,             # -(2 ln2) / 5
        "k3": 0.58940779,              # [(3-1-ln3) + 0 + (1/3-1+ln3) + (4-1-ln4) + 0] / 5
        "ppl_train": 2.06007240,       # exp(-mean(train)) = exp(1 - 2 ln2 / 5)
        "ppl_rollout": math.e,         # exp(1)
        "ppl_ratio": 0.75785828,       # 2^(-2/5) = exp(k1)
        "chi2_token": 4.42222222,      # (9 + 1 + 1/9 + 16 + 1) / 5 - 1 = 244/45 - 1
        "chi2_seq": 7.5,               # (1 + 16) / 2 - 1
        "is_mean": 1.86666667,         # (28/3) / 5
        "is_std": 1.39204087,          # sqrt(244/45 - (28/15)^2) = sqrt(1.93777...)
        "is_min": 1 / 3,
        "is_max": 4.0,
        "ess": 0.64262295,             # (28/3)^2 / (5 * 244/9) = 784 / 1220
        "clip_frac": 0.4,              # r in {3, 4} exceed 2
        "mis_frac": 0.6,               # r in {3, 1/3, 4} outside [0.5, 2]
        "mean_abs_ratio_dev": 2.4,     # (3 + 1 + 3 + 4 + 1) / 5
    }
    assert set(got) == set(expected)
    assert all(isinstance(v, float) for v in got.values())
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5), name


def test_mismatch_metrics_identical_policies():
    # r = 1 everywhere: no mismatch, ESS 1, nothing clipped or masked.
    train, rollout = logprob_pair([[0.0, 0.0, 0.0], [0.0, 0.0, PAD]])
    got = mismatch_metrics(train, rollout, MASK)
    for name in ("k1", "k3", "chi2_token", "chi2_seq", "is_std", "clip_frac", "mis_frac"):
        assert got[name] == pytest.approx(0.0, abs=1e-7), name
    for name in ("ppl_ratio", "is_mean", "is_min", "is_max", "ess", "mean_abs_ratio_dev"):
        assert got[name] == pytest.approx(1.0, abs=1e-7), name


def test_mismatch_metrics_stay_finite_on_huge_ratios():
    # log r = [100, 100, 0], [0, 0]: r^2 and R^2 (log R = 200) would overflow float32; chi2
    # clamps each log ratio at 30 first, so chi2_seq = mean(e^60, 1) - 1 = (e^60 - 1) / 2.
    train, rollout = logprob_pair([[100.0, 100.0, 0.0], [0.0, 0.0, PAD]])
    got = mismatch_metrics(train, rollout, MASK)
    assert math.isfinite(got["chi2_seq"]) and math.isfinite(got["chi2_token"])
    assert got["chi2_seq"] == pytest.approx(math.expm1(60.0) / 2, rel=1e-5)
    # ESS on r / max r = [1, 1, ~0, ~0, ~0]: 2^2 / (5 * 2) = 0.4.
    assert got["ess"] == pytest.approx(0.4, rel=1e-5)


def test_mismatch_metrics_errors():
    train, rollout = logprob_pair([[0.0, 0.0, 0.0], [0.0, 0.0, PAD]])
    with pytest.raises(ValueError, match="at least one response token"):
        mismatch_metrics(train, rollout, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"rollout_logprobs \(2, 4\)"):
        mismatch_metrics(train, torch.zeros(2, 4), MASK)


@pytest.mark.parametrize("fn", [token_tis_weights, sequence_is_weights, mis_mask])
def test_shape_errors_name_the_shapes(fn):
    with pytest.raises(ValueError, match=r"mask \(2, 2\)"):
        fn(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"train_logprobs \(6,\)"):
        fn(torch.zeros(6), torch.zeros(6), torch.ones(6))


def test_clip_arguments_validated():
    train, rollout = logprob_pair([[0.0, 0.0, 0.0], [0.0, 0.0, PAD]])
    with pytest.raises(ValueError, match="clip must be > 0"):
        token_tis_weights(train, rollout, MASK, clip=0.0)
    with pytest.raises(ValueError, match="lower_clip"):
        sequence_is_weights(train, rollout, MASK, lower_clip=3.0)


def test_bf16_inputs_computed_in_float32():
    train = torch.tensor([[LN3, 0.0]], dtype=torch.bfloat16)
    w = token_tis_weights(train, torch.zeros(1, 2, dtype=torch.bfloat16), torch.ones(1, 2))
    assert w.dtype == torch.float32
    close(w, [[2.0, 1.0]])


# ---------------------------------------------------------------- trainer_logprobs

# Tempered distribution q over 5 tokens; logits = 0.5 * log q so softmax(logits / 0.5) = q.
Q = [0.4, 0.3, 0.15, 0.12, 0.03]
LOGITS = 0.5 * torch.tensor(Q).log()
ALL_TOKENS = torch.arange(5)
T = 0.5


def processed(**kwargs):
    return trainer_logprobs(LOGITS.expand(5, 5), ALL_TOKENS, temperature=T, **kwargs)


def expect(logprobs, log_mass, kept: list[int], mass: float):
    """Kept tokens: log(q_i / mass); others -inf; log_kept_mass = log(mass) for every row."""
    want = [math.log(Q[i] / mass) if i in kept else -INF for i in range(5)]
    torch.testing.assert_close(logprobs, torch.tensor(want), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(log_mass, torch.full((5,), math.log(mass)), rtol=1e-5, atol=1e-6)


def test_processed_temperature_only():
    # No truncation: logprob = log q_i, kept mass 1.
    expect(*processed(), kept=[0, 1, 2, 3, 4], mass=1.0)


def test_processed_top_k():
    # top_k = 3 keeps {0.4, 0.3, 0.15}, mass 0.85.
    expect(*processed(top_k=3), kept=[0, 1, 2], mass=0.85)


def test_processed_top_p():
    # Mass before each sorted token: 0, 0.4, 0.7, 0.85, 0.97; < 0.8 keeps tokens 0, 1, 2.
    expect(*processed(top_p=0.8), kept=[0, 1, 2], mass=0.85)


def test_processed_min_p():
    # Threshold 0.1 * 0.4 = 0.04 drops only q = 0.03; mass 0.97.
    expect(*processed(min_p=0.1), kept=[0, 1, 2, 3], mass=0.97)


def test_processed_all_filters_in_order():
    # top-k 3 -> {0, 1, 2}, renormalised [0.4, 0.3, 0.15] / 0.85 = [0.4706, 0.3529, 0.1765];
    # mass before: 0, 0.4706, 0.8235 -> top-p 0.8 keeps {0, 1} (on the un-renormalised q,
    # 0.7 < 0.8 would keep token 2: this pins the order); min-p 0.1 removes nothing more.
    # Kept mass 0.7: logprobs log(4/7), log(3/7), -inf, -inf, -inf.
    logprobs, log_mass = processed(top_k=3, top_p=0.8, min_p=0.1)
    expect(logprobs, log_mass, kept=[0, 1], mass=0.7)
    assert logprobs[0].item() == pytest.approx(math.log(4 / 7), rel=1e-6)


def test_ties_are_all_kept():
    # q = [0.4, 0.2, 0.2, 0.2] (logits = log q at T = 1).
    logits = torch.tensor([0.4, 0.2, 0.2, 0.2]).log().expand(4, 4)
    tokens = torch.arange(4)
    # top_k = 2: the 2nd largest is 0.2, tied three ways -> all four kept, mass 1.
    logprobs, log_mass = trainer_logprobs(logits, tokens, top_k=2)
    close(logprobs.unsqueeze(0), [[math.log(0.4), math.log(0.2), math.log(0.2), math.log(0.2)]])
    close(log_mass.unsqueeze(0), [[0.0] * 4])
    # top_p = 0.5: mass before sorted = 0, 0.4, 0.6 -> boundary q = 0.2, all its ties kept.
    logprobs, _ = trainer_logprobs(logits, tokens, top_p=0.5)
    assert torch.isfinite(logprobs).all()
    # top_p = 0.35: only the top token (mass before the second is 0.4, not < 0.35).
    logprobs, log_mass = trainer_logprobs(logits, tokens, top_p=0.35)
    close(logprobs.unsqueeze(0), [[0.0, -INF, -INF, -INF]])
    close(log_mass.unsqueeze(0), [[math.log(0.4)] * 4])


def test_raw_mode_ignores_sampling_params():
    # raw = log_softmax(logits) = log(sqrt(q_i) / sum_j sqrt(q_j)), sum sqrt(q) = 2.0870917.
    logprobs, log_mass = trainer_logprobs(LOGITS.expand(5, 5), ALL_TOKENS, temperature=0.0,
                                          top_k=1, mode="raw")
    want = [0.5 * math.log(q) - math.log(2.0870917) for q in Q]
    torch.testing.assert_close(logprobs, torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert torch.equal(log_mass, torch.zeros(5))


def test_from_params_reads_attributes():
    params = SimpleNamespace(temperature=T, top_k=3, top_p=0.8, min_p=0.1,
                             logprobs_mode="processed")
    expect(*trainer_logprobs_from_params(LOGITS.expand(5, 5), ALL_TOKENS, params),
           kept=[0, 1], mass=0.7)
    raw = SimpleNamespace(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, logprobs_mode="raw")
    logprobs, _ = trainer_logprobs_from_params(LOGITS.expand(5, 5), ALL_TOKENS, raw)
    assert logprobs[0].item() == pytest.approx(0.5 * math.log(0.4) - math.log(2.0870917), rel=1e-5)


def test_kept_mass_restores_untruncated_logprob_and_grads_flow():
    # Seeded random batch: processed + log_kept_mass == log_softmax(logits / T) on kept tokens.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 50, generator=gen, requires_grad=True)
    tokens = logits.detach().argmax(-1)   # the top token survives every filter
    logprobs, log_mass = trainer_logprobs(logits, tokens, temperature=0.7, top_k=10, top_p=0.9,
                                          min_p=0.05)
    plain = (logits / 0.7).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs + log_mass, plain)
    assert (log_mass <= 0).all() and (logprobs >= plain).all()
    logprobs.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_trainer_logprobs_errors():
    tokens = ALL_TOKENS
    logits = LOGITS.expand(5, 5)
    with pytest.raises(ValueError, match="temperature > 0"):
        trainer_logprobs(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="'sampled'"):
        trainer_logprobs(logits, tokens, mode="sampled")
    with pytest.raises(ValueError, match="top_k"):
        trainer_logprobs(logits, tokens, top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        trainer_logprobs(logits, tokens, top_p=0.0)
    with pytest.raises(ValueError, match="min_p"):
        trainer_logprobs(logits, tokens, min_p=1.5)
    with pytest.raises(ValueError, match=r"token_ids shape \(4,\)"):
        trainer_logprobs(logits, torch.arange(4))
