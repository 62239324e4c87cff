"""Rollout correction for RL trainers: importance weights, masks, mismatch metrics, and the
trainer-side logprob helper whose semantics the engine's sampler follows.

Notation. Tensors are ``[batch, response_len]``; ``mask`` is 1 on real response tokens and 0 on
padding. The rollout (engine) distribution is the behaviour distribution the samples came from::

    log r_t = train_logprob_t - rollout_logprob_t        r_t = exp(log r_t)
    log R   = sum over the sequence's masked tokens of log r_t       R = exp(log R)

Everything is computed in float32 on detached inputs (only ``trainer_logprobs`` keeps the
graph, since its output feeds the loss). Padding positions get weight 0 / mask 0 whatever the
logprobs hold there, inf and nan included.
"""

import math
from typing import Any, Literal

import torch
from torch import Tensor

from fp8engine.model_executor.layers.sampler import truncation_mask

TIS_CLIP = 2.0
"""Default TIS clip C; ``clip_frac`` in the metrics counts tokens with r > TIS_CLIP."""
MIS_BOUNDS = (0.5, 2.0)
"""Default MIS interval; ``mis_frac`` in the metrics counts tokens with r outside it."""
MAX_CHI2_LOG_RATIO = 30.0
"""Chi-square clamps each log-ratio at this value before squaring (r^2 <= e^60 ~ 1.1e26), so a
broken batch yields a huge finite number instead of inf; the value is exact whenever every ratio
is <= e^30 ~ 1.1e13."""

Level = Literal["token", "sequence"]
LogprobsMode = Literal["raw", "processed"]


def token_tis_weights(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                      clip: float = TIS_CLIP, lower_clip: float | None = None) -> Tensor:
    """Truncated importance sampling weights per token (detached, float32).

    ``w_t = min(max(exp(log r_t), lower_clip), clip)`` on masked tokens (no lower bound when
    ``lower_clip`` is None, e.g. pass ``1 / clip`` for a symmetric clip); ``w_t = 0`` on padding.
    exp overflows only to +inf, which the clip maps to C, so the result is always finite.
    """
    log_r, valid = _log_ratio(train_logprobs, rollout_logprobs, mask)
    return _clip(log_r.exp(), clip, lower_clip) * valid


def sequence_is_weights(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                        clip: float = TIS_CLIP, lower_clip: float | None = None) -> Tensor:
    """Sequence-level importance weights, broadcast to the sequence's tokens (detached, float32).

    ``w = min(max(exp(log R), lower_clip), clip)`` with ``log R = sum_t mask_t * log r_t``,
    summed in log space (a product of ratios would overflow); every masked token of the
    sequence gets ``w``, padding gets 0.
    """
    log_r, valid = _log_ratio(train_logprobs, rollout_logprobs, mask)
    return _clip(log_r.sum(-1, keepdim=True).exp(), clip, lower_clip) * valid


def mis_mask(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
             lower: float = MIS_BOUNDS[0], upper: float = MIS_BOUNDS[1],
             level: Level = "token") -> Tensor:
    """Masked importance sampling: float mask (float32) of the tokens to keep.

    ``level="token"``: 1 where ``lower <= r_t <= upper``.
    ``level="sequence"``: 1 on all of a sequence's tokens where ``lower <= R <= upper``,
    ``R = exp(sum_t mask_t * log r_t)``, else 0 on the whole sequence.
    Padding is always 0.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"mis_mask level must be 'token' or 'sequence', got {level!r}")
    if not 0.0 <= lower <= upper:
        raise ValueError(f"mis_mask needs 0 <= lower <= upper, got lower={lower}, upper={upper}")
    log_r, valid = _log_ratio(train_logprobs, rollout_logprobs, mask)
    ratio = log_r.exp() if level == "token" else log_r.sum(-1, keepdim=True).exp()
    return ((ratio >= lower) & (ratio <= upper) & valid).float()


def mismatch_metrics(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                     token_weight_versions: Tensor | None = None, current_version: int | None = None
                     ) -> dict[str, float]:
    """Train/rollout mismatch statistics.

    Token statistics are means over all masked tokens of the batch pooled together (n tokens,
    so long sequences weigh more); sequence statistics are means over the sequences that have
    at least one masked token. With r = exp(log r) per token and R per sequence:

    - ``k1 = mean(-log r)``, ``k3 = mean(r - 1 - log r)``: KL(rollout || train) estimators
      (k1 may be negative on a finite sample; k3 is >= 0).
    - ``ppl_train = exp(-mean(train_logprob))``, ``ppl_rollout = exp(-mean(rollout_logprob))``,
      ``ppl_ratio = ppl_train / ppl_rollout`` (= exp(k1), computed as exp(mean(rollout) -
      mean(train))).
    - ``chi2_token = mean(r^2) - 1``, ``chi2_seq = mean(R^2) - 1``, each log-ratio clamped at
      ``MAX_CHI2_LOG_RATIO`` before squaring.
    - ``is_mean``, ``is_std`` (population, correction=0), ``is_min``, ``is_max``: of the raw,
      unclipped token ratio r.
    - ``ess = (sum r)^2 / (n * sum r^2)``: normalised effective sample size in (0, 1].
    - ``clip_frac``: fraction of tokens with r > TIS_CLIP (2, the default TIS C).
    - ``mis_frac``: fraction of tokens with r outside MIS_BOUNDS ([0.5, 2], the default MIS).
    - ``mean_abs_ratio_dev = mean(exp|log r|)``: >= 1; under ~1.03-1.05 is considered healthy.

    With ``token_weight_versions`` ([batch, response_len], RolloutBatch.token_weight_versions) and the
    trainer's ``current_version`` (the newest version among the tokens when None), staleness: each token's lag
    = current_version - its version; ``staleness_mean``, ``staleness_max``, and ``tokens_at_lag_{k}`` (the
    fraction of tokens k versions behind, for each lag present).
    """
    log_r, valid = _log_ratio(train_logprobs, rollout_logprobs, mask)
    if not valid.any():
        raise ValueError("mismatch_metrics needs at least one response token; the mask is all 0")
    lr = log_r[valid]
    r = lr.exp()
    train = train_logprobs.detach().float()[valid]
    rollout = rollout_logprobs.detach().float()[valid]
    seq_lr = log_r.sum(-1)[valid.any(-1)]
    lo, hi = MIS_BOUNDS
    metrics = {
        "k1": (-lr).mean(),
        "k3": (torch.expm1(lr) - lr).mean(),
        "ppl_train": torch.exp(-train.mean()),
        "ppl_rollout": torch.exp(-rollout.mean()),
        "ppl_ratio": torch.exp(rollout.mean() - train.mean()),
        "chi2_token": _chi2(lr),
        "chi2_seq": _chi2(seq_lr),
        "is_mean": r.mean(),
        "is_std": r.std(correction=0),
        "is_min": r.min(),
        "is_max": r.max(),
        "ess": _ess(lr),
        "clip_frac": (r > TIS_CLIP).float().mean(),
        "mis_frac": ((r < lo) | (r > hi)).float().mean(),
        "mean_abs_ratio_dev": lr.abs().exp().mean(),
    }
    out = {name: value.item() for name, value in metrics.items()}
    if token_weight_versions is not None:
        out |= staleness(token_weight_versions, mask, current_version)
    return out


def staleness(token_weight_versions: Tensor, mask: Tensor, current_version: int | None = None) -> dict[str, float]:
    """How many weight versions behind the trainer the response tokens were sampled (see mismatch_metrics)."""
    versions = token_weight_versions[mask.bool()]
    if versions.numel() == 0:
        raise ValueError("staleness needs at least one response token; the mask is all 0")
    current = int(versions.max()) if current_version is None else int(current_version)
    lag = current - versions
    if bool((lag < 0).any()):
        raise ValueError(f"a token was sampled by weight version {int(versions.max())}, after current_version "
                         f"{current}")
    lags, counts = lag.unique(return_counts=True)
    out = {"staleness_mean": float(lag.float().mean()), "staleness_max": float(lag.max())}
    return out | {f"tokens_at_lag_{int(k)}": float(c) / lag.numel() for k, c in zip(lags, counts)}


def trainer_logprobs(logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0,
                     top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0,
                     mode: LogprobsMode = "processed") -> tuple[Tensor, Tensor]:
    """Logprobs of ``token_ids`` under the engine's sampling semantics (differentiable, float32).

    ``logits`` is ``[..., vocab]``, ``token_ids`` is ``[...]``; returns ``(logprobs,
    log_kept_mass)``, both ``[...]``.

    ``mode="raw"``: ``log_softmax(logits)[token]`` with no temperature or truncation;
    ``log_kept_mass = 0``. The sampling parameters are ignored (greedy is fine).

    ``mode="processed"``: the log-probability under the distribution actually sampled from.
    Requires ``temperature > 0`` (greedy is a point mass with no density). Exactly:

    1. ``p = softmax(logits / temperature)`` (the tempered distribution).
    2. top-k (``top_k >= 1``; -1 = off): ``K = {i : p_i >= v_k}`` with ``v_k`` the k-th largest
       ``p``; ties with ``v_k`` are all kept, so ``|K|`` may exceed k.
    3. top-p (``top_p < 1``; 1 = off), over the top-k renormalised distribution
       ``q_i = p_i [i in K] / sum_{j in K} p_j``: sort q descending; sorted position m is kept
       if ``sum_{l < m} q_(l) < top_p`` (the smallest prefix whose mass reaches top_p, the top
       token always kept); let ``v_p`` be the smallest kept ``q``; ``P = {i : q_i >= v_p}``, so
       ties with the boundary token are all kept and the set does not depend on sort order.
    4. min-p (``min_p > 0``; 0 = off): ``M = {i : p_i >= min_p * max_j p_j}`` on the tempered p
       (the ratio p_i / max p is the same after any renormalisation, so its place in the order
       does not matter).
    5. kept set ``S = K ∩ P ∩ M``; ``log_kept_mass = log(sum_{i in S} p_i)``;
       ``logprob = log p_token - log_kept_mass`` if the token is in S, else ``-inf``.

    A trainer that computes plain ``log_softmax(logits / temperature)`` can add
    ``log_kept_mass`` to the processed logprob to undo the renormalisation.
    """
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} must be logits shape "
                         f"{tuple(logits.shape)} without its last (vocab) dimension")
    index = token_ids.long().unsqueeze(-1)
    if mode == "raw":
        logp = logits.float().log_softmax(-1).gather(-1, index).squeeze(-1)
        return logp, torch.zeros_like(logp)
    if mode != "processed":
        raise ValueError(f"mode must be 'raw' or 'processed', got {mode!r}")
    _check_sampling(temperature, top_k, top_p, min_p)
    logp = (logits.float() / temperature if temperature != 1.0 else logits.float()).log_softmax(-1)
    if top_k == -1 and top_p >= 1.0 and min_p == 0.0:  # nothing truncated: S is the vocabulary, its mass 1
        token_logp = logp.gather(-1, index).squeeze(-1)
        return token_logp, torch.zeros_like(token_logp.detach())
    kept = _kept_set(logp.detach().exp(), top_k, top_p, min_p)
    log_kept_mass = logp.masked_fill(~kept, -math.inf).logsumexp(-1)
    token_logp = logp.gather(-1, index).squeeze(-1) - log_kept_mass
    token_kept = kept.gather(-1, index).squeeze(-1)
    return token_logp.masked_fill(~token_kept, -math.inf), log_kept_mass


def trainer_logprobs_from_params(logits: Tensor, token_ids: Tensor,
                                 sampling_params: Any) -> tuple[Tensor, Tensor]:
    """``trainer_logprobs`` with the settings read from a ``SamplingParams``-like object.

    Reads ``.temperature``, ``.top_k``, ``.top_p``, ``.min_p`` and ``.logprobs_mode``
    (duck-typed; a missing attribute raises AttributeError rather than guessing a default).
    """
    return trainer_logprobs(logits, token_ids, temperature=sampling_params.temperature,
                            top_k=sampling_params.top_k, top_p=sampling_params.top_p,
                            min_p=sampling_params.min_p, mode=sampling_params.logprobs_mode)


def _log_ratio(train_logprobs: Tensor, rollout_logprobs: Tensor,
               mask: Tensor) -> tuple[Tensor, Tensor]:
    """Validated, detached float32 ``log r`` (0 on padding) and the boolean token mask."""
    shapes = {"train_logprobs": train_logprobs.shape, "rollout_logprobs": rollout_logprobs.shape,
              "mask": mask.shape}
    if len(set(shapes.values())) != 1 or train_logprobs.dim() != 2:
        listed = ", ".join(f"{name} {tuple(shape)}" for name, shape in shapes.items())
        raise ValueError(f"expected tensors of one shape [batch, response_len], got {listed}")
    valid = mask.detach().bool()
    diff = train_logprobs.detach().float() - rollout_logprobs.detach().float()
    return torch.where(valid, diff, 0.0), valid


def _clip(ratio: Tensor, clip: float, lower_clip: float | None) -> Tensor:
    """``min(max(ratio, lower_clip), clip)`` after checking ``0 < lower_clip <= clip``."""
    if not clip > 0.0:
        raise ValueError(f"clip must be > 0, got {clip}")
    if lower_clip is not None and not 0.0 < lower_clip <= clip:
        raise ValueError(f"lower_clip must be in (0, clip={clip}], got {lower_clip}")
    return ratio.clamp(min=lower_clip, max=clip)


def _chi2(log_ratio: Tensor) -> Tensor:
    """``mean(w^2) - 1`` with ``w = exp(min(log_ratio, MAX_CHI2_LOG_RATIO))``, via expm1."""
    return torch.expm1(2.0 * log_ratio.clamp(max=MAX_CHI2_LOG_RATIO)).mean()


def _ess(log_ratio: Tensor) -> Tensor:
    """``(sum r)^2 / (n sum r^2)``, on ``r / max r`` so that no ratio overflows."""
    w = (log_ratio - log_ratio.max()).exp()
    return w.sum().square() / (w.numel() * w.square().sum())


def _check_sampling(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    if not temperature > 0.0:
        raise ValueError(f"processed logprobs need temperature > 0 (greedy has no density), "
                         f"got {temperature}")
    if top_k != -1 and top_k < 1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")


def _kept_set(p: Tensor, top_k: int, top_p: float, min_p: float) -> Tensor:
    """Boolean ``[..., vocab]`` mask of the kept set S: the engine sampler's own rule."""
    rows = p.reshape(-1, p.shape[-1])
    vocab = rows.shape[-1]
    n = rows.shape[0]
    k = torch.full((n,), vocab if top_k == -1 else min(top_k, vocab))
    kept = truncation_mask(rows, k, torch.full((n,), top_p), torch.full((n,), min_p))
    return kept.reshape(p.shape)
