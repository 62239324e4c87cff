"""LLMEngine: requests in, rollouts with logprobs and preemption counts out, weights updated in place."""

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from transformers import AutoTokenizer

from fp8engine.config import EngineConfig
from fp8engine.envs import cache_root
from fp8engine.detokenizer import Detokenizer
from fp8engine.kvcache.kv_scales import CALIBRATION_TEXT, KVScaleManager
from fp8engine.model_executor import host_memory
from fp8engine.model_executor.model_runner import ModelRunner
from fp8engine.output_processor import InFlight, OutputProcessor
from fp8engine.outputs import EngineStats, RequestOutput, SleepReport, WeightUpdateReport
from fp8engine.request import Request, ScheduledSeq, Scoring
from fp8engine.sampling_params import SamplingParams
from fp8engine.scheduler.scheduler import Scheduler
from fp8engine.spec.drafter import Speculator
from fp8engine.structured import GrammarCompiler
from fp8engine.weights import lora, tensor_handles, updater
from fp8engine.weights.default_model import default_model_path
from fp8engine.weights.dist_update import DEFAULT_TIMEOUT_S, WeightsUpdateGroup
from fp8engine.weights.loader import read_kv_scales

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
    A step is schedule (scheduler/) -> execute (model_executor/) -> process the outputs (output_processor.py);
    with `async_scheduling` a decode step's outputs are processed at the next `step()`, after it has launched the
    step that follows (docs/gpu.md).
    """

    def __init__(self, config: EngineConfig):
        bound_onednn_cache()
        self.config = config
        self.model_dir = default_model_path() if config.model == "default" else config.model
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.runner = ModelRunner(config, self.model_dir)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.scheduler = Scheduler(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                   config.max_num_seqs, config.max_num_batched_tokens, self.runner.num_state_slots,
                                   self.runner.num_state_snapshots, self.runner.spec_states_per_slot)
        checkpoint_scales = read_kv_scales(self.model_dir) if config.load_format == "auto" else {}
        self.kv_scales = KVScaleManager(config, self.runner.attn_layers, checkpoint_scales)
        if config.batch_invariant:  # the runner's method, not a closure over self: no engine <-> kv_scales cycle
            self.kv_scales.fixed_calibration = functools.partial(self.runner.forward_detached,
                                                                 self._calibration_tokens())
        # FP8 KV kept across a scale change is re-quantized to the new scale (not a closure over self: no cycle)
        self.kv_scales.rescale = functools.partial(_rescale_live_kv, self.runner, self.scheduler)
        if self.runner.tp is not None:  # every rank measures its heads, and all take the largest amax
            self.kv_scales.reduce_amax = self.runner.tp.all_reduce_max
            self.runner.live_blocks = self.scheduler.live_blocks
            self.runner.sync_kv_scales()
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.speculator = None if config.speculative is None else Speculator(
            config.speculative, config.num_speculative_tokens, self.max_model_len, config.device)
        self.outputs = OutputProcessor(self.scheduler, self.detokenizer, self.eos_token_ids, self.max_model_len,
                                       self.runner.routed_experts_of, self.runner.fused_sampler,
                                       None if self.speculator is None else self.speculator.observe)
        self.weight_version = 0
        self.weights_update_group: WeightsUpdateGroup | None = None
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._request_ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self.num_steps = 0
        self.step_seconds_total = 0.0
        self.async_off = self._async_off_reason()  # None: async scheduling on
        self._in_flight: InFlight | None = None  # with it on: the decode step the device runs, its tokens unread
        self.num_steps_ahead = 0  # decode steps whose tokens the host read a step later
        self.last_weight_update_seconds = 0.0
        self.sleeping: dict[str, int] = {}  # tag -> level, while released (sleep / wake_up)
        self.weights_missing: set[str] = set()  # weights a level-2 sleep released and no update has committed since
        self.num_sleeps = 0
        self.sleep_seconds_total = self.wake_seconds_total = 0.0
        logger.info("fp8engine: %s on %s, %d KV blocks of %d tokens (%s), kernels: %s", self.model_dir,
                    config.device, self.runner.num_blocks, config.block_size, self.runner.kv_dtype,
                    ", ".join(f"{k}={v}" for k, v in self.runner.kernel_names.items()))

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (they also stop when this process ends); the engine cannot step
        after."""
        self.runner.shutdown()

    @property
    def requests(self) -> dict[str, Request]:
        """The live requests by id (owned by the output processor)."""
        return self.outputs.requests

    @property
    def block_manager(self):
        """The scheduler's KV block manager."""
        return self.scheduler.block_manager

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
        grammar = self.grammars.compile(params)
        request = Request(request_id, token_ids, params, self.weight_version,
                          prompt if isinstance(prompt, str) else None, self._request_seed(params))
        request.grammar = grammar
        self.outputs.add(request)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks are freed. Returns its partial output (None if unknown): the tokens step()
        has returned (with async scheduling, a token drawn by the step in flight is dropped)."""
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_outputs(self) -> bool:
        """Whether final outputs of requests an update or a sleep finished or aborted wait for the next step()."""
        return bool(self._pending_outputs)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of requests that advanced or finished (only those that
        finished with finished_only: an unfinished output detokenizes everything generated so far). While the engine
        sleeps it hands back the outputs a sleep left pending (its in_flight), then raises RuntimeError."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self.ready():  # the outputs a sleep's in_flight left pending still come back
            if outputs:
                return outputs
            self.check_ready()
        start = time.perf_counter()
        if self._in_flight is not None:
            touched, ran, launched = self._step_ahead()
            outputs += [self.outputs.emit(r) for r in touched if r.finished or not finished_only]
            if launched is not None:  # the next step runs on the device; its tokens land at the next call
                self.outputs.advance_ahead(launched)
                self._in_flight = launched
                self.num_steps_ahead += 1
            if ran:
                self.step_seconds_total += time.perf_counter() - start
                return outputs
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress with work queued (internal error)")
            return outputs
        if self.speculator is not None:
            self.speculator.propose(scheduled, self.config.max_num_batched_tokens, self.scheduler.extend)
        self.runner.copy_blocks(self.scheduler.take_pending_copies())
        self.runner.apply_state_ops(self.scheduler.take_state_ops())
        with self.kv_scales.calibrating():
            result = self.runner.execute(scheduled)
        self.num_steps += 1
        ahead = None if self.async_off is not None else self._sample_ahead(scheduled, result)
        if ahead is not None:
            self.outputs.advance_ahead(ahead)
            self._in_flight = ahead
            self.num_steps_ahead += 1
            touched = []
        else:
            touched = self.outputs.process(scheduled, result)
        outputs += [self.outputs.emit(r) for r in touched if r.finished or not finished_only]
        seconds = time.perf_counter() - start
        self.step_seconds_total += seconds
        if self.speculator is not None:
            self.speculator.record_step(scheduled, seconds)
        return outputs

    # ------------------------------------------------------------------ async scheduling
    def _async_off_reason(self) -> str | None:
        """Why decode steps do not overlap the host's work (None: they do; EngineConfig.async_scheduling)."""
        if not self.config.async_scheduling:
            return "async_scheduling=False"
        why = ("no decode graphs" if self.runner.graphs is None
               else "tensor parallelism (the workers would need the drawn tokens on their devices)"
               if self.config.tensor_parallel_size > 1
               else "speculative decoding" if self.speculator is not None
               else "a hybrid model (a step's state update cannot be taken back)" if self.runner.gdn_layers
               else "no fused sampler" if self.outputs.sample_kernel is None else None)
        if why is not None:
            logger.warning("fp8engine: async_scheduling stays off: %s", why)
        return why

    def _sample_ahead(self, scheduled: list[ScheduledSeq], result) -> InFlight | None:
        """A pure decode step sampled on the device, its tokens read back later; None: process it now."""
        if result.prompt_logits or self.runner.graphs is None:
            return None
        return self.outputs.sample_ahead(scheduled, result.logits, self.runner.graphs.read_back)

    def _step_ahead(self) -> tuple[list[Request], bool, InFlight | None]:
        """With a decode step in flight: when the scheduler would run the same sequences one token each again, that
        next step is scheduled and launched first, its input tokens taken from the device; then the step in flight
        lands (its tokens read, stops checked). A sequence that stopped there leaves its row of the next step
        unused; one that reaches its length there is known to the host, and no step is launched for it before it
        lands. Returns the touched requests, whether a step ran, and the step launched ahead (None: none was, or
        one that could not be sampled on the device ran and was processed here)."""
        current, self._in_flight = self._in_flight, None
        launched, scheduled, result = None, None, None
        graphs = self.runner.graphs
        if (graphs is not None and self.scheduler.decodes_only()
                and self.scheduler.running == [item.seq for item in current.scheduled]
                and not any(self.outputs.ends_by_length(s) for s in self.scheduler.running)
                and graphs.takes([ScheduledSeq(s, 1) for s in self.scheduler.running])):
            scheduled = self.scheduler.schedule()
            self.runner.copy_blocks(self.scheduler.take_pending_copies())
            with self.kv_scales.calibrating():
                result = self.runner.execute(scheduled, feed=current.device)
            self.num_steps += 1
            launched = self._sample_ahead(scheduled, result)
        touched = self.outputs.land(current)
        if scheduled is not None and launched is None:
            touched = list(dict.fromkeys(touched + self.outputs.process(scheduled, result)))  # each request once
        return touched, scheduled is not None, launched

    def _retract(self) -> None:
        """Take back the decode step in flight before anything changes the weights or the cache under it (an
        update, a sleep, a prefix-cache flush): its tokens are dropped and computed again by the next step, as if it
        had not run. (An abort drops only its own sequences' tokens: OutputProcessor.abort.)"""
        current, self._in_flight = self._in_flight, None
        if current is not None:
            self.outputs.retract(current)

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        self.check_ready()
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
        self.check_ready()
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts for {len(responses)} responses")
        params.validate()
        if params.logprobs is None:  # what a rollout asks for (the sampled token's logprob only)
            params = dataclasses.replace(params, logprobs=0)
        forward = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
        grammar = self.grammars.compile(params)
        requests, ids = [], []
        try:
            for i, (prompt, response) in enumerate(zip(prompts, responses)):
                if not response:
                    requests.append(None)
                    continue
                _check_follows(grammar, response, i)
                ids.append(self.add_request(list(prompt) + list(response[:-1]), forward))
                request = self.requests[ids[-1]]
                request.scoring = Scoring(params, len(prompt), response, grammar)
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
            for out in self.step(finished_only=True):
                if out.finished and out.request_id in wanted:
                    finished[out.request_id] = out
                    progress.update(1)
        progress.close()
        return [finished[i] for i in ids]

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
        """CALIBRATION_TEXT as a user turn (chat-rendered when the model has a template), cut to fit; ids the model's
        embedding lacks (a tokenizer larger than the vocabulary, as in the tests' tiny models) left out."""
        if self.tokenizer.chat_template:
            ids = self.render_chat([{"role": "user", "content": CALIBRATION_TEXT}])
        else:
            ids = self.tokenizer(CALIBRATION_TEXT, add_special_tokens=True)["input_ids"]
        return [i for i in ids if i < self.vocab_size][:self.max_model_len]

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (self.runner.hf_config, getattr(self.tokenizer, "eos_token_id", None)):
            value = getattr(source, "eos_token_id", source) if source is not None else None
            ids |= set(value) if isinstance(value, (list, tuple)) else ({value} if isinstance(value, int) else set())
        return ids

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                       weight_version: int | None = None, kv_scales: Mapping | None = None,
                       flush_cache: bool = True, in_flight: str = "wait",
                       kv_on_update: str = "keep") -> WeightUpdateReport:
        """Write new weights into the engine's existing buffers (FP8 layers quantize on the way in).

        weights: a mapping or an iterable of (hf_name, tensor); whole or partial model, any order.
        Everything is validated before anything is written: a bad tensor (unknown name, shape,
        dtype, NaN/Inf), a bad option or an iterable that raises leaves the engine exactly as it was.
        in_flight: "wait" finishes unfinished requests on the old weights first (their outputs come back
        from the next `step()`), "abort" aborts them, "keep" lets them go on: every token sampled after this
        call returns is sampled by the new weights (CompletionOutput.token_weight_versions says which).
        kv_on_update (with "keep"): "keep" keeps the KV they computed under the old weights (an FP8 cache whose
        scales change is re-quantized to the new ones); "recompute" drops it and re-prefills prompt + generated
        tokens under the new weights (counted in num_kv_recomputes, not as preemptions; the prefix cache is
        reset, so no block of the old weights is reused). Returns a WeightUpdateReport.
        """
        check_update_options(in_flight, kv_on_update)
        self._check_weights_awake("update_weights")
        start = time.perf_counter()
        staged = updater.stage(self.runner.model, weights, self.kv_scales, self.runner.kernels.block_scales)
        scales = self.kv_scales.check_external(kv_scales)
        num_quantized, num_aborted, num_recomputed = self._apply_update(
            functools.partial(self.runner.commit_weights, staged),
            staged.kv_scales | scales, weight_version, flush_cache, in_flight, kv_on_update, start)
        self.weights_missing -= updater.covered_names(staged)
        return WeightUpdateReport(len(staged.items), staged.num_bytes, self.last_weight_update_seconds, num_quantized,
                                  self.weight_version, num_aborted, num_recomputed)

    def update_weights_from_tensor(self, named_tensors, weight_version: int | None = None, *,
                                   load_format: str | None = None, flush_cache: bool = True, in_flight: str = "wait",
                                   kv_on_update: str = "keep") -> WeightUpdateReport:
        """SGLang's same-machine hand-over: a trainer in another process on this machine passes its tensors as
        handles to memory both share (CUDA IPC on a GPU, shared memory on a CPU), never their bytes.

        named_tensors: SGLang's serialized_named_tensors (a list with one base64 pickle of handles, as
        weights/tensor_handles.dumps or SGLang's MultiprocessingSerializer write it; load_format None, "direct" or
        "flattened_bucket"), unpickled by a restricted unpickler that takes torch's shared-tensor rebuild
        functions only; or (name, tensor) pairs already rebuilt (a flattened bucket's dict with "flattened_bucket").
        Validated and committed exactly as update_weights (in place, FP8 quantized, all or nothing), whose options
        it takes."""
        check_update_options(in_flight, kv_on_update)
        if load_format not in tensor_handles.LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(tensor_handles.LOAD_FORMATS)}, got {load_format!r}")
        if isinstance(named_tensors, list) and named_tensors and isinstance(named_tensors[0], (str, bytes)):
            named_tensors = tensor_handles.named_tensors(named_tensors, load_format)
        elif load_format == "flattened_bucket":
            named_tensors = tensor_handles.unflatten(named_tensors)
        return self.update_weights(named_tensors, weight_version=weight_version, flush_cache=flush_cache,
                                   in_flight=in_flight, kv_on_update=kv_on_update)

    def update_lora(self, adapter: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], scaling=1.0, *,
                    weight_version: int | None = None, flush_cache: bool = True, in_flight: str = "wait",
                    kv_on_update: str = "keep") -> WeightUpdateReport:
        """Replace the LoRA adapter (EngineConfig(max_lora_rank=r) > 0) in place; the base weights are untouched.

        adapter: PEFT's names and tensors (`get_peft_model_state_dict`: <module>.lora_A.weight [rank, in],
        <module>.lora_B.weight [out, rank]), any subset of the q/k/v/o and gate/up/down projections, rank <= r;
        modules it does not name carry no adapter afterwards. scaling: PEFT's lora_alpha / r, one number or a
        mapping module name -> number. Validated before anything is written, like update_weights (whose
        weight_version, flush_cache, in_flight and kv_on_update it takes too); KV scales recalibrate as after a
        weight update. Returns a WeightUpdateReport (num_quantized 0: nothing is quantized).
        """
        check_update_options(in_flight, kv_on_update)
        self._check_weights_awake("update_lora")
        start = time.perf_counter()
        staged = self._stage_lora(adapter, scaling)
        _, num_aborted, num_recomputed = self._apply_update(
            functools.partial(self.runner.commit_lora, staged), {}, weight_version, flush_cache,
            in_flight, kv_on_update, start)
        return WeightUpdateReport(staged.num_tensors, staged.num_bytes, self.last_weight_update_seconds, 0,
                                  self.weight_version, num_aborted, num_recomputed)

    def check_lora(self, adapter: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], scaling=1.0) -> None:
        """Validate an adapter exactly as update_lora would; writes nothing."""
        self._stage_lora(adapter, scaling)

    def _stage_lora(self, adapter, scaling) -> lora.StagedAdapter:
        if not self.runner.lora_layers:
            raise ValueError("update_lora needs an engine with LoRA buffers: EngineConfig(max_lora_rank=r) with r > 0")
        return lora.stage_adapter(self.runner.model, self.runner.lora_layers, adapter, scaling)

    def _apply_update(self, commit, kv_scales: dict, weight_version: int | None, flush_cache: bool, in_flight: str,
                      kv_on_update: str, start: float) -> tuple[object, int, int]:
        """The part of a validated update that changes the engine: in-flight requests handled, `commit()` run,
        KV scales and the prefix cache brought in line, the version moved on (seconds since `start` kept in
        last_weight_update_seconds). Returns (what commit returned, aborted, recomputed)."""
        new_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        num_aborted = self.drain(in_flight) if in_flight != "keep" else 0
        self._retract()  # what "keep" goes on with (after "wait", at most a step of rows that ended)
        recompute = in_flight == "keep" and kv_on_update == "recompute"
        num_recomputed = len(self.scheduler.recompute_in_flight()) if recompute else 0
        committed = commit()
        self.kv_scales.on_weights_changed(kv_scales)
        self.runner.sync_kv_scales()
        if flush_cache or recompute:
            self.scheduler.reset_prefix_cache()
        if self.speculator is not None and self.config.speculative_forget_on_update:
            self.speculator.forget()
        self.weight_version = self.outputs.weight_version = new_version
        self.last_weight_update_seconds = time.perf_counter() - start
        return committed, num_aborted, num_recomputed

    def check_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate weights exactly as update_weights would (names, shapes, dtypes, values); writes nothing."""
        updater.stage(self.runner.model, weights, self.kv_scales, self.runner.kernels.block_scales)

    def drain(self, in_flight: str) -> int:
        """End every unfinished request: "wait" runs them to completion, "abort" aborts them; their final
        outputs come back from the next `step()`. Returns how many were aborted."""
        if in_flight == "abort":
            ids = list(self.requests)
            self._pending_outputs += [o for o in map(self.abort_request, ids) if o is not None]
            return len(ids)
        if not self.ready():  # nothing has run since: they wait for the weights to come
            return 0
        while self.requests:
            # step() hands back the outputs still pending with the new ones: they stay pending, each once
            self._pending_outputs = self.step(finished_only=True)
        return 0

    # ------------------------------------------------------------------ sleep (colocated RL)
    def sleep(self, level: int = 1, tags: Sequence[str] | None = None, *, in_flight: str = "wait") -> SleepReport:
        """Hand memory back to a trainer that shares the machine (vLLM's sleep, SGLang's release_memory_occupation).

        tags: "weights" and/or "kv_cache" (None: both). Level 1 keeps the weights byte for byte where they do not
        count (on CPU an unlinked file under sleep_spill_dir, on CUDA host memory) and drops the KV cache; level 2
        drops both, and once the weights are awake again every step raises until update_weights,
        update_weights_from_distributed or reload_weights has committed every weight (a LoRA adapter is dropped with
        them: update_lora puts one back). Weight version and KV scales are kept. On CPU the memory keeps its
        addresses (its pages are handed back to the kernel), so the fused decoder plan stays valid; on CUDA the
        decode graphs are dropped and captured again at wake. in_flight as in update_weights: "wait" finishes
        unfinished requests first, "abort" aborts them, "keep" keeps them (with the KV cache released, their KV
        is recomputed after wake_up, counted in num_kv_recomputes); the final outputs of those it finished or aborted
        come back from the next step(). A tag already asleep stays as it is. While a tag sleeps, step() (once those
        outputs are out) raises a RuntimeError naming it."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        tags = _tags(tags)
        check_update_options(in_flight, "keep")
        todo = [tag for tag in tags if tag not in self.sleeping]
        spill_dir = None
        if "weights" in todo and level == 1 and self.runner.device.type == "cpu":
            spill_dir = host_memory.spill_directory(self.config.sleep_spill_dir or str(cache_root() / "spill"))
        start = time.perf_counter()
        num_aborted = self.drain(in_flight) if in_flight != "keep" and todo else 0
        self._retract()
        num_recomputed = 0
        released = 0
        for tag in todo:
            if tag == "kv_cache":
                num_recomputed = len(self.scheduler.recompute_in_flight())
                self.scheduler.reset_prefix_cache()
            if tag == "weights" and level == 2:  # the adapter goes with them, as an update_lora of none
                self.runner.commit_lora(lora.StagedAdapter())
            released += self.runner.release(tag, keep=level == 1 and tag == "weights", spill_dir=spill_dir)
            self.sleeping[tag] = level
        seconds = time.perf_counter() - start
        self.num_sleeps += bool(todo)
        self.sleep_seconds_total += seconds
        return SleepReport(todo, released, seconds, level, num_aborted, num_recomputed)

    def wake_up(self, tags: Sequence[str] | None = None) -> SleepReport:
        """Take released memory back (vLLM's wake_up, SGLang's resume_memory_occupation), a tag at a time if you like:
        wake_up(["weights"]), update_weights(...), wake_up(["kv_cache"]). Weights a level-1 sleep kept come back
        byte for byte; after a level 2 they wait for an update (steps raise until every weight is committed). A tag
        that is awake stays as it is."""
        tags = _tags(tags)
        start = time.perf_counter()
        todo = [tag for tag in tags if tag in self.sleeping]
        restored = 0
        for tag in todo:
            self.runner.restore(tag)
            restored += self.runner.resident_bytes(tag)
            if tag == "weights" and self.sleeping[tag] == 2:
                self.weights_missing = set(self.runner.weight_names)
            del self.sleeping[tag]
        if todo and not self.sleeping:
            self.runner.recapture_graphs()
        seconds = time.perf_counter() - start
        self.wake_seconds_total += seconds
        return SleepReport(todo, restored, seconds)

    def is_sleeping(self) -> bool:
        """Whether any tag is released (sleep without its wake_up)."""
        return bool(self.sleeping)

    def reload_weights(self, *, weight_version: int | None = None, in_flight: str = "wait") -> WeightUpdateReport:
        """Every weight read again from the model directory (seeded random ones with load_format "dummy") and written
        in place as update_weights writes it (the LoRA adapter untouched): a level-2 sleep's recovery without a
        trainer. The weights must be awake."""
        check_update_options(in_flight, "keep")
        self._check_weights_awake("reload_weights")
        start = time.perf_counter()
        _, num_aborted, _ = self._apply_update(self.runner.reload_weights, {}, weight_version, True, in_flight, "keep",
                                               start)
        self.weights_missing = set()
        names = self.runner.weight_names
        return WeightUpdateReport(len(names), 0, self.last_weight_update_seconds, 0, self.weight_version, num_aborted)

    def _check_weights_awake(self, what: str) -> None:
        if "weights" in self.sleeping:
            raise RuntimeError(f"{what}: the weights are asleep (sleep level {self.sleeping['weights']}); call "
                               f"wake_up(['weights']) first")

    def ready(self) -> bool:
        """Whether steps can run: no tag asleep, and no weight a level-2 sleep released left uncommitted."""
        return not (self.sleeping or self.weights_missing)

    def check_ready(self) -> None:
        """RuntimeError naming what is asleep or missing unless ready()."""
        if not self.ready():
            raise RuntimeError(self.not_ready_reason())

    def not_ready_reason(self) -> str | None:
        """Why steps cannot run now (what sleeps, or the weights a level-2 sleep left missing); None when they can."""
        if self.ready():
            return None
        if self.sleeping:
            asleep = ", ".join(f"{tag} (level {level})" for tag, level in self.sleeping.items())
            return f"the engine is asleep: {asleep} released; call wake_up() before generating"
        missing = sorted(self.weights_missing)
        return (f"the weights were released by sleep(level=2) and {len(missing)} of them have not been committed "
                f"since (e.g. {missing[:3]}): update_weights / update_weights_from_distributed with every weight, "
                f"or reload_weights(), before generating")

    def flush_prefix_cache(self) -> None:
        self._retract()
        self.scheduler.reset_prefix_cache()

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's own parameter tensors as stored (FP8 weights and their scales). A batch-invariant engine on
        the AVX-512 BF16 kernels stores its FP8 codes in the nt16 layout (`kernel_names["fp8_weights"]`,
        weights/layout.py); `get_weights_by_name` reads every engine's weights as rows."""
        return self.runner.model.named_parameters()

    def get_weights_by_name(self, hf_name: str) -> torch.Tensor:
        """Weight `hf_name` dequantized to the model dtype, in the Hugging Face shape (gathered from every
        tensor-parallel rank)."""
        return self.runner.read_weight(hf_name)

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
        # tensor-parallel workers join at rank_offset + their rank meanwhile
        self.weights_update_group = self.runner.join_update_group(
            WeightsUpdateGroup, master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s,
            self.config.device)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: int | None = None, *, flush_cache: bool = True,
                                        in_flight: str = "wait", kv_on_update: str = "keep") -> WeightUpdateReport:
        """Receive the tensors the trainer broadcasts in `names` order (dtypes: torch attribute names
        such as "bfloat16"; shapes: lists of ints) and apply them as `update_weights` does: all
        validated before anything is written. A transfer that fails (the trainer died, timeout_s
        passed) closes the group and leaves the engine on its old weights."""
        check_update_options(in_flight, kv_on_update)
        prequantizer = self.prequantizer()
        received = self.receive_weights(names, dtypes, shapes, prequantizer)
        report = self.update_weights(received, weight_version=weight_version, flush_cache=flush_cache,
                                     in_flight=in_flight, kv_on_update=kv_on_update)
        return self.received_report(report, names, prequantizer)

    def prequantizer(self) -> updater.Prequantizer | None:
        """What receive_weights hands each tensor to as it arrives: on an FP8 engine, FP8-bound weights are
        quantized then (updater.Prequantizer), so the received model is not held in BF16 until the commit."""
        if self.config.quantization != "fp8" or self.runner.tp is not None:  # a rank quantizes its slices at commit
            return None
        kernels = self.runner.kernels
        return updater.Prequantizer(self.runner.model, kernels.quantize_into, kernels.block_scales)

    @staticmethod
    def received_report(report: WeightUpdateReport, names: list[str],
                        prequantizer: updater.Prequantizer | None) -> WeightUpdateReport:
        """The report of an update received by broadcast, in the trainer's terms: its tensors and bytes, and
        the quantized ones counted where they were quantized."""
        if prequantizer is None:
            return report
        return dataclasses.replace(report, num_tensors=len(names), num_bytes=prequantizer.bytes_in,
                                   num_quantized=report.num_quantized + prequantizer.count)

    def receive_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                        prequantizer: updater.Prequantizer | None = None) -> list[tuple[str, torch.Tensor]]:
        """The transfer half of update_weights_from_distributed: the received (name, tensor) pairs (FP8-bound
        weights as codes and scales with a prequantizer). Touches nothing the engine runs with (new tensors
        only), so it may run beside generation in another thread."""
        group = self.weights_update_group
        if group is None:
            raise ValueError("no weight-update group: call init_weights_update_group() first")
        try:  # tensor-parallel workers receive their own copy beside rank 0 and stage it
            return self.runner.receive_with_workers(functools.partial(group.receive, names, dtypes, shapes,
                                                                      prequantizer), names, dtypes, shapes)
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
            self.runner.leave_update_group()

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        kernels = self.runner.kernel_names | {"async_scheduling": "on" if self.async_off is None
                                              else f"off: {self.async_off}"}
        return EngineStats(
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_total=bm.num_blocks, num_kv_blocks_free=bm.num_free_blocks,
            kv_cache_capacity_tokens=bm.num_blocks * bm.block_size,
            prefix_cache_hit_rate=bm.hit_rate, weight_version=self.weight_version,
            kv_scales=self.kv_scales.current(),
            num_prompt_tokens_total=self.outputs.counters["prompt_tokens"],
            num_generation_tokens_total=self.outputs.counters["generation_tokens"],
            num_steps_total=self.num_steps, step_seconds_total=self.step_seconds_total,
            num_requests_finished=self.outputs.counters["finished"],
            kv_cache_dtype=self.config.kv_cache_dtype, linear_backend=self.runner.kernels.linear_name,
            attention_backend=kernels["attention"], decoder_backend=kernels["decoder"], kernels=kernels,
            device=self.config.device,
            last_weight_update_seconds=self.last_weight_update_seconds,
            kv_recalibration_seconds_total=self.kv_scales.seconds_total,
            num_kv_recomputes_total=self.scheduler.num_kv_recomputes_total,
            kv_rescale_seconds_total=self.kv_scales.rescale_seconds_total,
            speculative=self.config.speculative, spec_draft_tokens=self.outputs.counters["draft_tokens"],
            spec_accepted_tokens=self.outputs.counters["accepted_tokens"],
            spec_verifications=self.outputs.counters["verifications"], max_lora_rank=self.config.max_lora_rank,
            lora_active=self.runner.lora_active, sleeping=dict(self.sleeping),
            resident_bytes={tag: 0 if tag in self.sleeping else self.runner.resident_bytes(tag) for tag in TAGS},
            weights_missing=len(self.weights_missing), num_sleeps_total=self.num_sleeps,
            sleep_seconds_total=self.sleep_seconds_total, wake_seconds_total=self.wake_seconds_total,
            num_state_slots_total=self.runner.num_state_slots,
            num_state_slots_free=0 if bm.states is None else bm.states.num_free,
            state_bytes_per_sequence=self.runner.state_bytes_per_slot(),
            num_state_snapshots=0 if bm.states is None else len(bm.states.cached),
            num_state_snapshots_taken_total=0 if bm.states is None else bm.states.num_snapshots_taken,
            num_graph_recaptures_total=self.runner.graph_captures,
            graph_recapture_seconds_total=self.runner.graph_capture_seconds)


def _rescale_live_kv(runner: ModelRunner, scheduler: Scheduler, layer: int, old: tuple[float, float],
                     new: tuple[float, float]) -> None:
    runner.rescale_kv(layer, scheduler.live_blocks(), old, new)


IN_FLIGHT = ("wait", "abort", "keep")
TAGS = ("weights", "kv_cache")  # what sleep releases and wake_up takes back


def _tags(tags: Sequence[str] | None) -> list[str]:
    """The tags asked for (None: all), checked; ValueError naming an unknown one."""
    if tags is None:
        return list(TAGS)
    if isinstance(tags, str):
        tags = [tags]
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown sleep tag(s) {bad}: the tags are {list(TAGS)}")
    return [t for t in TAGS if t in tags]
KV_ON_UPDATE = ("keep", "recompute")


def _check_follows(grammar, response: list[int], i: int) -> None:
    """ValueError unless response (token ids) stays inside grammar (None: no structured output)."""
    matcher = None if grammar is None else grammar.matcher()
    for j, token in enumerate(response if matcher is not None else ()):
        if not matcher.follows(token):
            raise ValueError(f"response {i} leaves the structured output of SamplingParams at token {j} ({token})")


def check_update_options(in_flight: str, kv_on_update: str) -> None:
    """ValueError naming a weight update's in_flight / kv_on_update when it is not one of the known values."""
    if in_flight not in IN_FLIGHT:
        raise ValueError(f"in_flight must be one of {list(IN_FLIGHT)}, got {in_flight!r}")
    if kv_on_update not in KV_ON_UPDATE:
        raise ValueError(f"kv_on_update must be one of {list(KV_ON_UPDATE)}, got {kv_on_update!r}")


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
