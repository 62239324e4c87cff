"""LLMEngine: requests in, rollouts with logprobs and preemption counts out, weights updated in place."""

import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping

import torch
from transformers import AutoTokenizer

from fp8engine.config import EngineConfig
from fp8engine.detokenizer import Detokenizer
from fp8engine.kvcache.block_manager import BlockManager
from fp8engine.kvcache.kv_scales import CALIBRATION_TEXT, KVScaleManager
from fp8engine.model_executor.layers.sampler import SampleRow, sample
from fp8engine.model_executor.model_runner import ModelRunner
from fp8engine.outputs import CompletionOutput, EngineStats, RequestOutput, WeightUpdateReport
from fp8engine.sampling_params import SamplingParams
from fp8engine.scheduler.scheduler import ScheduledSeq, Scheduler
from fp8engine.scheduler.sequence import Request, Scoring, Sequence, SeqStatus
from fp8engine.weights import updater
from fp8engine.weights.default_model import default_model_path
from fp8engine.weights.dist_update import DEFAULT_TIMEOUT_S, WeightsUpdateGroup
from fp8engine.weights.loader import read, resolve

logger = logging.getLogger(__name__)

Prompt = str | list[int] | list[dict]

# oneDNN, torch's CPU GEMM for the bf16 shapes our kernels leave to it (prefill chunks), keeps the kernels it
# JIT-compiles for up to 1024 shapes; a server meets a new number of rows at almost every prefill step, and in a
# 10-min soak (bench --workload soak) the server's RSS grew 14% after warm-up with the default, 2.4% with 8.
ONEDNN_CACHE_CAPACITY = 8


def bound_onednn_cache() -> None:
    """Caps oneDNN's primitive cache at ONEDNN_CACHE_CAPACITY unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is set.
    oneDNN reads it when it first builds a kernel, so this holds for a process where it has built none yet."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))


class LLMEngine:
    """A paged-attention engine for RL rollouts.

    Drive it with `generate(prompts, params)`, or stream with `add_request` / `step`.
    Weights change in place with `update_weights`; every output names its `weight_version`.
    """

    def __init__(self, config: EngineConfig):
        bound_onednn_cache()
        self.config = config
        self.model_dir = default_model_path() if config.model == "default" else config.model
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.runner = ModelRunner(config, self.model_dir)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.hf_config.vocab_size
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.kv_scales = KVScaleManager(config, self.runner.attn_layers, self.model_dir)
        if config.batch_invariant:
            calibration = self._calibration_tokens()
            self.kv_scales.fixed_calibration = lambda: self.runner.forward_detached(calibration)
        self.eos_token_ids = self._eos_token_ids()
        self.requests: dict[str, Request] = {}
        self.weight_version = 0
        self.weights_update_group: WeightsUpdateGroup | None = None
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._request_ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._counters = dict(prompt_tokens=0, generation_tokens=0, steps=0, finished=0)
        self.last_weight_update_seconds = 0.0
        logger.info("fp8engine: %s on %s, %d KV blocks of %d tokens (%s), linear=%s, attention=%s",
                    self.model_dir, config.device, self.runner.num_blocks, config.block_size,
                    self.runner.kv_dtype, self.runner.linear_backend, self.runner.attention.name)

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one prompt (text, token ids or chat messages); returns its request id."""
        params = params or SamplingParams()
        params.validate()
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self._check_fits(token_ids, params)
        if params.return_routed_experts and not self.runner.moe_blocks:
            raise ValueError(f"SamplingParams.return_routed_experts=True needs a MoE model; "
                             f"{self.runner.hf_config.model_type!r} routes no experts")
        request = Request(request_id, token_ids, params, self.weight_version,
                          prompt if isinstance(prompt, str) else None, self._request_seed(params))
        seq = Sequence(request, 0, list(token_ids))
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks are freed. Returns its partial output (None if unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)
        request.aborted = True
        return self._request_output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of requests that advanced or finished."""
        return self._step(finished_only=False)

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        # Building an unfinished output detokenizes everything generated so far, so callers that
        # only collect finished requests skip it.
        outputs, self._pending_outputs = self._pending_outputs, []
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress with work queued (internal error)")
            return outputs
        self.runner.copy_blocks(self.block_manager.take_pending_copies())
        with self.kv_scales.calibrating(scheduled):
            result = self.runner.execute(scheduled)
        self._counters["steps"] += 1
        touched = self._postprocess(scheduled, result)
        return outputs + [self._emit(r) for r in touched if r.finished or not finished_only]

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.add_request(prompt, p))
        except ValueError:
            for request_id in ids:
                self.abort_request(request_id)
            raise
        return self._run_until_done(ids, use_tqdm)

    def score(self, prompts: list[list[int]], responses: list[list[int]],
              params: SamplingParams) -> list[list[float]]:
        """Per-token logprobs of each response given its prompt (token ids), from one teacher-forced
        forward of prompt + response, each computed as the sampler reports a sampled token's logprob
        under `params` (logprobs_mode, temperature, top-k/p, min-p, min_tokens bans; logprobs=None
        counts as 0, as in a rollout, and a k > 0 takes the sampler's path for top-k alternatives).

        With batch_invariant=True and the same weights they equal, bit for bit, the logprobs the engine
        reported when it sampled these responses with `params`: the forward, the LM head and the
        sampler's arithmetic are the same per row whatever the batch, chunking or cache.
        """
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts for {len(responses)} responses")
        params.validate()
        if params.logprobs is None:  # what a rollout asks for (the sampled token's logprob only)
            params = dataclasses.replace(params, logprobs=0)
        forward = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
        requests, ids = [], []
        try:
            for prompt, response in zip(prompts, responses):
                if not response:
                    requests.append(None)
                    continue
                ids.append(self.add_request(list(prompt) + list(response[:-1]), forward))
                request = self.requests[ids[-1]]
                request.scoring = Scoring(params, len(prompt), response)
                requests.append(request)
        except ValueError:
            for request_id in ids:
                self.abort_request(request_id)
            raise
        self._run_until_done(ids, False)
        return [[] if r is None else r.scoring.logprobs for r in requests]

    def _run_until_done(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = _progress(len(ids), use_tqdm)
        wanted = set(ids)
        while wanted - finished.keys():
            for out in self._step(finished_only=True):
                if out.finished and out.request_id in wanted:
                    finished[out.request_id] = out
                    progress.update(1)
        progress.close()
        return [finished[i] for i in ids]

    # ------------------------------------------------------------------ stepping
    def _postprocess(self, scheduled: list[ScheduledSeq], result) -> list[Request]:
        sampling: list[tuple[Sequence, int]] = []  # (sequence, row of the logits it samples from)
        num_rows = 0
        touched: dict[str, Request] = {}
        for item in scheduled:
            seq = item.seq
            if seq.needs_prompt_logprobs:
                self._record_prompt_logprobs(seq, item.num_new_tokens, result.prompt_logits[seq.seq_id])
            samples = item.samples
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_output_tokens == 0:
                self._counters["prompt_tokens"] += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if samples:
                if seq.params.max_tokens == 0:
                    self._finish_unsampled(seq)
                else:
                    sampling += [(s, num_rows) for s in self._fork_if_needed(seq)]
                num_rows += 1
            touched[seq.request.request_id] = seq.request
        if sampling:
            self._sample(sampling, result.logits)
        return list(touched.values())

    def _fork_if_needed(self, seq: Sequence) -> list[Sequence]:
        request = seq.request
        if seq.index != 0 or len(request.seqs) == request.params.n:
            return [seq]
        children, queued = [], []
        for i in range(1, request.params.n):
            child = seq.fork(i)
            if self.block_manager.can_fork(seq):
                self.block_manager.fork(seq, child)
                children.append(child)
            else:  # no block for its tail: it recomputes later, through the prefix cache
                child.num_computed_tokens, child.status = 0, SeqStatus.WAITING
                queued.append(child)
        request.seqs += children + queued
        self.scheduler.insert_running_after(seq, children)
        self.scheduler.waiting.extendleft(reversed(queued))
        return [seq] + children + queued

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
            seq.routed_experts = self.runner.routed_experts_of(seq.block_table, seq.num_computed_tokens)
        self.scheduler.finish(seq)

    def _sample(self, sampling: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
        rows = [self._row(s.params, s.request.seed, s.index, s.num_tokens, s.token_ids, s.num_prompt_tokens)
                for s, _ in sampling]
        index = [r for _, r in sampling]
        if index != list(range(logits.shape[0])):  # forks share their parent's row
            logits = logits[torch.tensor(index, device=logits.device)]
        result = sample(logits, rows)
        for i, (seq, _) in enumerate(sampling):
            self._append_token(seq, result.token_ids[i], result.logprobs[i],
                               result.top_logprobs[i], result.log_kept_mass[i])

    def _append_token(self, seq: Sequence, token: int, logprob, top, log_kept) -> None:
        seq.token_ids.append(token)
        self._counters["generation_tokens"] += 1
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
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

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
             num_prompt_tokens: int) -> SampleRow:
        """The sampler's row for the token after token_ids (its first num_prompt_tokens are the prompt)."""
        row = SampleRow(params, seed, index, position, self._bans(params, len(token_ids) - num_prompt_tokens))
        if params.adjusts_logits:
            row.prompt_token_ids = token_ids[:num_prompt_tokens]
            row.output_token_ids = token_ids[num_prompt_tokens:]
        return row

    def _bans(self, p: SamplingParams, num_output_tokens: int) -> tuple[int, ...]:
        if num_output_tokens >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_token_ids)
        return eos + tuple(p.stop_token_ids)

    def _record_prompt_logprobs(self, seq: Sequence, n: int, logits: torch.Tensor) -> None:
        request, start = seq.request, seq.num_computed_tokens
        if request.scoring is not None:
            self._record_scores(request, start, n, logits)
            return
        if start == 0:
            request.partial_prompt_logprobs, request.partial_prompt_top_logprobs = [None], [None]
        targets = seq.token_ids[start + 1:min(start + n + 1, seq.num_prompt_tokens)]
        logp = torch.log_softmax(logits[:len(targets)], dim=-1)
        chosen = logp[torch.arange(len(targets)), targets].tolist()
        request.partial_prompt_logprobs += chosen
        k = seq.params.prompt_logprobs
        if k:
            values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
            request.partial_prompt_top_logprobs += [dict(zip(i, v)) | {t: c} for i, v, t, c in
                                                    zip(ids.tolist(), values.tolist(), targets, chosen)]
        if len(request.partial_prompt_logprobs) == seq.num_prompt_tokens:
            request.prompt_logprobs = request.partial_prompt_logprobs
            request.prompt_top_logprobs = request.partial_prompt_top_logprobs if k else None

    def _record_scores(self, request: Request, start: int, n: int, logits: torch.Tensor) -> None:
        """Rows start..start+n-1 of a scoring request: row j scores response token j + 1 - prompt_len."""
        scoring = request.scoring
        if start == 0:  # a preempted request recomputes from the start
            scoring.logprobs = []
        first = max(0, scoring.prompt_len - 1 - start)
        targets = list(range(start + first + 1 - scoring.prompt_len, min(start + n + 1 - scoring.prompt_len,
                                                                         len(scoring.response))))
        if targets:
            prompt = request.prompt_token_ids[:scoring.prompt_len]
            rows = [self._row(scoring.params, 0, 0, 0, prompt + scoring.response[:i], scoring.prompt_len)
                    for i in targets]
            got = sample(logits[first:first + len(targets)], rows, forced=[scoring.response[i] for i in targets])
            scoring.logprobs += got.logprobs
        if start + n == len(request.prompt_token_ids):
            request.prompt_logprobs = scoring.logprobs  # done: nothing to recompute after a preemption

    def _emit(self, request: Request) -> RequestOutput:
        out = self._request_output(request)
        if out.finished:
            self.requests.pop(request.request_id, None)
            self._counters["finished"] += 1
        return out

    def _request_output(self, request: Request) -> RequestOutput:
        outputs = [self._completion(seq) for seq in sorted(request.seqs, key=lambda s: s.index)]
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, request.finished,
                             request.weight_version, request.prompt, request.prompt_logprobs,
                             request.num_cached_tokens, prompt_top_logprobs=request.prompt_top_logprobs)

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
            num_preemptions=seq.num_preemptions, seed=seq.request.seed, routed_experts=self._routed_experts(seq))

    def _routed_experts(self, seq: Sequence) -> torch.Tensor | None:
        if not seq.params.return_routed_experts or seq.is_finished:
            return seq.routed_experts
        return self.runner.routed_experts_of(seq.block_table, seq.num_computed_tokens)

    # ------------------------------------------------------------------ inputs
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt as add_request sees it (chat messages rendered); ValueError if invalid."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer(prompt)["input_ids"]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"prompt must be a non-empty str, list of token ids or list of chat "
                             f"messages, got {type(prompt).__name__} {prompt!r:.80}")
        if all(isinstance(t, dict) for t in prompt):
            return self.render_chat(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a token-id prompt must hold only ints")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return list(prompt)

    def render_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of chat messages under the model's chat template, with a generation prompt."""
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"chat messages need string 'role' and 'content', got {m!r:.80}")
        if self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        if len(token_ids) + min(params.max_tokens, 1) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt plus at least one generated token must fit)")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.logit_bias has token ids out of range [0, {self.vocab_size}): "
                             f"{bad[:5]}")
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        capacity = self.runner.num_blocks * self.config.block_size
        if longest > capacity:
            raise ValueError(f"request can never fit: prompt ({len(token_ids)}) + max_tokens "
                             f"({params.max_tokens}) needs {longest} KV slots, the whole cache holds "
                             f"{capacity}; raise kv_cache_memory_bytes or lower max_tokens")

    def _request_seed(self, params: SamplingParams) -> int:
        if params.seed is not None:
            if isinstance(params.seed, bool) or not isinstance(params.seed, int):
                raise TypeError(f"seed must be an int or None, got {params.seed!r}")
            return params.seed
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_source))

    def _calibration_tokens(self) -> list[int]:
        """CALIBRATION_TEXT as a user turn (chat-rendered when the model has a template), cut to fit."""
        if self.tokenizer.chat_template:
            ids = self.render_chat([{"role": "user", "content": CALIBRATION_TEXT}])
        else:
            ids = self.tokenizer(CALIBRATION_TEXT, add_special_tokens=True)["input_ids"]
        return ids[:self.max_model_len]

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (self.runner.hf_config, getattr(self.tokenizer, "eos_token_id", None)):
            value = getattr(source, "eos_token_id", source) if source is not None else None
            ids |= set(value) if isinstance(value, (list, tuple)) else ({value} if isinstance(value, int) else set())
        return ids

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                       weight_version: int | None = None, kv_scales: Mapping | None = None,
                       flush_cache: bool = True, in_flight: str = "wait") -> WeightUpdateReport:
        """Write new weights into the engine's existing buffers (FP8 layers quantize on the way in).

        weights: a mapping or an iterable of (hf_name, tensor); whole or partial model, any order.
        Everything is validated before anything is written: a bad tensor (unknown name, shape,
        dtype, NaN/Inf) or an iterable that raises leaves the engine exactly as it was.
        in_flight: "wait" finishes unfinished requests on the old weights first (their outputs
        come back from the next `step()`), "abort" aborts them. Returns a WeightUpdateReport.
        """
        if in_flight not in ("wait", "abort"):
            raise ValueError(f"in_flight must be 'wait' or 'abort', got {in_flight!r}")
        new_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        start = time.perf_counter()
        staged = updater.stage(self.runner.model, weights, self.kv_scales, self.runner.block_scales)
        scales = self.kv_scales.check_external(kv_scales)
        num_aborted = self._drain(in_flight)
        num_quantized = updater.commit(staged, self.runner.quantize_into)
        self.kv_scales.on_weights_changed(staged.kv_scales | scales)
        if flush_cache:
            self.block_manager.reset_prefix_cache()
        self.weight_version = new_version
        seconds = time.perf_counter() - start
        self.last_weight_update_seconds = seconds
        return WeightUpdateReport(len(staged.items), staged.num_bytes, seconds, num_quantized,
                                  new_version, num_aborted)

    def check_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate weights exactly as update_weights would (names, shapes, dtypes, values); writes nothing."""
        updater.stage(self.runner.model, weights, self.kv_scales, self.runner.block_scales)

    def _drain(self, in_flight: str) -> int:
        if in_flight == "abort":
            ids = list(self.requests)
            self._pending_outputs += [o for o in map(self.abort_request, ids) if o is not None]
            return len(ids)
        while self.requests:
            self._pending_outputs += self._step(finished_only=True)
        return 0

    def flush_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's own parameter tensors as stored (FP8 weights and their scales)."""
        return self.runner.model.named_parameters()

    def get_weights_by_name(self, hf_name: str) -> torch.Tensor:
        """Weight `hf_name` dequantized to the model dtype, in the Hugging Face shape."""
        return read(resolve(self.runner.model, hf_name), self.runner.dtype)

    # ------------------------------------------------------------------ weight-update group
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weights", backend: str = "gloo",
                                  timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Join a trainer's weight-update group (SGLang's convention) as rank `rank_offset` of
        `world_size`; the trainer is rank 0 and hosts the group's TCP store at
        master_address:master_port. Blocks until every rank joined. backend: "gloo" (CPU tensors)
        or "nccl" (CUDA). timeout_s: the longest the rendezvous, or one broadcast, waits (s)."""
        if self.weights_update_group is not None:
            raise ValueError(f"weight-update group {self.weights_update_group.group_name!r} is already "
                             f"open; call destroy_weights_update_group() first")
        self.weights_update_group = WeightsUpdateGroup(master_address, master_port, rank_offset, world_size,
                                                       group_name, backend, timeout_s, self.config.device)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: int | None = None, *, flush_cache: bool = True,
                                        in_flight: str = "wait") -> WeightUpdateReport:
        """Receive the tensors the trainer broadcasts in `names` order (dtypes: torch attribute names
        such as "bfloat16"; shapes: lists of ints) and apply them as `update_weights` does: all
        validated before anything is written. A transfer that fails (the trainer died, timeout_s
        passed) closes the group and leaves the engine on its old weights."""
        return self.update_weights(self.receive_weights(names, dtypes, shapes), weight_version=weight_version,
                                   flush_cache=flush_cache, in_flight=in_flight)

    def receive_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]]
                        ) -> list[tuple[str, torch.Tensor]]:
        """The transfer half of update_weights_from_distributed: the received (name, tensor) pairs.
        Touches nothing but the group, so it may run beside generation in another thread."""
        group = self.weights_update_group
        if group is None:
            raise ValueError("no weight-update group: call init_weights_update_group() first")
        try:
            return group.receive(names, dtypes, shapes)
        except RuntimeError as exc:
            with contextlib.suppress(RuntimeError):
                self.destroy_weights_update_group()
            raise RuntimeError(f"weight broadcast failed, the group is closed and the update dropped; the "
                               f"engine keeps weight version {self.weight_version}: {exc}") from exc

    def destroy_weights_update_group(self) -> None:
        """Leave the weight-update group (nothing happens when there is none)."""
        group, self.weights_update_group = self.weights_update_group, None
        if group is not None:
            group.destroy()

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_total=bm.num_blocks, num_kv_blocks_free=bm.num_free_blocks,
            kv_cache_capacity_tokens=bm.num_blocks * bm.block_size,
            prefix_cache_hit_rate=bm.hit_rate, weight_version=self.weight_version,
            kv_scales=self.kv_scales.current(),
            num_prompt_tokens_total=self._counters["prompt_tokens"],
            num_generation_tokens_total=self._counters["generation_tokens"],
            num_steps_total=self._counters["steps"], num_requests_finished=self._counters["finished"],
            kv_cache_dtype=self.config.kv_cache_dtype, linear_backend=self.runner.linear_backend,
            attention_backend=self.runner.attention.name,
            decoder_backend="cpp-plan" if getattr(self.runner.model, "fused", None) is not None else "python",
            device=self.config.device,
            last_weight_update_seconds=self.last_weight_update_seconds,
            kv_recalibration_seconds_total=self.kv_scales.seconds_total)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req")
