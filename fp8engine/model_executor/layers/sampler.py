"""Sampler: greedy, temperature, top-k, top-p, min-p, with logprobs in raw or processed mode.

The processed distribution (what tokens are actually drawn from), for temperature T > 0:
    p = softmax(logits / T)
    keep top-k: tokens whose p is >= the k-th largest p (ties kept)
    keep top-p: over p renormalised on the top-k set and sorted descending, a token is kept while
                the mass strictly before it is < top_p
    keep min-p: tokens with p >= min_p * max(p)
    processed logprob = log p - log(kept mass), -inf outside the kept set.
`log_kept_mass` = log(sum of p over the kept set) is returned per token so a trainer that does not
truncate can remove the renormalisation. A structured-output row (SampleRow.allowed, structured.py) keeps only
the tokens its grammar allows: top-k, top-p and min-p act on p renormalised over those, the kept set lies inside
them, and log_kept_mass includes the mask's share; greedy takes the argmax over allowed tokens.
Greedy (T = 0) is a point mass: processed logprob 0.
Penalties and logit_bias (`adjust_logits`) act on the logits first: they shape p and greedy's argmax,
never raw logprobs.
Sampling inverts the CDF of p_kept at 1 - u, where u = `sampling_uniforms(seed, index, position)`
is a counter-based hash of the request's seed, the sample's index and the position of the token
being drawn: the noise of a token depends on nothing else (batch, preemption, earlier draws).
On CPU, rows without truncation, adjustments, banned tokens or top-k alternatives take a fused C++ kernel
(csrc/sampler.cpp, the kernel set's sample_rows) with the same definition and the same uniforms; this module is
its reference. On CUDA those rows take `sample_rows_torch`, the reference's ops for them without a host
synchronisation (a decode step's CUDA graph replays it after the model: cuda_graphs.DecodeGraphs.sample).
The two sum the CDF in different orders, so at a float32 near-tie (1 - u within rounding of a CDF
step) they may pick neighbouring tokens; which path a row takes depends on that row alone.
"""

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from fp8engine.sampling_params import SamplingParams


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


@dataclass(slots=True)
class SampleRow:
    """One row to sample: its params and the (seed, sample index, position) that fix its noise."""

    params: SamplingParams
    seed: int
    index: int = 0
    position: int = 0
    banned_token_ids: tuple[int, ...] = ()
    prompt_token_ids: list[int] = field(default_factory=list)  # read by repetition_penalty only
    output_token_ids: list[int] = field(default_factory=list)  # read by the penalties only
    allowed: torch.Tensor | None = None  # bool [V]: the tokens a structured output's grammar allows here


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    log_kept_mass: list[float | None]


def sampling_uniforms(seeds: list[int], indices: list[int], positions: list[int]) -> torch.Tensor:
    """Sampling noise [R] (float32 in [0, 1), 24 random bits) for each (seed, sample index, position).

    A stateless hash, splitmix64's finaliser chained over seed, index and position (seeds are
    taken mod 2**64), so a token's noise is the same whatever else is drawn before or beside it.
    """
    if len(seeds) <= _INT_HASH_MAX_ROWS:  # the same hash on Python ints: ~30 tensor ops cost more at a few rows
        return torch.tensor([_uniform(s, i, p) for s, i, p in zip(seeds, indices, positions)], dtype=torch.float32)
    seed = torch.tensor([_as_int64(s) for s in seeds], dtype=torch.int64)
    gamma = _as_int64(_GAMMA)
    h = _mix64(seed + gamma)
    h = _mix64(h ^ (torch.tensor(indices, dtype=torch.int64) + gamma))
    h = _mix64(h ^ (torch.tensor(positions, dtype=torch.int64) + gamma))
    return _shift_right(h, 40).to(torch.float32) * 2.0**-24


# Rows up to which sampling_uniforms hashes on Python ints (a few us a row) rather than tensors (~0.3 ms a
# call, whatever the rows; at batch 1 that was 2-3% of a decode step; 32 rows: 95 vs 268 us).
_INT_HASH_MAX_ROWS = 64


def _uniform(seed: int, index: int, position: int) -> float:
    """sampling_uniforms for one row, on Python ints (uint64 arithmetic by masking): the same bits."""
    h = _mix64_int((seed + _GAMMA) & _MASK64)
    h = _mix64_int(h ^ ((index + _GAMMA) & _MASK64))
    h = _mix64_int(h ^ ((position + _GAMMA) & _MASK64))
    return (h >> 40) * 2.0**-24  # 24 bits: exact in float32


def _mix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _as_int64(value: int) -> int:
    """The int64 with the bits of value mod 2**64 (torch int64 arithmetic wraps like uint64)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical: int64 >> sign-extends


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _as_int64(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _as_int64(0x94D049BB133111EB)
    return z ^ _shift_right(z, 31)


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Kept set [R, V] (bool) for tempered probs [R, V]; top_k [R] (vocab size = off), top_p, min_p [R].

    Ties at the top-k and top-p boundaries are all kept, so the set does not depend on sort order.
    The parameters may be host tensors where probs is on a device: which truncations run is decided from them
    on the host (no device synchronisation), and they are copied to probs' device for the arithmetic.
    """
    vocab = probs.shape[-1]
    any_top_k, any_top_p, any_min_p = bool((top_k < vocab).any()), bool((top_p < 1.0).any()), bool((min_p > 0).any())
    top_k, top_p, min_p = (t.to(probs.device) for t in (top_k, top_p, min_p))
    keep = torch.ones_like(probs, dtype=torch.bool)
    if any_top_k:
        sorted_p = probs.sort(dim=-1, descending=True).values
        keep = probs >= sorted_p.gather(1, (top_k - 1).clamp(0, vocab - 1)[:, None])
    if any_top_p:
        q = probs * keep
        keep &= _top_p_set(q / _row_sums(q), top_p) | (top_p >= 1.0)[:, None]
    if any_min_p:  # min_p = 0 keeps every token (p >= 0): skipped, the same set
        keep &= probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return keep


def _top_p_set(q: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_q = q.sort(dim=-1, descending=True).values
    mass_before = F.pad(sorted_q.cumsum(dim=-1)[:, :-1], (1, 0))
    # At least the most probable token: a top_p that rounds to 0 in float32 (5e-324) keeps the top one.
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp(min=1)
    return q >= sorted_q.gather(1, num_kept - 1)


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """[R, 1] sums of the rows of x, each added left to right: torch's sum and logsumexp split a row across
    threads when there are few rows, so their bits would depend on how many rows are in the batch."""
    return x.cumsum(dim=-1)[:, -1:]


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor,
                       allowed: torch.Tensor | None = None,
                       masked: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(processed logprobs [R, V], log kept mass [R]) for float32 logits and per-row params (T > 0), on the logits'
    device; the params may be host tensors (see truncation_mask). allowed: bool [R, V] on the logits' device, the
    tokens each row's grammar allows, and masked: bool [R] on the host, the rows that have a grammar (both None:
    no row has one); truncation acts within the allowed tokens."""
    device = logits.device
    tempered = logits if bool((temperature == 1.0).all()) else logits / temperature.to(device)[:, None]
    logp = torch.log_softmax(tempered, dim=-1)
    truncates = (top_k < logits.shape[-1]) | (top_p < 1.0) | (min_p > 0)
    if masked is not None:
        truncates = truncates | masked
    if not bool(truncates.any()):
        return logp, torch.zeros(logits.shape[0], device=device)
    # Rows that do not truncate keep logp exactly, whatever the other rows ask for.
    probs = logp.exp()
    if allowed is not None:
        probs *= allowed
    mask = truncation_mask(probs, top_k, top_p, min_p)
    if allowed is not None:
        mask &= allowed
    truncates = truncates.to(device)
    mask |= ~truncates[:, None]
    kept = logp.masked_fill(~mask, float("-inf"))
    top = kept.amax(dim=-1, keepdim=True)  # a max is exact in any order; a lone kept token gives exactly top
    log_kept = (top + _row_sums((kept - top).exp()).log())[:, 0].masked_fill(~truncates, 0.0)
    return kept - log_kept[:, None], log_kept  # -inf stays -inf outside the kept set


def sample(logits: torch.Tensor, rows: list[SampleRow], forced: list[int] | None = None,
           kernel=None) -> SampleResult:
    """Sample one token per row of logits [R, V] (any float dtype).

    A row's path (fused kernel or reference) and its noise depend on that row alone, so its token
    and logprobs do not depend on the other rows of the batch.
    forced: one token per row to report instead of drawing (scoring a given sequence): its logprobs are
    computed by the same path and arithmetic as when that row drew it.
    kernel: the fused C++ sampler (the kernel set's sample_rows) for the rows it covers, or None.
    """
    uniform = sampling_uniforms([r.seed for r in rows], [r.index for r in rows], [r.position for r in rows])
    forced_t = None if forced is None else torch.tensor(forced, dtype=torch.int64)
    fused = [i for i, r in enumerate(rows) if _fusable(r)]
    kernel = _fused_kernel(kernel, logits, [rows[i] for i in fused]) if fused else None
    if kernel is None:
        return _sample_reference(logits, rows, uniform, forced_t)
    if len(fused) == len(rows):
        return _sample_fused(kernel, logits, rows, uniform, forced_t)
    rest = [i for i, r in enumerate(rows) if not _fusable(r)]
    part_of = (lambda idx: None) if forced_t is None else (lambda idx: forced_t[idx])  # noqa: E731
    result = SampleResult([0] * len(rows), [None] * len(rows), [None] * len(rows), [None] * len(rows))
    for part, got in ((fused, _sample_fused(kernel, logits[fused], [rows[i] for i in fused], uniform[fused],
                                            part_of(fused))),
                      (rest, _sample_reference(logits[rest], [rows[i] for i in rest], uniform[rest],
                                               part_of(rest)))):
        for j, i in enumerate(part):
            result.token_ids[i], result.logprobs[i] = got.token_ids[j], got.logprobs[j]
            result.top_logprobs[i], result.log_kept_mass[i] = got.top_logprobs[j], got.log_kept_mass[j]
    return result


def _sample_reference(logits: torch.Tensor, rows: list[SampleRow], uniform: torch.Tensor,
                      forced: torch.Tensor | None = None) -> SampleResult:
    """Every row in batched ops on the logits' device (CPU or CUDA); one copy of the results to the host."""
    device = logits.device
    logits = logits.to(torch.float32, copy=True)  # adjusted and banned in place
    raw = torch.log_softmax(logits, dim=-1) if any(_wants(r, "raw") for r in rows) else None
    for i, row in enumerate(rows):
        if row.params.adjusts_logits:
            adjust_logits(logits[i], row)
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")
    allowed = _allowed(rows, device)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    index = None if len(sampled) == len(rows) else torch.tensor(sampled, dtype=torch.int64, device=device)
    if forced is not None:
        tokens = forced.to(device)
    elif len(sampled) == len(rows):  # every row draws: no argmax needed
        tokens = torch.zeros(len(rows), dtype=torch.int64, device=device)
    else:
        tokens = (logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))).argmax(dim=-1)
    proc, log_kept = None, None
    if sampled:
        if index is not None:
            logits, allowed = logits[index], None if allowed is None else allowed[index]
        proc, log_kept = _processed_rows(logits, [rows[i] for i in sampled], allowed)
        if forced is None:
            drawn = _draw(proc.exp(), uniform[sampled])
            tokens = drawn if index is None else tokens.index_copy(0, index, drawn)
    return _collect(tokens, rows, raw, proc, log_kept, sampled)


def adjust_logits(logits: torch.Tensor, row: SampleRow) -> None:
    """Apply row.params' logit_bias, repetition, presence and frequency penalties (vLLM's order and
    rules) to one row of float32 logits [V], in place; element-wise, so batch invariant."""
    p = row.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
        logits.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                               device=logits.device))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.int64,
                            device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        ids, counts = torch.tensor(row.output_token_ids, dtype=torch.int64).unique(return_counts=True)
        ids = ids.to(logits.device)
        logits[ids] -= p.frequency_penalty * counts.to(logits) + p.presence_penalty


def _fusable(row: SampleRow) -> bool:
    p = row.params
    return not (p.truncates or p.logprobs or row.banned_token_ids or p.adjusts_logits or row.allowed is not None)


def _allowed(rows: list[SampleRow], device: torch.device) -> torch.Tensor | None:
    """[R, V] bool: each row's grammar mask (all True for rows without one), or None when no row has one."""
    masks = [r.allowed for r in rows]
    if all(m is None for m in masks):
        return None
    vocab = next(m for m in masks if m is not None).shape[0]
    everything = torch.ones(vocab, dtype=torch.bool)
    return torch.stack([everything if m is None else m for m in masks]).to(device)


def _fused_kernel(kernel, logits: torch.Tensor, rows: list[SampleRow]):
    """`kernel` (the fused sampler of the logits' device) when it covers these rows of these logits, else None;
    the C++ one takes float32 and BF16 logits."""
    if kernel is None or (logits.device.type == "cpu" and logits.dtype not in (torch.float32, torch.bfloat16)):
        return None
    return kernel if all(map(_fusable, rows)) else None


def sample_on_device(kernel, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor | None:
    """The device's [R, 3] of the fused sampler (sample_rows_torch's; see fused_result), left on the device, when
    `kernel` covers every row; else None. For a step whose host work overlaps the device's (LLMEngine's
    async_scheduling): its tokens feed the next step on the device, and the host reads them later."""
    if _fused_kernel(kernel, logits, rows) is None or logits.device.type == "cpu":
        return None
    uniform = sampling_uniforms([r.seed for r in rows], [r.index for r in rows], [r.position for r in rows])
    return _fused_rows(kernel, logits, rows, uniform)


def _fused_rows(kernel, logits: torch.Tensor, rows: list[SampleRow], uniform: torch.Tensor,
                forced: torch.Tensor | None = None):
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
    return kernel(logits, temperature, uniform, any(_wants(r, "raw") for r in rows), forced)


def _sample_fused(kernel, logits: torch.Tensor, rows: list[SampleRow], uniform: torch.Tensor,
                  forced: torch.Tensor | None = None) -> SampleResult:
    out = _fused_rows(kernel, logits, rows, uniform, forced)
    return fused_result(out.cpu() if isinstance(out, torch.Tensor) else out, rows)


def fused_result(out, rows: list[SampleRow]) -> SampleResult:
    """SampleResult from the fused sampler's output on the host: the C++ op's (tokens, processed, raw) tensors, or
    a device's [R, 3] float64 copied back in one piece (sample_rows_torch)."""
    if isinstance(out, torch.Tensor):
        tokens, processed, raw = zip(*out.tolist()) if len(out) else ((), (), ())
        tokens = [int(t) for t in tokens]
    else:
        tokens, processed, raw = (t.tolist() for t in out)
    result = SampleResult(tokens, [None] * len(rows), [None] * len(rows), [None] * len(rows))
    for i, row in enumerate(rows):
        if row.params.logprobs is None:
            continue
        if row.params.logprobs_mode == "raw":
            result.logprobs[i] = raw[i]
        else:
            result.logprobs[i], result.log_kept_mass[i] = processed[i], 0.0
    return result


def sample_rows_torch(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, need_raw: bool,
                      forced: torch.Tensor | None = None) -> torch.Tensor:
    """The fused sampler's contract (csrc/sampler.cpp's sample_rows: rows without truncation, adjustments, bans or
    top-k alternatives) in torch ops on the logits' device, for a device without the C++ op: [R, 3] float64 of
    (token, processed logprob at it, raw logprob at it or 0 without need_raw), so the host reads it in one copy.
    temperature, uniform [R] (and forced [R]) on the logits' device. Per row the same ops and rounding as
    _sample_reference gives that row (x / 1.0 is x; greedy rows: argmax, a point mass), so the two agree bit for
    bit; no host synchronisation, so a CUDA graph can hold it (cuda_graphs.DecodeGraphs.sample)."""
    logits = logits.to(torch.float32)
    draws = temperature > 0
    logp = torch.log_softmax(logits / torch.where(draws, temperature, 1.0)[:, None], dim=-1)
    if forced is not None:
        tokens = forced
    else:
        tokens = torch.where(draws, _draw(logp.exp(), uniform), logits.argmax(dim=-1))
    at = tokens[:, None]
    processed = torch.where(draws, logp.gather(1, at)[:, 0], 0.0)
    raw = torch.log_softmax(logits, dim=-1).gather(1, at)[:, 0] if need_raw else torch.zeros_like(processed)
    return torch.stack([tokens.to(torch.float64), processed.to(torch.float64), raw.to(torch.float64)], dim=1)


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [R, V] by inverse CDF at 1 - uniform [R]; zero-probability tokens
    are never drawn."""
    cdf = probs.cumsum(dim=-1)
    uniform = uniform.to(probs.device)
    target = (1.0 - uniform) * cdf[:, -1]  # in (0, total]
    return torch.searchsorted(cdf, target[:, None]).squeeze(1).clamp(max=probs.shape[1] - 1)


def _wants(row: SampleRow, mode: str) -> bool:
    return row.params.logprobs is not None and row.params.logprobs_mode == mode


def _processed_rows(logits: torch.Tensor, rows: list[SampleRow], allowed: torch.Tensor | None = None):
    """processed_logprobs of these rows; their params as host tensors (processed_logprobs moves them)."""
    vocab = logits.shape[1]
    p = [r.params for r in rows]
    temperature = torch.tensor([x.temperature for x in p])
    top_k = torch.tensor([vocab if x.top_k == -1 else min(x.top_k, vocab) for x in p])
    top_p = torch.tensor([x.top_p for x in p])
    min_p = torch.tensor([x.min_p for x in p])
    masked = None if allowed is None else torch.tensor([r.allowed is not None for r in rows])
    return processed_logprobs(logits, temperature, top_k, top_p, min_p, allowed, masked)


def _collect(tokens: torch.Tensor, rows: list[SampleRow], raw, proc, log_kept, sampled: list[int]) -> SampleResult:
    """Each row's token, the logprob of its mode's distribution at it (raw: log-softmax of the logits; processed:
    proc's row, or a point mass for greedy rows), log kept mass and top-k alternatives; gathered on the device
    in batched ops, then copied to the host in one piece."""
    proc_row = {row: j for j, row in enumerate(sampled)}
    # (row, the tensor holding its distribution, that tensor's row) for rows that report one
    reported = [(i, raw, i) if r.params.logprobs_mode == "raw" else (i, proc, proc_row[i])
                for i, r in enumerate(rows)
                if r.params.logprobs is not None and (r.params.logprobs_mode == "raw" or i in proc_row)]
    pieces, shapes = [tokens.to(torch.float64)], []
    if reported:
        dist = torch.cat([src[[j for _, s, j in reported if s is src]] for src in (raw, proc)
                          if any(s is src for _, s, _ in reported)])
        order = [i for src in (raw, proc) for i, s, _ in reported if s is src]
        index = torch.tensor(order, dtype=torch.int64, device=tokens.device)
        pieces.append(dist.gather(1, tokens[index][:, None])[:, 0].to(torch.float64))
        kept_rows = [proc_row[i] for i in order if rows[i].params.logprobs_mode != "raw"]
        if kept_rows:
            pieces.append(log_kept[kept_rows].to(torch.float64))
        for k in sorted({rows[i].params.logprobs for i in order} - {0}):
            at = [n for n, i in enumerate(order) if rows[i].params.logprobs == k]
            values, ids = dist[at].topk(min(k, dist.shape[1]), dim=-1)
            pieces += [values.flatten().to(torch.float64), ids.flatten().to(torch.float64)]
            shapes.append((k, at, values.shape[1]))
    host = torch.cat(pieces).tolist()  # the one device-to-host copy
    return _unpack(host, rows, order if reported else [], shapes, proc_row)


def _unpack(host: list[float], rows: list[SampleRow], order: list[int], shapes: list, proc_row: dict) -> SampleResult:
    """SampleResult from _collect's flat host list: tokens, the reported rows' logprobs, their kept masses, then
    per top-k size the values and ids of its rows."""
    n = len(rows)
    tokens = [int(t) for t in host[:n]]
    result = SampleResult(tokens, [None] * n, [None] * n, [None] * n)
    at = n
    chosen = dict(zip(order, host[at:at + len(order)]))
    at += len(order)
    kept_order = [i for i in order if rows[i].params.logprobs_mode != "raw"]
    kept = dict(zip(kept_order, host[at:at + len(kept_order)]))
    at += len(kept_order)
    tops = {}
    for _, members, width in shapes:
        values = host[at:at + len(members) * width]
        ids = host[at + len(members) * width:at + 2 * len(members) * width]
        at += 2 * len(members) * width
        for m, n_row in enumerate(members):
            i = order[n_row]
            tops[i] = dict(zip((int(t) for t in ids[m * width:(m + 1) * width]), values[m * width:(m + 1) * width]))
    for i, row in enumerate(rows):
        k = row.params.logprobs
        if k is None:
            continue
        token = tokens[i]
        raw_mode = row.params.logprobs_mode == "raw"
        result.log_kept_mass[i] = None if raw_mode else kept.get(i, 0.0)  # 0: a greedy row's point mass
        result.logprobs[i] = chosen.get(i, 0.0)
        if k > 0:
            top = tops.get(i, {})
            top.setdefault(token, result.logprobs[i])
            result.top_logprobs[i] = top
    return result
