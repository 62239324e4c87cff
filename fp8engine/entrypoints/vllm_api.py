"""vLLM's RL API on `fp8engine serve` (vllm/entrypoints/rl/online/api_router.py and the dev routes it serves with
VLLM_SERVER_DEV_MODE=1): what SkyRL and prime-rl call.

  POST /pause?mode=abort|wait|keep&clear_cache=true   (bare: abort, and the prefix cache is cleared)
       {"status": "paused"}; a JSON body {"mode"} is our own /pause (default "wait"), see server.py
  POST /resume {"status": "resumed"}, GET /is_paused {"is_paused"}, POST /abort_requests {"request_ids"} (empty or
       missing: every request) {"status": "aborted", "aborted": n}
  POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port" | "nccl_unique_id_b64" (CUDA),
       "rank_offset", "world_size", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}}, /start_weight_update,
       /update_weights {"update_info": {"names", "dtype_names", "shapes"}} (one or a list), /finish_weight_update
       {"weight_version"},
       /shutdown_weight_transfer_engine: vLLM's NCCL weight-transfer engine, trainer-facing (weight_transfer.py)
  POST /update_weight_version {"new_version"}, GET /weight_info {"weight_version"}, POST /weight_checker
       {"action": "checksum" | "compare", "baseline"}, GET /get_world_size {"world_size"}
  POST /reset_prefix_cache {"success"}, POST /collective_rpc (400: fp8engine has no workers to call)
  GET  /server_info?config_format=text|json: vLLM's vllm_config (the fields that describe this engine, vLLM's names:
       model_config.logprobs_mode from --logprobs-mode, weight_transfer_config, lora_config, parallel_config, ...)
       beside SGLang's /get_server_info keys (sglang_api.py), since SGLang's clients ask this path too
  POST /inference/v1/generate {"request_id", "token_ids", "sampling_params", "return_token_ids"}: token in, token
       out, in vLLM's GenerateTokensResponse shape (non-streaming); POST /skyrl/v1/generate, SkyRL's fork of it
       (routed experts packed as SkyRL packs them)
  POST /tokenize {"prompt" | "messages", ...}, /detokenize {"tokens"}, /v1/chat/completions/render
Weight versions are our integer versions; vLLM's are strings, so a version given as a string must hold an integer.
"""

import base64
import hashlib
import io
import time
import uuid
from typing import Literal

import numpy
import torch
from fastapi import Request
from pydantic import Field, model_validator

from fp8engine import tools
from fp8engine.entrypoints.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    TokenIds,
    ToolSpec,
    _finite,
    _OpenAIRequest,
    _Request,
    parse_json,
    validate,
)
from fp8engine.entrypoints.rollouts import VLLM_ID_PREFIX, Rollouts, spans
from fp8engine.entrypoints.weight_transfer import TransferInit, TransferUpdate, set_weight_version
from fp8engine.outputs import CompletionOutput, EngineStats, RequestOutput
from fp8engine.sampling_params import SamplingParams


class VllmPauseQuery(_Request):
    mode: Literal["abort", "wait", "keep"] = "abort"
    clear_cache: bool = True


class VllmSamplingParams(_OpenAIRequest):
    """vLLM's SamplingParams as JSON: what changes the tokens is implemented, an unknown key answers 400."""

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = 0
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    max_tokens: int | None = Field(16, ge=0)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=-1, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=-1, le=MAX_LOGPROBS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict | None = None
    # text-only or bookkeeping options: the tokens are the same whatever they say
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int | None = None
    extra_args: dict | None = None
    skip_clone: bool = False
    skip_reading_prefix_cache: bool | None = None
    bad_words: list[str] = Field(default_factory=list, max_length=0, description="bad_words are not implemented")

    def engine(self, room: int, routed: bool, logprobs_mode: str = "raw") -> SamplingParams:
        structured = {}
        for key, value in (self.structured_outputs or {}).items():
            if key not in ("json", "regex", "grammar") or len(self.structured_outputs) != 1:
                raise ApiError(400, "sampling_params.structured_outputs: only one of json, regex, grammar is "
                                    "implemented", param="sampling_params")
            structured = {{"json": "json_schema"}.get(key, key): value}
        max_tokens = room if self.max_tokens is None else min(self.max_tokens, room)  # vLLM cuts it to the context
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k if self.top_k > 0 else -1,
            min_p=self.min_p, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, seed=self.seed,
            logprobs=_top_k(self.logprobs), logprobs_mode=logprobs_mode,
            prompt_logprobs=_top_k(self.prompt_logprobs),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            return_routed_experts=routed, **structured)


class VllmGenerateRequest(_Request):
    """POST /inference/v1/generate (vLLM's GenerateRequest, tokens mode); multimodal inputs and streaming are
    refused by name."""

    request_id: str | None = None
    token_ids: TokenIds
    sampling_params: VllmSamplingParams = Field(default_factory=VllmSamplingParams)
    model: str | None = None
    return_token_ids: bool = False
    return_routed_experts: bool = False  # vLLM turns it on server-wide; here per request
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: Literal[False] = False
    features: None = None
    content_parts: None = None


class SkyrlGenerateRequest(_Request):
    """POST /skyrl/v1/generate: SkyRL's fork of vLLM's token route (skyrl/backends/skyrl_train/inference_servers/
    vllm_server_actor.py), which its RemoteInferenceClient calls when routed-expert replay is on. cache_salt only
    keeps other salts' requests off a prompt's cached blocks in vLLM; it changes no output, and is taken and
    ignored. Full-vocabulary logprobs and sample supports (SkyRL's diagnostics) are refused by name."""

    token_ids: TokenIds
    sampling_params: VllmSamplingParams = Field(default_factory=VllmSamplingParams)
    model: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    return_full_logprobs: Literal[False] = Field(False, description="not implemented")
    return_sample_support: Literal[False] = Field(False, description="not implemented")


class ServerInfoQuery(_Request):
    config_format: Literal["text", "json"] = "text"


class AbortRequests(_Request):
    request_ids: list[str] | None = None


class TransferInitBody(_Request):
    init_info: TransferInit


class TransferUpdateBody(_Request):
    update_info: TransferUpdate | list[TransferUpdate]


class FinishBody(_Request):
    """vLLM sends the version as a string: here it must hold an integer (the engine's versions are)."""

    weight_version: int | None = None


class VersionBody(_Request):
    """vLLM's and SGLang's body ({"new_version"}, a string holding an integer here); SGLang's abort_all_requests
    true aborts what runs first (vLLM's body has no such field, so nothing is aborted unless it says so)."""

    new_version: int
    abort_all_requests: bool = False


class CheckerBody(_Request):
    action: Literal["checksum", "compare"]
    baseline: dict[str, str] | None = None

    @model_validator(mode="after")
    def _baseline(self) -> "CheckerBody":
        if self.action == "compare" and self.baseline is None:
            raise ValueError("baseline: action 'compare' needs a baseline object (name -> checksum)")
        return self


class TokenizeBody(_Request):
    """vLLM's TokenizeCompletionRequest ({"prompt"}) or TokenizeChatRequest ({"messages", "tools"}, rendered with
    the chat template as /v1/chat/completions renders them)."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[ToolSpec] | None = Field(None, max_length=128)

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeBody":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        return self


class DetokenizeBody(_Request):
    tokens: list[int]


class VllmRoutes:
    """vLLM's RL routes on the server `server` (server.Server)."""

    def __init__(self, server):
        self.server = server
        self.engine = server.engine
        self.rollouts: Rollouts = server.rollouts

    def routes(self) -> list[tuple[str, str, object, bool]]:
        """(method, path, handler, admin); /pause, /resume, /update_weights, /sleep, /wake_up and /is_sleeping are
        server.py's, which answer vLLM's shape of them too."""
        return [("GET", "/is_paused", self.is_paused, True),
                ("POST", "/abort_requests", self.abort_requests, True),
                ("POST", "/init_weight_transfer_engine", self.init_weight_transfer_engine, True),
                ("POST", "/shutdown_weight_transfer_engine", self.shutdown_weight_transfer_engine, True),
                ("POST", "/start_weight_update", self.start_weight_update, True),
                ("POST", "/finish_weight_update", self.finish_weight_update, True),
                ("POST", "/update_weight_version", self.update_weight_version, True),
                ("GET", "/weight_info", self.weight_info, True),
                ("POST", "/weight_checker", self.weight_checker, True),
                ("GET", "/get_world_size", self.get_world_size, True),
                ("GET", "/server_info", self.server_info, False),
                ("POST", "/reset_prefix_cache", self.reset_prefix_cache, True),
                ("POST", "/collective_rpc", self.collective_rpc, True),
                ("POST", "/inference/v1/generate", self.generate, False),
                ("POST", "/skyrl/v1/generate", self.skyrl_generate, False),
                ("POST", "/tokenize", self.tokenize, False), ("POST", "/detokenize", self.detokenize, False),
                ("POST", "/v1/chat/completions/render", self.render, False)]

    # ----------------------------------------------------------------- pause
    async def pause(self, request: Request) -> dict:
        query = validate(VllmPauseQuery, dict(request.query_params))
        num_aborted = await self.engine.pause(query.mode)
        if query.clear_cache and query.mode != "keep":
            await self.engine.call(lambda llm: llm.flush_prefix_cache())
        return {"status": "paused", "paused": query.mode, "num_aborted": num_aborted}

    async def is_paused(self) -> dict:
        return {"is_paused": self.engine.pause_mode is not None}

    async def abort_requests(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), AbortRequests)
        aborted = await self.rollouts.abort(body.request_ids or None)
        return {"status": "aborted", "aborted": aborted}

    # ----------------------------------------------------------------- weights
    async def init_weight_transfer_engine(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), TransferInitBody)
        await self.server.transfer.init(body.init_info)
        return {"message": "Weight transfer initialized"}

    async def shutdown_weight_transfer_engine(self) -> dict:
        await self.server.transfer.shutdown()
        return {"message": "Weight transfer shut down"}

    async def start_weight_update(self) -> dict:
        self.server.transfer.start()
        return {"message": "Weight update started"}

    async def update_weights(self, data: bytes) -> dict:
        body = parse_json(data, TransferUpdateBody)
        updates = body.update_info if isinstance(body.update_info, list) else [body.update_info]
        async with self.server.weights_lock:
            for update in updates:
                await self.server.transfer.receive(update)
        return {"message": "Weights updated"}

    async def finish_weight_update(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), FinishBody)
        async with self.server.weights_lock:
            report = await self.server.transfer.finish(body.weight_version)
        self.server.metrics.update_seconds.observe(report.seconds)
        return {"message": "Weight update finished", "weight_version": report.weight_version,
                "num_tensors": report.num_tensors, "seconds": report.seconds}

    async def update_weight_version(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), VersionBody)
        if body.abort_all_requests:
            await self.rollouts.abort(None)
        await self.engine.call(lambda llm: set_weight_version(llm, body.new_version))
        return {"success": True, "message": f"Weight version updated to {body.new_version}",
                "new_version": str(body.new_version)}

    async def weight_info(self) -> dict:
        return {"weight_version": str((await self.engine.stats()).weight_version)}

    async def weight_checker(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), CheckerBody)
        checksums = await self.engine.call(_checksums)
        if body.action == "checksum":
            return {"checksums": checksums}
        mismatches = sorted(k for k in checksums.keys() | body.baseline.keys()
                            if checksums.get(k) != body.baseline.get(k))
        return {"match": not mismatches, "mismatches": mismatches}

    async def server_info(self, request: Request) -> dict:
        """vLLM's GET /server_info?config_format=text|json (its dev route; TRL's VLLMClient reads
        vllm_config.weight_transfer_config, model_config.logprobs_mode, lora_config and parallel_config) with SGLang's
        /get_server_info at the top level: SGLang's newer name of that route is this path, and slime's discovery
        asks it first."""
        query = validate(ServerInfoQuery, dict(request.query_params))
        config = self._vllm_config(await self.engine.stats())
        if query.config_format == "text":  # VllmConfig's str(): its flat names, in its order, for what we have
            m, c = config["model_config"], config["cache_config"]
            p, spec = config["parallel_config"], config["speculative_config"]
            spec = spec and "SpeculativeConfig(" + ", ".join(f"{k}={v!r}" for k, v in spec.items()) + ")"
            config = ", ".join(f"{key}={value}" for key, value in (
                ("model", repr(m["model"])), ("speculative_config", spec), ("tokenizer", repr(m["tokenizer"])),
                ("dtype", m["dtype"]), ("max_seq_len", m["max_model_len"]),
                ("tensor_parallel_size", p["tensor_parallel_size"]), ("pipeline_parallel_size", 1),
                ("data_parallel_size", 1), ("quantization", m["quantization"]), ("enforce_eager", m["enforce_eager"]),
                ("kv_cache_dtype", c["cache_dtype"]), ("device_config", config["device_config"]["device"]),
                ("seed", m["seed"]), ("served_model_name", m["served_model_name"]),
                ("enable_prefix_caching", c["enable_prefix_caching"]),
                ("enable_chunked_prefill", config["scheduler_config"]["enable_chunked_prefill"])))
        return {**await self.server.sglang.get_server_info(), "vllm_config": config}

    def _vllm_config(self, stats: EngineStats) -> dict:
        """The fields of vLLM's VllmConfig (its JSON dump's names, each one vLLM 0.32 has: tests/fixtures/vllm/
        server_info.json) that describe this engine."""
        llm, settings = self.engine.engine, self.server.settings
        c = llm.config
        fp8_kv = c.kv_cache_dtype != "auto"
        return {
            "model_config": {"model": llm.model_dir, "served_model_name": self.server.model_name,
                             "tokenizer": llm.model_dir, "dtype": f"torch.{c.dtype}", "seed": c.seed,
                             "max_model_len": self.server.max_model_len, "quantization": c.quantization,
                             "max_logprobs": MAX_LOGPROBS, "logprobs_mode": settings.vllm_logprobs_mode,
                             "enforce_eager": c.enforce_eager, "runner": "generate"},
            "cache_config": {"block_size": c.block_size, "cache_dtype": c.kv_cache_dtype if fp8_kv else "auto",
                             "enable_prefix_caching": c.enable_prefix_caching,
                             "num_gpu_blocks": stats.num_kv_blocks_total, "num_cpu_blocks": None},
            "parallel_config": {"tensor_parallel_size": c.tensor_parallel_size, "pipeline_parallel_size": 1,
                                "data_parallel_size": 1, "world_size": c.tensor_parallel_size,
                                "enable_expert_parallel": c.expert_parallel},
            "scheduler_config": {"max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
                                 "enable_chunked_prefill": True, "runner_type": "generate",
                                 "async_scheduling": llm.async_off is None},
            "device_config": {"device": stats.device},
            "lora_config": None if c.max_lora_rank == 0 else {"max_lora_rank": c.max_lora_rank, "max_loras": 1},
            "speculative_config": None if c.speculative is None else {
                "method": c.speculative, "num_speculative_tokens": c.num_speculative_tokens},
            # the trainer-facing weight transfer (weight_transfer.py): gloo on CPU, vLLM's PyNccl data plane on CUDA
            "weight_transfer_config": {"backend": "gloo" if c.device == "cpu" else "nccl"}}

    async def get_world_size(self) -> dict:
        return {"world_size": 1}

    async def reset_prefix_cache(self) -> dict:
        await self.engine.call(lambda llm: llm.flush_prefix_cache())
        return {"success": True}

    async def collective_rpc(self) -> dict:
        raise ApiError(400, "collective_rpc: fp8engine runs its model in this process and has no worker methods "
                            "to call; use the weight and sleep routes", code="unsupported")

    # ----------------------------------------------------------------- tokens
    async def generate(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), VllmGenerateRequest)
        if body.output_mode != "tokens":
            raise ApiError(400, "output_mode: only 'tokens' is implemented (detokenize with /detokenize)",
                           param="output_mode")
        params = self._params(body, body.return_routed_experts)
        rid = body.request_id
        out, = await self.rollouts.run([list(body.token_ids)], [params], rid)
        completion = sum(len(s.token_ids) for s in out.outputs)
        prompt = len(out.prompt_token_ids)
        return {"request_id": VLLM_ID_PREFIX + (rid or out.request_id.rsplit("-", 1)[0]),
                "model": self.server.model_name, "created": int(time.time()), "output_mode": "tokens",
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion,
                          "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
                          "completion_tokens_details": None},
                "prompt_logprobs": self._prompt_logprobs(out) if params.prompt_logprobs is not None else None,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": out.prompt_token_ids if body.return_token_ids else None,
                "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
                "choices": [_choice(s, params, out) for s in out.outputs]}

    async def skyrl_generate(self, request: Request) -> dict:
        """SkyRL's reply: choices of token_ids, finish_reason, logprobs {"content": [{"logprob"}]} and, on a MoE
        model, routed_experts packed as SkyRL's generate_wire packs them (base64 of [positions fed, MoE layers,
        top_k] in the smallest of uint8 / int16 / int32 that holds the largest id, with its shape and dtype)."""
        body = parse_json(await self.server.read(request), SkyrlGenerateRequest)
        params = self._params(body, bool(self.engine.engine.runner.moe_blocks))
        out, = await self.rollouts.run([list(body.token_ids)], [params], body.request_id)
        return {"id": body.request_id or out.request_id, "choices": [
            {"token_ids": s.token_ids, "finish_reason": s.finish_reason or "stop",
             "logprobs": None if s.logprobs is None else {"content": [{"logprob": _finite(lp)} for lp in s.logprobs]},
             "routed_experts": None if s.routed_experts is None else _packed_routes(s.routed_experts)}
            for s in out.outputs]}

    def _params(self, body: "VllmGenerateRequest | SkyrlGenerateRequest", routed: bool) -> SamplingParams:
        """The engine's SamplingParams of a token route's body (its model checked, max_tokens cut to the context,
        the server's logprobs mode); 400 naming sampling_params when they are bad."""
        self.server.check_model(body.model)
        room = max(self.server.max_model_len - len(body.token_ids), 1)
        try:
            return body.sampling_params.engine(room, routed, self.server.settings.logprobs_mode or "raw")
        except ValueError as exc:
            raise ApiError(400, f"sampling_params: {exc}", param="sampling_params") from None

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's: per prompt token, None for the first, else {token id: {"logprob", "rank", "decoded_token"}}."""
        tops = out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)
        text = self.server.tokens.text
        return [None if logprob is None else {str(token): {
                    "logprob": _finite(logprob), "rank": _rank(token, top), "decoded_token": text(token)}}
                for token, logprob, top in zip(out.prompt_token_ids, out.prompt_logprobs or [], tops)]

    async def tokenize(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), TokenizeBody)

        def ids(llm) -> list[int]:
            if body.messages is not None:
                text = tools.render(llm.tokenizer, [m.model_dump(exclude_none=True) for m in body.messages],
                                    [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                                    add_generation_prompt=body.add_generation_prompt)
                return llm.tokenizer(text, add_special_tokens=False)["input_ids"]
            return llm.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        try:
            tokens = await self.engine.call(ids)
        except ValueError as exc:  # a template that refuses the messages
            raise ApiError(400, f"messages: {exc}", param="messages") from None
        strs = [self.server.tokens.text(t) for t in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.server.max_model_len, "tokens": tokens,
                "token_strs": strs}

    async def detokenize(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), DetokenizeBody)
        vocab = self.server.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        text = await self.engine.call(lambda llm: llm.tokenizer.decode(body.tokens))
        return {"prompt": text}

    async def render(self, request: Request) -> dict:
        """A chat request rendered into the GenerateRequest that /inference/v1/generate takes."""
        body = parse_json(await self.server.read(request), ChatCompletionRequest)
        self.server.check_model(body.model)
        try:
            token_ids = await self.engine.call(lambda llm: tools.render_ids(llm.tokenizer, body.message_dicts(),
                                                                            body.tool_dicts))
        except ValueError as exc:  # a template that refuses the messages
            raise ApiError(400, str(exc), param="messages") from None
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        sampling = {"presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
                    "repetition_penalty": body.repetition_penalty, "temperature": body.temperature,
                    "top_p": body.top_p, "min_p": body.min_p, "stop": stops, "stop_token_ids": body.stop_token_ids,
                    "max_tokens": body.max_new_tokens or max(self.server.max_model_len - len(token_ids), 1),
                    "output_kind": 2, "skip_clone": True, "bad_words": [], "skip_reading_prefix_cache": False}
        extras = {"n": body.n, "top_k": max(body.top_k, 0), "seed": body.seed, "min_tokens": body.min_tokens,
                  "ignore_eos": body.ignore_eos, "logprobs": body.num_logprobs}
        sampling |= {k: v for k, v in extras.items() if v != VllmSamplingParams.model_fields[k].default}
        return {"request_id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "token_ids": token_ids, "token_offsets": None,
                "features": None, "content_parts": None, "sampling_params": sampling, "model": self.server.model_name,
                "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
                "output_mode": "tokens", "stream": body.stream, "stream_options": None, "cache_salt": None,
                "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None}


def _top_k(k: int | None) -> int | None:
    """vLLM's logprobs count (-1: the whole vocabulary, which we cap at MAX_LOGPROBS)."""
    return MAX_LOGPROBS if k == -1 else k


def _choice(sample: CompletionOutput, params: SamplingParams, out: RequestOutput) -> dict:
    logprobs = None
    if params.logprobs is not None and sample.logprobs is not None:
        tops = sample.top_logprobs or [None] * len(sample.token_ids)
        logprobs = {"content": [_logprob_entry(t, lp, top, params.logprobs)
                                for t, lp, top in zip(sample.token_ids, sample.logprobs, tops)]}
    return {"index": sample.index, "finish_reason": sample.finish_reason or "stop",
            "stop_reason": sample.stop_reason, "token_ids": sample.token_ids, "logprobs": logprobs,
            "routed_experts": None if sample.routed_experts is None else _npy_base64(sample.routed_experts),
            "sampling_mask": None,
            "weight_versions": spans(sample.token_weight_versions),
            "num_preemptions": sample.num_preemptions}


def _logprob_entry(token: int, logprob: float, top: dict[int, float] | None, k: int) -> dict:
    ranked = sorted((top or {}).items(), key=lambda item: -item[1])
    rank = _rank(token, top)
    entries = [(token, logprob, rank)] + [(t, lp, i + 1) for i, (t, lp) in enumerate(ranked) if t != token]
    return {"token_id": token, "logprob": _finite(logprob), "rank": rank,
            "top_logprobs": [{"token_id": t, "logprob": _finite(lp), "rank": r} for t, lp, r in entries[:max(k, 1)]]}


def _rank(token: int, top: dict[int, float] | None) -> int | None:
    """The 1-based rank of `token` among the top logprobs given (None when it is not among them)."""
    ranked = sorted((top or {}).items(), key=lambda item: -item[1])
    return next((i + 1 for i, (t, _) in enumerate(ranked) if t == token), None)


def _npy_base64(routed: torch.Tensor) -> str:
    """vLLM's routed_experts: base64 of the .npy bytes of [positions fed, MoE layers, top_k]."""
    buffer = io.BytesIO()
    numpy.save(buffer, routed.to(torch.int32).numpy())
    return base64.b64encode(buffer.getvalue()).decode()


def _packed_routes(routed: torch.Tensor) -> dict:
    """SkyRL's packed routed experts: {"data": base64 of the ids in the narrowest of uint8, int16, int32, "shape",
    "dtype"}."""
    top = int(routed.max()) if routed.numel() else 0
    dtype = numpy.uint8 if top < 2**8 else numpy.int16 if top < 2**15 else numpy.int32
    ids = routed.numpy().astype(dtype)
    return {"data": base64.b64encode(ids.tobytes()).decode(), "shape": list(ids.shape), "dtype": ids.dtype.name}


RANK_TAG = "dp0:pp0:pcp0:tp0:"  # vLLM's checksum keys name the worker's ranks: one worker here


def _checksums(llm) -> dict[str, str]:
    """SHA-256 of every parameter's bytes as the engine holds it (FP8 codes and scales as stored), by vLLM's keys."""
    sums = {}
    for name, tensor in llm.named_parameters():
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        sums[RANK_TAG + name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return sums
