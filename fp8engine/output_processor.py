"""From a step's logits to tokens and outputs: forks, sample rows, stop checks, prompt logprobs, scoring.

The engine hands each step's schedule and the model runner's result here (`process`); this module samples,
appends tokens, ends sequences through the scheduler, and builds the RequestOutputs the engine returns. It owns
the live requests and the token counters.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8engine.detokenizer import Detokenizer
from fp8engine.model_executor.layers.sampler import SampleRow, fused_result, sample, sample_on_device
from fp8engine.model_executor.model_runner import PromptLogits
from fp8engine.outputs import CompletionOutput, RequestOutput
from fp8engine.request import PLACEHOLDER, Request, ScheduledSeq, SeqStatus, Sequence
from fp8engine.sampling_params import SamplingParams
from fp8engine.scheduler.scheduler import Scheduler


@dataclass(slots=True)
class InFlight:
    """A decode step sampled on the device whose tokens the host has not read yet (async scheduling)."""

    scheduled: list[ScheduledSeq]
    rows: list[SampleRow]
    device: torch.Tensor  # the sampler's [n, 3] on the device: the next step's input tokens
    read: Callable[[], torch.Tensor]  # waits for its copy to the host


class OutputProcessor:
    """read_routed(seq) -> the experts of seq's computed positions (MoE models with return_routed_experts);
    sample_kernel: the kernel set's fused sampler op, or None. weight_version: the weights that sample now (the
    engine sets it on every update); each token records it."""

    def __init__(self, scheduler: Scheduler, detokenizer: Detokenizer, eos_token_ids: set[int], max_model_len: int,
                 read_routed: Callable[[Sequence], torch.Tensor], sample_kernel=None,
                 on_verified: Callable[[Sequence, int, int], None] | None = None):
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.read_routed = read_routed
        self.sample_kernel = sample_kernel
        self.on_verified = on_verified  # (seq, drafted, accepted) after each verified draft
        self.requests: dict[str, Request] = {}
        self.counters = dict(prompt_tokens=0, generation_tokens=0, finished=0, draft_tokens=0, accepted_tokens=0,
                             verifications=0)
        self.weight_version = 0

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        """Start tracking a request and queue its first sequence."""
        seq = Sequence(request, 0, list(request.prompt_token_ids))
        request.seqs.append(seq)
        self.requests[request.request_id] = request
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now (its blocks are freed); its partial output, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                if _take_placeholder(seq):  # drawn by a step in flight (async): dropped, as if not run
                    seq.num_computed_tokens -= 1
                seq.finish_reason = "abort"
                self._finish(seq)
        request.aborted = True
        return self.output(request)

    def emit(self, request: Request) -> RequestOutput:
        """The request's output now; a finished request is forgotten."""
        out = self.output(request)
        if out.finished:
            self.requests.pop(request.request_id, None)
            self.counters["finished"] += 1
        return out

    def output(self, request: Request) -> RequestOutput:
        outputs = [self._completion(seq) for seq in sorted(request.seqs, key=lambda s: s.index)]
        version = max((s.token_weight_versions[-1] for s in request.seqs if s.token_weight_versions),
                      default=request.weight_version)
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, request.finished, version,
                             request.prompt, request.prompt_logprobs, request.num_cached_tokens,
                             prompt_top_logprobs=request.prompt_top_logprobs)

    # ------------------------------------------------------------------ a step's results
    def process(self, scheduled: list[ScheduledSeq], result) -> list[Request]:
        """Advance every scheduled sequence and sample the ones that reached their end; the touched requests."""
        sampling: list[tuple[Sequence, int, tuple]] = []  # (sequence, its first row of the logits, its draft)
        num_rows = 0
        touched: dict[str, Request] = {}
        for item in scheduled:
            seq = item.seq
            if seq.is_finished:  # stopped by the step before it, which landed after it was launched (async)
                num_rows += (1 + len(item.draft)) * item.samples
                continue
            if seq.needs_prompt_logprobs:
                self._record_prompt_logprobs(seq, item.num_new_tokens, result.prompt_logits[seq.seq_id])
            samples = item.samples
            if seq.num_output_tokens == 0:
                self.counters["prompt_tokens"] += item.num_new_tokens
            self.scheduler.advance(item)
            if samples:
                if seq.params.max_tokens == 0:
                    self._finish_unsampled(seq)
                elif item.draft:
                    sampling.append((seq, num_rows, item.draft))
                else:
                    sampling += [(s, num_rows, ()) for s in self.scheduler.fork(seq)]
                num_rows += 1 + len(item.draft)
            touched[seq.request.request_id] = seq.request
        if sampling:
            self._sample(sampling, result.logits)
        return list(touched.values())

    # ------------------------------------------------------------------ async scheduling (LLMEngine.step)
    def sample_ahead(self, scheduled: list[ScheduledSeq], logits: torch.Tensor,
                     read_back: Callable[[torch.Tensor], Callable[[], torch.Tensor]]) -> InFlight | None:
        """Sample a pure decode step (one token a sequence, no prompt rows, no drafts, no grammar, every row the
        fused sampler's: greedy or tempered alone) on the device and start copying the results back without waiting;
        None when any row needs more (the step is then processed as usual)."""
        if any(item.num_new_tokens != 1 or item.draft or not item.samples or item.seq.num_output_tokens == 0
               or item.seq.needs_prompt_logprobs or item.seq.matcher is not None for item in scheduled):
            return None  # a grammar's next mask needs the token before
        rows = [self._row(s.params, s.request.seed, s.index, s.num_tokens, s.token_ids, s.num_prompt_tokens,
                          (), s.matcher) for s in (item.seq for item in scheduled)]
        out = sample_on_device(self.sample_kernel, logits, rows)
        return None if out is None else InFlight(scheduled, rows, out, read_back(out))

    def advance_ahead(self, step: InFlight) -> None:
        """Count the step's tokens as computed and hold each sequence's drawn token with a PLACEHOLDER, so the next
        step can be scheduled before the host reads it (a sequence ended since holds none: its row is not used)."""
        for item in step.scheduled:
            if not item.seq.is_finished:
                self.scheduler.advance(item)
                item.seq.token_ids.append(PLACEHOLDER)

    def land(self, step: InFlight) -> list[Request]:
        """The step's tokens read on the host, each in its placeholder's place with its logprob, stops and length
        checked as process() does; the touched requests."""
        result = fused_result(step.read(), step.rows)
        touched: dict[str, Request] = {}
        for i, item in enumerate(step.scheduled):
            seq = item.seq
            if not _take_placeholder(seq):  # ended since (a stop it met earlier, an abort): its row is not used
                continue
            self._append_token(seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i],
                               result.log_kept_mass[i])
            touched[seq.request.request_id] = seq.request
        return list(touched.values())

    def retract(self, step: InFlight) -> None:
        """Undo advance_ahead: the sequences go back to where they were before the step (its tokens dropped; the
        next step computes that position again, into the same KV slot). Waits for the step first, so that its
        host buffers can be written again."""
        step.read()
        for item in step.scheduled:
            if _take_placeholder(item.seq):
                item.seq.num_computed_tokens -= item.num_new_tokens

    def _finish_unsampled(self, seq: Sequence) -> None:
        """max_tokens=0: the prompt is computed (and scored); every sample ends empty, nothing is drawn."""
        request = seq.request
        for i in range(len(request.seqs), request.params.n):
            child = seq.fork(i)
            child.status, child.finish_reason = SeqStatus.FINISHED, "length"
            request.seqs.append(child)
        seq.finish_reason = "length"
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        """End a sequence (finished or aborted); its routed experts are read before its blocks are freed."""
        if seq.params.return_routed_experts:
            seq.routed_experts = self.read_routed(seq)
        self.scheduler.finish(seq)

    def _sample(self, sampling: list[tuple[Sequence, int, tuple]], logits: torch.Tensor) -> None:
        rows, index = [], []
        for s, first, draft in sampling:
            for j in range(len(draft) + 1):  # the row after draft[:j]: a plain decode's after those tokens
                rows.append(self._row(s.params, s.request.seed, s.index, s.num_tokens + j, s.token_ids,
                                      s.num_prompt_tokens, draft[:j], s.matcher))
                index.append(first + j)
        if index != list(range(logits.shape[0])):  # forks share their parent's row
            logits = logits[torch.tensor(index, device=logits.device)]
        result = sample(logits, rows, kernel=self.sample_kernel)
        i = 0
        for seq, _, draft in sampling:
            if draft:
                self._verify(seq, draft, result, i)
            else:
                self._append_token(seq, result.token_ids[i], result.logprobs[i],
                                   result.top_logprobs[i], result.log_kept_mass[i])
            i += 1 + len(draft)

    def _verify(self, seq: Sequence, draft: tuple[int, ...], result, first: int) -> None:
        """Emit seq's samples at rows first..first+len(draft) while each earlier draft token was accepted; the
        KV of an accepted draft token counts as computed, the blocks only rejected ones used are given back."""
        accepted = 0
        for j in range(len(draft) + 1):
            if j:
                self.scheduler.accept_draft_token(seq)
            r = first + j
            token = result.token_ids[r]
            self._append_token(seq, token, result.logprobs[r], result.top_logprobs[r], result.log_kept_mass[r])
            match = j < len(draft) and token == draft[j]
            accepted += match
            if seq.is_finished or not match:
                break
        if not seq.is_finished:
            self.scheduler.release_draft_slots(seq)
        seq.num_draft_tokens += len(draft)
        seq.num_accepted_tokens += accepted
        self.counters["draft_tokens"] += len(draft)
        self.counters["accepted_tokens"] += accepted
        self.counters["verifications"] += 1
        if self.on_verified is not None:
            self.on_verified(seq, len(draft), accepted)

    def _append_token(self, seq: Sequence, token: int, logprob, top, log_kept) -> None:
        seq.token_ids.append(token)
        if seq.matcher is not None:
            seq.matcher.accept(token)
        seq.token_weight_versions.append(self.weight_version)
        self.counters["generation_tokens"] += 1
        if seq.params.logprobs is not None:
            seq.logprobs.append(logprob)
            if top is not None:
                seq.top_logprobs.append(top)
            if log_kept is not None:
                seq.log_kept_mass.append(log_kept)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            seq.finish_reason = reason
            self._finish(seq)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if p.stop and self._hit_stop_string(seq):
                return "stop"
        if self.ends_by_length(seq):
            return "length"
        return None

    def ends_by_length(self, seq: Sequence) -> bool:
        """Whether seq's last token (a placeholder or not) ends it by max_tokens or the model's length."""
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    def _hit_stop_string(self, seq: Sequence) -> bool:
        # A stop string that completes with this token lies within its last few tokens (a character
        # spans at most 4 byte-level tokens): decoding only those keeps the check O(1) per token
        # instead of O(length), and the whole text is decoded once, on a hit, to cut it.
        ids = seq.output_token_ids
        window = 8 + 4 * max(len(s) for s in seq.params.stop)
        if len(ids) > window:
            tail = self.detokenizer.decode(ids[-window:])
            if not any(s in tail for s in seq.params.stop):
                return False
        text = self.detokenizer.decode(ids)
        hits = [(text.find(s), s) for s in seq.params.stop if s in text]
        if not hits:
            return False
        cut, stop = min(hits)
        seq.text, seq.stop_reason = text[:cut], stop
        return True

    def _row(self, params: SamplingParams, seed: int, index: int, position: int, token_ids: list[int],
             num_prompt_tokens: int, more: tuple[int, ...] = (), matcher=None) -> SampleRow:
        """The sampler's row for the token after token_ids + more (the first num_prompt_tokens are the prompt);
        matcher: where a structured output is after them (no drafts come with one)."""
        num_output = len(token_ids) + len(more) - num_prompt_tokens
        row = SampleRow(params, seed, index, position, self._bans(params, num_output),
                        allowed=None if matcher is None else matcher.allowed())
        if params.adjusts_logits:
            row.prompt_token_ids = token_ids[:num_prompt_tokens]
            row.output_token_ids = token_ids[num_prompt_tokens:] + list(more)
        return row

    def _bans(self, p: SamplingParams, num_output_tokens: int) -> tuple[int, ...]:
        if num_output_tokens >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_token_ids)
        return eos + tuple(p.stop_token_ids)

    # ------------------------------------------------------------------ prompt logprobs and scoring
    def _record_prompt_logprobs(self, seq: Sequence, n: int, logits: PromptLogits) -> None:
        request, start = seq.request, seq.num_computed_tokens
        if request.scoring is not None:
            self._record_scores(request, start, n, logits)
            return
        if start == 0:
            request.partial_prompt_logprobs, request.partial_prompt_top_logprobs = [None], [None]
        targets = seq.token_ids[start + 1:min(start + n + 1, seq.num_prompt_tokens)]
        k = seq.params.prompt_logprobs
        pieces = []  # per row: the chosen logprob, then the top-k values and ids
        for i, chunk in logits.chunks(0, len(targets)):
            logp = torch.log_softmax(chunk, dim=-1)
            ids = torch.tensor(targets[i:i + chunk.shape[0]], dtype=torch.int64, device=logp.device)
            k = min(k, logp.shape[-1])
            row = [logp.gather(1, ids[:, None])]
            if k:
                values, top = logp.topk(k, dim=-1)
                row += [values, top.to(logp.dtype)]
            pieces.append(torch.cat(row, dim=1))
        rows = torch.cat(pieces).tolist() if pieces else []  # one copy to the host
        if k:
            request.partial_prompt_top_logprobs += [dict(zip(map(int, r[1 + k:]), r[1:1 + k])) | {t: r[0]}
                                                    for r, t in zip(rows, targets)]
        request.partial_prompt_logprobs += [r[0] for r in rows]
        if len(request.partial_prompt_logprobs) == seq.num_prompt_tokens:
            request.prompt_logprobs = request.partial_prompt_logprobs
            request.prompt_top_logprobs = request.partial_prompt_top_logprobs if k else None

    def _record_scores(self, request: Request, start: int, n: int, logits: PromptLogits) -> None:
        """Rows start..start+n-1 of a scoring request: row j scores response token j + 1 - prompt_len."""
        scoring = request.scoring
        if start == 0:  # a preempted request recomputes from the start
            scoring.logprobs = []
            scoring.matcher = None if scoring.grammar is None else scoring.grammar.matcher()
        first = max(0, scoring.prompt_len - 1 - start)
        targets = list(range(start + first + 1 - scoring.prompt_len, min(start + n + 1 - scoring.prompt_len,
                                                                         len(scoring.response))))
        if targets:
            prompt = request.prompt_token_ids[:scoring.prompt_len]
            rows = []
            for i in targets:
                rows.append(self._row(scoring.params, 0, 0, 0, prompt + scoring.response[:i], scoring.prompt_len,
                                      matcher=scoring.matcher))
                if scoring.matcher is not None:
                    scoring.matcher.accept(scoring.response[i])
            for i, chunk in logits.chunks(first, first + len(targets)):
                part = slice(i, i + chunk.shape[0])
                got = sample(chunk, rows[part], forced=[scoring.response[t] for t in targets[part]],
                             kernel=self.sample_kernel)
                scoring.logprobs += got.logprobs
        if start + n == len(request.prompt_token_ids):
            request.prompt_logprobs = scoring.logprobs  # done: nothing to recompute after a preemption

    # ------------------------------------------------------------------ outputs
    def _completion(self, seq: Sequence) -> CompletionOutput:
        wants = seq.params.logprobs is not None
        text = seq.text
        if seq.params.detokenize and not (seq.is_finished and seq.stop_reason in seq.params.stop):
            text = self.detokenizer.text(seq.detok, seq.output_token_ids)
        return CompletionOutput(
            index=seq.index, token_ids=list(seq.output_token_ids), text=text,
            logprobs=list(seq.logprobs) if wants else None,
            top_logprobs=list(seq.top_logprobs) if wants and seq.params.logprobs else None,
            log_kept_mass=list(seq.log_kept_mass) if wants and seq.params.logprobs_mode == "processed" else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            num_preemptions=seq.num_preemptions, seed=seq.request.seed, routed_experts=self._routed_experts(seq),
            token_weight_versions=list(seq.token_weight_versions), num_kv_recomputes=seq.num_kv_recomputes,
            spec_draft_tokens=seq.num_draft_tokens, spec_accepted_tokens=seq.num_accepted_tokens)

    def _routed_experts(self, seq: Sequence) -> torch.Tensor | None:
        if not seq.params.return_routed_experts or seq.is_finished:
            return seq.routed_experts
        return self.read_routed(seq)


def _take_placeholder(seq: Sequence) -> bool:
    """Remove seq's PLACEHOLDER (the token a step in flight drew), if its last token is one; whether it was. A
    sequence that ended holds none."""
    if seq.token_ids[-1] != PLACEHOLDER:
        return False
    seq.token_ids.pop()
    return True
