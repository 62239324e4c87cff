"""Sampler: greedy, temperature, top-k, top-p, min-p, with logprobs in raw or processed mode.

The processed distribution (what tokens are actually drawn from), for temperature T > 0:
    p = softmax(logits / T)
    keep top-k: tokens whose p is >= the k-th largest p (ties kept)
    keep top-p: over p renormalised on the top-k set and sorted descending, a token is kept while
                the mass strictly before it is < top_p
    keep min-p: tokens with p >= min_p * max(p)
    processed logprob = log p - log(kept mass), -inf outside the kept set.
`log_kept_mass` = log(sum of p over the kept set) is returned per token so a trainer that does not
truncate can remove the renormalisation. Greedy (T = 0) is a point mass: processed logprob 0.
Sampling inverts the CDF of p_kept with one uniform number from each sequence's own generator.
On CPU, batches without truncation, banned tokens or top-k alternatives take a fused C++ kernel
(csrc/sampler.cpp) with the same definition; this module is its reference.
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from fp8engine.model_executor.kernels.cpu_ops import cpu_kernel
from fp8engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    generator: torch.Generator
    banned_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    log_kept_mass: list[float | None]


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Kept set [R, V] (bool) for tempered probs [R, V]; top_k [R] (vocab size = off), top_p, min_p [R].

    Ties at the top-k and top-p boundaries are all kept, so the set does not depend on sort order.
    """
    vocab = probs.shape[-1]
    keep = torch.ones_like(probs, dtype=torch.bool)
    if bool((top_k < vocab).any()):
        sorted_p = probs.sort(dim=-1, descending=True).values
        keep = probs >= sorted_p.gather(1, (top_k - 1).clamp(0, vocab - 1)[:, None])
    if bool((top_p < 1.0).any()):
        q = probs * keep
        keep &= _top_p_set(q / q.sum(dim=-1, keepdim=True), top_p)
    return keep & (probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True))


def _top_p_set(q: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_q = q.sort(dim=-1, descending=True).values
    mass_before = F.pad(sorted_q.cumsum(dim=-1)[:, :-1], (1, 0))
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True)
    return q >= sorted_q.gather(1, num_kept - 1)


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(processed logprobs [R, V], log kept mass [R]) for float32 logits and per-row params (T > 0)."""
    tempered = logits if bool((temperature == 1.0).all()) else logits / temperature[:, None]
    logp = torch.log_softmax(tempered, dim=-1)
    if not (bool((top_k < logits.shape[-1]).any()) or bool((top_p < 1.0).any()) or bool((min_p > 0).any())):
        return logp, torch.zeros(logits.shape[0])
    mask = truncation_mask(logp.exp(), top_k, top_p, min_p)
    log_kept = torch.logsumexp(logp.masked_fill(~mask, float("-inf")), dim=-1)
    return (logp - log_kept[:, None]).masked_fill(~mask, float("-inf")), log_kept


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """Sample one token per row of logits [R, V] (any float dtype)."""
    kernel = _fused_kernel(logits, rows)
    if kernel is not None:
        return _sample_fused(kernel, logits, rows)
    logits = logits.to(torch.float32, copy=True)  # banned tokens are masked in place
    raw = torch.log_softmax(logits, dim=-1) if any(_wants(r, "raw") for r in rows) else None
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    tokens = torch.zeros(len(rows), dtype=torch.int64)
    if len(sampled) < len(rows):
        tokens = logits.argmax(dim=-1)
    proc, log_kept = None, None
    if sampled:
        subset = logits if len(sampled) == len(rows) else logits[sampled]
        proc, log_kept = _processed_rows(subset, [rows[i] for i in sampled])
        tokens[sampled] = _draw(proc.exp(), [rows[i].generator for i in sampled])
    return _collect(tokens, rows, raw, proc, log_kept, sampled)


def _fused_kernel(logits: torch.Tensor, rows: list[SampleRow]):
    """The fused C++ sampler when it covers this batch, else None."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    if any(r.params.truncates or r.params.logprobs or r.banned_token_ids for r in rows):
        return None
    return cpu_kernel("sample_rows")


def _sample_fused(kernel, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
    uniform = torch.cat([torch.rand(1, generator=r.generator) if not r.params.greedy else torch.zeros(1)
                         for r in rows])
    tokens, processed, raw = kernel(logits, temperature, uniform, any(_wants(r, "raw") for r in rows))
    result = SampleResult(tokens.tolist(), [None] * len(rows), [None] * len(rows), [None] * len(rows))
    processed, raw = processed.tolist(), raw.tolist()
    for i, row in enumerate(rows):
        if row.params.logprobs is None:
            continue
        if row.params.logprobs_mode == "raw":
            result.logprobs[i] = raw[i]
        else:
            result.logprobs[i], result.log_kept_mass[i] = processed[i], 0.0
    return result


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [R, V] by inverse CDF; zero-probability tokens are never drawn."""
    cdf = probs.cumsum(dim=-1)
    uniform = torch.cat([torch.rand(1, generator=g) for g in generators])
    target = (1.0 - uniform) * cdf[:, -1]  # in (0, total]
    return torch.searchsorted(cdf, target[:, None]).squeeze(1).clamp(max=probs.shape[1] - 1)


def _wants(row: SampleRow, mode: str) -> bool:
    return row.params.logprobs is not None and row.params.logprobs_mode == mode


def _processed_rows(logits: torch.Tensor, rows: list[SampleRow]):
    vocab = logits.shape[1]
    p = [r.params for r in rows]
    temperature = torch.tensor([x.temperature for x in p])
    top_k = torch.tensor([vocab if x.top_k == -1 else min(x.top_k, vocab) for x in p])
    top_p = torch.tensor([x.top_p for x in p])
    min_p = torch.tensor([x.min_p for x in p])
    return processed_logprobs(logits, temperature, top_k, top_p, min_p)


def _collect(tokens, rows, raw, proc, log_kept, sampled) -> SampleResult:
    token_list = tokens.tolist()
    result = SampleResult(token_list, [None] * len(rows), [None] * len(rows), [None] * len(rows))
    proc_row = {row: j for j, row in enumerate(sampled)}
    for i, row in enumerate(rows):
        k = row.params.logprobs
        if k is None:
            continue
        token = token_list[i]
        if row.params.logprobs_mode == "raw":
            dist, kept = raw[i], None
        elif i in proc_row:
            dist, kept = proc[proc_row[i]], float(log_kept[proc_row[i]])
        else:
            dist, kept = None, 0.0
        result.log_kept_mass[i] = kept
        result.logprobs[i] = 0.0 if dist is None else float(dist[token])
        result.top_logprobs[i] = _top(dist, token, k) if k > 0 else None
    return result


def _top(dist: torch.Tensor | None, token: int, k: int) -> dict[int, float]:
    if dist is None:
        return {token: 0.0}
    values, ids = dist.topk(k)
    top = dict(zip(ids.tolist(), values.tolist()))
    top.setdefault(token, float(dist[token]))
    return top
