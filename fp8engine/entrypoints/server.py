"""`fp8engine serve`: the OpenAI-compatible rollout server with RL endpoints.

Endpoints (every one but /health needs `Authorization: Bearer <api key>` when --api-key is set;
the RL endpoints need the admin key when --admin-key is set, else the api key; the admin key is
accepted everywhere):
  GET  /health                     liveness and pause state
  GET  /version, /v1/models, /metrics (Prometheus)
  POST /v1/completions, /v1/chat/completions   OpenAI, streaming as server-sent events
  RL:
  POST /pause {"mode": "abort"|"wait"|"keep"}   (see async_engine.py; "wait" answers once idle)
  POST /resume, POST /flush_cache
  POST /update_weights_from_disk {"path", "weight_version", "flush_cache", "in_flight", "kv_on_update"}
       reads path/*.safetensors; path must resolve inside an --allowed-weight-dir
  POST /update_weights?weight_version=V&flush_cache=true&in_flight=wait&kv_on_update=keep   body: safetensors
       (in_flight: wait | abort | keep, which lets requests go on under the new weights; kv_on_update with keep:
       keep | recompute, see LLMEngine.update_weights)
       bucketed: ?bucket=start, then ?bucket=add once per bucket (body: a safetensors file), then
       ?bucket=commit&weight_version=V (an optional last bucket as its body). Each bucket is
       validated when it arrives (names, shapes, dtypes, finite values; a pre-quantized weight and
       its _scale_inv travel in the same bucket); nothing is written before commit, which applies
       every bucket in one LLMEngine.update_weights call. A bad bucket answers 400 and discards the
       whole update, leaving the engine unchanged; a new start also discards an open one, and so does
       --bucket-timeout seconds without a bucket (a trainer that died: its buckets' memory is freed).
  POST /update_lora?scaling=S&weight_version=V&in_flight=...   body: a safetensors file of the LoRA adapter in
       PEFT's names (an engine started with --max-lora-rank); scaling per module may come instead as the
       file's metadata "lora_scaling" (JSON). Validated before anything is written (LLMEngine.update_lora)
  GET  /weight_version, /kv_scales, /stats (EngineStats, the pause mode, staged_update_bytes)
  POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
       "group_name", "backend", "timeout_s"}: join a trainer's weight-update group (it is rank 0)
  POST /update_weights_from_distributed {"names", "dtypes", "shapes", "weight_version", ...}: receive
       the tensors rank 0 broadcasts (beside generation), then apply them as /update_weights does; a
       transfer that fails answers 500, closes the group and leaves the weights as they were
  POST /destroy_weights_update_group
  POST /update_weights_from_tensor {"serialized_named_tensors": [base64 pickle of shared-memory / CUDA IPC handles],
       "load_format": null|"direct"|"flattened_bucket", "weight_version", ...}: SGLang's same-machine hand-over
       (LLMEngine.update_weights_from_tensor); a pickle naming anything but torch's rebuild functions answers 400
  Colocated RL (LLMEngine.sleep / wake_up): vLLM's POST /sleep?level=1|2&mode=abort|wait|keep (tags=weights&
       tags=kv_cache: our extension), POST /wake_up?tags=weights&tags=kv_cache, GET /is_sleeping; SGLang's POST
       /release_memory_occupation and /resume_memory_occupation {"tags": [...]} (release: level 2 unless "level": 1)
Other RL stacks' protocols: vLLM's RL API (vllm_api.py: /pause?mode=, /is_paused, /abort_requests, the weight-transfer
       routes, /inference/v1/generate, /tokenize, ...) and SGLang's native one (sglang_api.py: /generate,
       /pause_generation, /abort_request, ...). Where a path is ours too, the request's shape decides: /pause with
       query parameters or no body is vLLM's (abort, and the prefix cache cleared), with a JSON body ours;
       /update_weights with a JSON {"update_info"} is vLLM's weight transfer, {"weight_dir"} prime-rl's directory
       reload, a safetensors body ours. Replies to their forms carry their keys (vLLM's "status", SGLang's "success"
       and "message") beside ours; /resume, the same request in both, answers both.
Generation requests answer 503 while paused in "abort" or "wait" mode, and while the engine sleeps. Request and choice
extensions are listed in protocol.py; /openapi.json describes every endpoint (openapi.py).
"""

import argparse
import asyncio
import ctypes
import ctypes.util
import dataclasses
import functools
import glob
import hmac
import inspect
import json
import logging
import os
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from safetensors import SafetensorError
from starlette.exceptions import HTTPException

import fp8engine
from fp8engine import tools
from fp8engine.engine import LLMEngine
from fp8engine.entrypoints.async_engine import AsyncEngine, EngineAsleep, EnginePaused, RequestStream
from fp8engine.entrypoints.limits import LOGPROBS_MODES, MAX_BODY_BYTES, MAX_UPDATE_BYTES
from fp8engine.entrypoints.openapi import (
    EVENTS,
    JSON,
    TEXT,
    ChatCompletionResponse,
    CompletionResponse,
    describe,
)
from fp8engine.entrypoints.protocol import (
    ApiError,
    BucketQuery,
    ChatBuilder,
    ChatCompletionRequest,
    CompletionBuilder,
    CompletionRequest,
    DiskUpdateRequest,
    DirectoryUpdateRequest,
    DistributedUpdateRequest,
    LoraQuery,
    MemoryOccupationRequest,
    PauseRequest,
    ResponseBuilder,
    SamplingRequest,
    SleepQuery,
    TensorUpdateRequest,
    TokenTable,
    WakeQuery,
    WeightsGroupRequest,
    WeightUpdateOptions,
    parse_json,
    validate,
)
from fp8engine.entrypoints import sglang_api, vllm_api
from fp8engine.entrypoints.rollouts import Rollouts
from fp8engine.entrypoints.weight_transfer import WeightTransfer
from fp8engine.outputs import EngineStats, RequestOutput
from fp8engine.sampling_params import STRUCTURED
from fp8engine.weights import tensor_handles
from fp8engine.weights.loader import iter_safetensors

logger = logging.getLogger(__name__)

# What /openapi.json says of each path (the handlers parse their bodies themselves); None = raw bytes.
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/pause": PauseRequest, "/update_weights_from_disk": DiskUpdateRequest, "/update_weights": None,
                  "/init_weights_update_group": WeightsGroupRequest,
                  "/update_weights_from_distributed": DistributedUpdateRequest, "/update_lora": None,
                  "/update_weights_from_tensor": TensorUpdateRequest,
                  "/release_memory_occupation": MemoryOccupationRequest,
                  "/resume_memory_occupation": MemoryOccupationRequest,
                  # vLLM's RL API (vllm_api.py) and SGLang's native one (sglang_api.py)
                  "/abort_requests": vllm_api.AbortRequests, "/init_weight_transfer_engine": vllm_api.TransferInitBody,
                  "/finish_weight_update": vllm_api.FinishBody, "/update_weight_version": vllm_api.VersionBody,
                  "/weight_checker": vllm_api.CheckerBody, "/inference/v1/generate": vllm_api.VllmGenerateRequest,
                  "/skyrl/v1/generate": vllm_api.SkyrlGenerateRequest,
                  "/tokenize": vllm_api.TokenizeBody, "/detokenize": vllm_api.DetokenizeBody,
                  "/v1/chat/completions/render": ChatCompletionRequest, "/generate": sglang_api.SglangGenerateRequest,
                  "/pause_generation": sglang_api.PauseGenerationRequest, "/abort_request": sglang_api.AbortRequest}
QUERIES = {"/update_weights": BucketQuery, "/update_lora": LoraQuery, "/sleep": SleepQuery, "/wake_up": WakeQuery,
           "/pause": vllm_api.VllmPauseQuery, "/server_info": vllm_api.ServerInfoQuery}
RESPONSES = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionResponse}
CONTENT_TYPES = {"/v1/completions": (JSON, EVENTS), "/v1/chat/completions": (JSON, EVENTS), "/metrics": (TEXT,)}

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
UPDATE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class ServerSettings:
    """Network, security and limit options (the engine's come from EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    admin_key: str | None = None
    allowed_weight_dirs: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    max_update_bytes: int = MAX_UPDATE_BYTES
    clamp_max_tokens: bool = False  # prompt + max_tokens beyond the context: cut max_tokens, not 400
    bucket_timeout_s: float = 600.0  # an open bucketed update with no bucket for this long is dropped
    shutdown: str = "wait"  # SIGTERM: in-flight requests finish ("wait") or are aborted ("abort")
    tool_call_parser: str | None = None  # None: the model's (tools.default_parser)
    logprobs_mode: str | None = None  # "raw" | "processed" for requests that do not say; None: each API's own

    def __post_init__(self):
        if self.logprobs_mode is not None:
            if self.logprobs_mode not in LOGPROBS_MODES:
                raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                                 f"{self.logprobs_mode!r}")
            self.logprobs_mode = self.logprobs_mode.removesuffix("_logprobs")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerSettings":
        return cls(host=args.host, port=args.port, api_key=args.api_key, admin_key=args.admin_key,
                   allowed_weight_dirs=tuple(args.allowed_weight_dir or ()),
                   max_body_bytes=args.max_body_bytes, max_update_bytes=args.max_update_bytes,
                   clamp_max_tokens=args.clamp_max_tokens, bucket_timeout_s=args.bucket_timeout,
                   shutdown=args.shutdown, tool_call_parser=args.tool_call_parser,
                   logprobs_mode=args.logprobs_mode)

    @property
    def vllm_logprobs_mode(self) -> str:
        """vLLM's name of what /v1/completions and /inference/v1/generate return by default."""
        return f"{self.logprobs_mode or 'raw'}_logprobs"


def serve(args: argparse.Namespace) -> int:
    """Build the engine from the CLI options and serve until SIGTERM or SIGINT (then exit 0)."""
    from fp8engine.entrypoints.options import start_engine
    settings = ServerSettings.from_args(args)
    if settings.api_key is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", settings.host)
    app = create_app(start_engine(args), settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", access_log=False)
    _GracefulServer(config, app.state.server.engine, abort=settings.shutdown == "abort").run()
    return 0


class _GracefulServer(uvicorn.Server):
    """SIGTERM or SIGINT: stop accepting connections, let in-flight requests finish (or abort them, which
    ends their streams with finish_reason "abort"), stop the engine and return (exit status 0)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, abort: bool):
        super().__init__(config)
        self.engine, self.abort = engine, abort

    def handle_exit(self, sig, frame) -> None:
        if self.abort and not self.should_exit:
            self.engine.abort_all()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn would raise the signal again once done: exit 0 instead


def create_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine`; the engine thread runs for the app's lifespan."""
    server = Server(AsyncEngine(engine), settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        await asyncio.to_thread(server.engine.stop)

    app = FastAPI(title="fp8engine", version=fp8engine.__version__, lifespan=lifespan)
    app.state.server = server
    for method, path, handler, auth in server.routes():
        app.add_api_route(path, _weakly(handler), methods=[method],
                          dependencies=[Depends(_weakly(auth))] if auth else [])
    app.add_middleware(TrimHeapAfterUpdates)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
    describe(app, REQUEST_BODIES, QUERIES, RESPONSES, CONTENT_TYPES)
    return app


def _weakly(method: Callable) -> Callable:
    """An async bound method as a plain function that holds its object weakly, with the method's signature.
    FastAPI keeps every endpoint and dependency callable in process-wide caches (fastapi.dependencies.models, 4096
    entries): with the bound methods themselves, each app's Server, its AsyncEngine and the LLMEngine with its KV
    cache would stay alive after the app is gone (a test suite creating apps grew by an engine each)."""
    ref = weakref.WeakMethod(method)

    async def call(*args, **kwargs):
        return await ref()(*args, **kwargs)
    call.__signature__ = inspect.signature(method)
    call.__name__, call.__qualname__, call.__doc__ = method.__name__, method.__qualname__, method.__doc__
    return call


class Server:
    """Route handlers; every engine call goes through the AsyncEngine's command queue."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        llm = engine.engine
        self.engine = engine
        self.settings = settings
        self.tokens = TokenTable(llm.tokenizer)
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.vocab_size
        basename = os.path.basename(os.path.normpath(llm.model_dir))
        self.model_name = "default" if llm.config.model == "default" else basename
        self.model_names = {"default", basename}
        self.tool_call_parser = tools.check_parser(settings.tool_call_parser or tools.default_parser(llm.tokenizer))
        self.metrics = Metrics()
        self._bucket: list[tuple[str, torch.Tensor]] | None = None
        self._bucket_expiry: asyncio.TimerHandle | None = None
        self.weights_lock = asyncio.Lock()
        self.rollouts = Rollouts(engine)  # the other stacks' token-in/token-out requests, by their ids
        self.transfer = WeightTransfer(engine)  # vLLM's weight-transfer protocol (weight_transfer.py)
        self.vllm = vllm_api.VllmRoutes(self)
        self.sglang = sglang_api.SglangRoutes(self)

    def routes(self) -> list[tuple[str, str, Callable, Callable | None]]:
        user, admin = self.require_api_key, self.require_admin_key
        return [("GET", "/health", self.health, None), ("GET", "/version", self.version, user),
                ("GET", "/v1/models", self.models, user), ("GET", "/metrics", self.prometheus, user),
                ("POST", "/v1/completions", self.completions, user),
                ("POST", "/v1/chat/completions", self.chat_completions, user),
                ("POST", "/pause", self.pause, admin), ("POST", "/resume", self.resume, admin),
                ("POST", "/flush_cache", self.flush_cache, admin),
                ("POST", "/update_weights_from_disk", self.update_weights_from_disk, admin),
                ("POST", "/update_weights", self.update_weights, admin),
                ("POST", "/update_lora", self.update_lora, admin),
                ("POST", "/init_weights_update_group", self.init_weights_update_group, admin),
                ("POST", "/update_weights_from_distributed", self.update_weights_from_distributed, admin),
                ("POST", "/update_weights_from_tensor", self.update_weights_from_tensor, admin),
                ("POST", "/destroy_weights_update_group", self.destroy_weights_update_group, admin),
                ("GET", "/weight_version", self.weight_version, admin),
                ("GET", "/kv_scales", self.kv_scales, admin), ("GET", "/stats", self.stats, admin),
                ("POST", "/sleep", self.sleep, admin), ("POST", "/wake_up", self.wake_up, admin),
                ("GET", "/is_sleeping", self.is_sleeping, admin),
                ("POST", "/release_memory_occupation", self.release_memory_occupation, admin),
                ("POST", "/resume_memory_occupation", self.resume_memory_occupation, admin),
                ("GET", "/flush_cache", self.flush_cache, admin)] + [
            (method, path, handler, admin if needs_admin else user)
            for method, path, handler, needs_admin in self.vllm.routes() + self.sglang.routes()]

    async def read(self, request: Request) -> bytes:
        """A JSON route's body (at most --max-body-bytes)."""
        return await _read_body(request, self.settings.max_body_bytes)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # ----------------------------------------------------------------- auth
    async def require_api_key(self, request: Request) -> None:
        if self.settings.api_key is not None:
            _check_bearer(request, (self.settings.api_key, self.settings.admin_key))

    async def require_admin_key(self, request: Request) -> None:
        key = self.settings.admin_key or self.settings.api_key
        if key is not None:
            _check_bearer(request, (key,))

    # ----------------------------------------------------------------- info
    async def health(self) -> dict:
        return {"status": "ok", "paused": self.engine.pause_mode}

    async def version(self) -> dict:
        return {"version": fp8engine.__version__}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "fp8engine", "max_model_len": self.max_model_len}]}

    async def prometheus(self) -> Response:
        self.metrics.engine_stats.latest = await self.engine.stats()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ----------------------------------------------------------------- OpenAI
    async def completions(self, request: Request) -> Response:
        body = self._defaults(parse_json(await _read_body(request, self.settings.max_body_bytes), CompletionRequest))
        return await self._generate(request, body, CompletionBuilder(body, self.model_name, self.tokens))

    async def chat_completions(self, request: Request) -> Response:
        body = self._defaults(parse_json(await _read_body(request, self.settings.max_body_bytes),
                                         ChatCompletionRequest))
        return await self._generate(request, body, ChatBuilder(body, self.model_name, self.tokens,
                                                               self.tool_call_parser))

    def _defaults(self, body: SamplingRequest) -> SamplingRequest:
        """The server-wide defaults of what `body` leaves open (its logprobs_mode)."""
        body.logprobs_mode = body.logprobs_mode or self.settings.logprobs_mode or "raw"
        return body

    async def _generate(self, request: Request, body: SamplingRequest, builder: ResponseBuilder) -> Response:
        self.check_model(body.model)
        timer = self.metrics.timer()
        try:
            token_ids = await self.engine.call(lambda llm: self._prompt_ids(llm, body))
        except ValueError as exc:
            raise ApiError(400, str(exc), param=body.prompt_field) from None
        try:
            grammar = self._forced_call_grammar(body)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        try:
            params = [body.sampling_params(self._max_tokens(body, len(ids)), grammar) for ids in token_ids]
        except ValueError as exc:
            raise _bad_request(exc, body=body) from None
        try:
            stream = await self.engine.add(token_ids, params, builder.id)
        except ValueError as exc:
            raise _bad_request(exc, default_param=body.prompt_field, body=body) from None
        except EnginePaused as exc:
            raise ApiError(503, str(exc), code="paused") from None
        except EngineAsleep as exc:
            raise ApiError(503, str(exc), code="sleeping") from None
        if body.stream:
            events = _sse_events(stream, builder, timer, body.include_usage)
            return _EventStream(events, stream)
        try:
            finals = await _until_disconnect(request, _final_outputs(stream, timer))
        finally:
            stream.close()
        if finals is None:
            return Response(status_code=499)
        return JSONResponse(builder.response(finals))

    def _prompt_ids(self, llm: LLMEngine, body: SamplingRequest) -> list[list[int]]:
        """Each prompt's token ids: completions as the engine tokenizes them; a chat rendered with its tools, or
        its new messages appended to history_token_ids (tools.py)."""
        if not isinstance(body, ChatCompletionRequest):
            return [llm.tokenize(p) for p in body.prompts()]
        if body.history_token_ids is None:
            return [tools.render_ids(llm.tokenizer, body.message_dicts(), body.tool_dicts)]
        history = llm.tokenize(body.history_token_ids)
        new = body.new_messages()
        if not new:
            raise ValueError("messages: with history_token_ids, at least one message must follow the last "
                             "assistant message")
        return [history + tools.continuation_ids(llm.tokenizer, history, new, llm.eos_token_ids)]

    def _forced_call_grammar(self, body: SamplingRequest) -> str | None:
        if not isinstance(body, ChatCompletionRequest) or not body.forces_call:
            return None
        return tools.forced_call_grammar(self.tool_call_parser, body.tool_dicts, body.forced_function)

    def _max_tokens(self, body: SamplingRequest, num_prompt_tokens: int) -> int:
        """max_tokens of one prompt: as asked when it fits the context, else 400 (or cut, with
        --clamp-max-tokens); unset = what the context has left."""
        room = self.max_model_len - num_prompt_tokens
        asked = body.max_new_tokens
        if asked is None:
            return max(room, 1)  # a prompt that fills the context is refused by the engine
        if asked <= room:
            return asked
        if self.settings.clamp_max_tokens and room >= 1:
            return room
        field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise ApiError(400, f"the prompt ({num_prompt_tokens} tokens) + {field} ({asked}) = "
                            f"{num_prompt_tokens + asked} tokens exceeds the model's context of "
                            f"{self.max_model_len} tokens", param=field, code="context_length_exceeded")

    # ----------------------------------------------------------------- RL
    async def pause(self, request: Request) -> dict:
        """Ours with a JSON body {"mode"} (default "wait"); vLLM's with query parameters or no body at all (mode
        "abort" by default, and the prefix cache cleared), whose reply carries our keys beside vLLM's "status"."""
        data = await _read_body(request, self.settings.max_body_bytes)
        if request.query_params and data.strip():
            raise ApiError(400, "mode: give it as a query parameter (vLLM's /pause) or in a JSON body (ours), not "
                                "both", param="mode")
        if request.query_params or not data.strip():
            return await self.vllm.pause(request)
        body = parse_json(data, PauseRequest)
        num_aborted = await self.engine.pause(body.mode)
        return {"paused": body.mode, "num_aborted": num_aborted}

    async def resume(self) -> dict:
        await self.engine.resume()
        return {"paused": None, "status": "resumed"}

    async def flush_cache(self) -> dict:
        await self.engine.call(LLMEngine.flush_prefix_cache)
        return {"flushed": True}

    async def weight_version(self) -> dict:
        return {"weight_version": (await self.engine.stats()).weight_version}

    async def kv_scales(self) -> dict:
        scales = (await self.engine.stats()).kv_scales
        return {layer: {"k_scale": k, "v_scale": v} for layer, (k, v) in scales.items()}

    async def stats(self) -> dict:
        staged = sum(t.numel() * t.element_size() for _, t in self._bucket or ())
        return dataclasses.asdict(await self.engine.stats()) | {"paused": self.engine.pause_mode,
                                                                 "staged_update_bytes": staged}

    # vLLM's sleep routes (query parameters) and SGLang's (a JSON body), on LLMEngine.sleep / wake_up
    async def sleep(self, request: Request) -> dict:
        """vLLM's query parameters; with none, a JSON body of the same fields (older SkyRL, AReaL's {})."""
        query = _query_lists(request, ("tags",))
        data = await _read_body(request, self.settings.max_body_bytes)
        query = validate(SleepQuery, query) if query or not data.strip() else parse_json(data, SleepQuery)
        return await self._sleep(query.level, query.tags, query.mode)

    async def wake_up(self, request: Request) -> dict:
        query = validate(WakeQuery, _query_lists(request, ("tags",)))
        return await self._wake(query.tags)

    async def is_sleeping(self) -> dict:
        return {"is_sleeping": await self.engine.call(LLMEngine.is_sleeping)}

    async def release_memory_occupation(self, request: Request) -> dict:
        body = parse_json(await _read_body(request, self.settings.max_body_bytes), MemoryOccupationRequest)
        return await self._sleep(body.level, body.engine_tags(), body.mode)

    async def resume_memory_occupation(self, request: Request) -> dict:
        body = parse_json(await _read_body(request, self.settings.max_body_bytes), MemoryOccupationRequest)
        return await self._wake(body.engine_tags())

    async def _sleep(self, level: int, tags: list[str] | None, mode: str) -> dict:
        async with self.weights_lock:
            try:
                report = await self.engine.sleep(level, tags, mode)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="tags") from None
        return dataclasses.asdict(report) | {"is_sleeping": True, "status": "sleeping", "success": True,
                                             "message": f"released {report.num_bytes} bytes"}

    async def _wake(self, tags: list[str] | None) -> dict:
        async with self.weights_lock:
            try:
                report = await self.engine.call(lambda llm: llm.wake_up(tags))
            except ValueError as exc:
                raise ApiError(400, str(exc), param="tags") from None
            sleeping = await self.engine.call(LLMEngine.is_sleeping)
        return dataclasses.asdict(report) | {"is_sleeping": sleeping, "status": "sleeping" if sleeping else "awake",
                                             "success": True, "message": f"restored {report.num_bytes} bytes"}

    async def update_weights_from_disk(self, request: Request) -> dict:
        body = parse_json(await _read_body(request, self.settings.max_body_bytes), DiskUpdateRequest)
        if body.abort_all_requests:
            body.in_flight = "abort"
        return _sglang_reply(await self._apply_directory(body.path, body, "path"))

    async def update_weights(self, request: Request) -> dict:
        data = await _read_body(request, self.settings.max_update_bytes)
        if _is_json_object(request, data):  # a safetensors body is never JSON
            if "weight_dir" in json.loads(data):  # prime-rl's server: reload from a directory
                return await self._update_from_directory(data)
            return await self.vllm.update_weights(data)  # vLLM's {"update_info"}
        query = validate(BucketQuery, dict(request.query_params))
        async with self.weights_lock:
            if query.bucket is None:
                return await self._apply(await _load_safetensors(data), query)
            return await self._bucketed(query, data)

    async def _update_from_directory(self, data: bytes) -> dict:
        """prime-rl's POST /update_weights {"weight_dir"}: /update_weights_from_disk's rules and update."""
        body = parse_json(data, DirectoryUpdateRequest)
        return await self._apply_directory(body.weight_dir, body, "weight_dir") | {"status": "ok"}

    async def _apply_directory(self, path: str, options: WeightUpdateOptions, param: str) -> dict:
        """Apply the safetensors files of `path` (inside an --allowed-weight-dir) as one update."""
        directory = self._allowed_directory(path)
        try:
            tensors = await asyncio.to_thread(lambda: list(iter_safetensors(directory)))
        except ValueError as exc:
            raise ApiError(400, str(exc), param=param) from None
        async with self.weights_lock:
            return await self._apply(tensors, options)

    async def update_weights_from_tensor(self, request: Request) -> dict:
        body = parse_json(await _read_body(request, self.settings.max_body_bytes), TensorUpdateRequest)
        try:  # maps the trainer's shared memory; the pickle may name only torch's rebuild functions
            tensors = await asyncio.to_thread(tensor_handles.named_tensors, body.serialized_named_tensors,
                                              body.load_format)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="serialized_named_tensors") from None
        async with self.weights_lock:
            return _sglang_reply(await self._apply(tensors, body))

    async def update_lora(self, request: Request) -> dict:
        query = validate(LoraQuery, dict(request.query_params))
        data = await _read_body(request, self.settings.max_update_bytes)
        tensors = await _load_safetensors(data)
        scaling = _lora_scaling(data) if query.scaling is None else query.scaling
        if scaling is None:
            raise ApiError(400, "scaling is missing: give ?scaling= or the body's metadata \"lora_scaling\"",
                           param="scaling")
        async with self.weights_lock:
            try:
                report = await self.engine.update_lora(
                    tensors, scaling, weight_version=query.weight_version, flush_cache=query.flush_cache,
                    in_flight=query.in_flight, kv_on_update=query.kv_on_update)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="adapter") from None
        self.metrics.update_seconds.observe(report.seconds)
        return dataclasses.asdict(report)

    async def _bucketed(self, query: BucketQuery, data: bytes) -> dict:
        if query.bucket == "start":
            self._bucket = []
            self._expire_bucket_after(self.settings.bucket_timeout_s)
            return {"bucket": "started"}
        if self._bucket is None:
            raise ApiError(409, f"bucket={query.bucket} without an open update; send bucket=start first",
                           param="bucket", code="no_open_update")
        if data or query.bucket == "add":
            await self._add_bucket(data)
        if query.bucket == "add":
            self._expire_bucket_after(self.settings.bucket_timeout_s)
            return {"bucket": "added", "num_tensors": len(self._bucket),
                    "num_bytes": sum(t.numel() * t.element_size() for _, t in self._bucket)}
        tensors, self._bucket = self._bucket, None
        return await self._apply(tensors, query)

    def _expire_bucket_after(self, seconds: float) -> None:
        """Drop the open bucketed update (and the memory of its buckets) unless another bucket or the
        commit arrives within `seconds`: a trainer that dies between buckets leaves nothing behind."""
        if self._bucket_expiry is not None:
            self._bucket_expiry.cancel()
        bucket = self._bucket
        self._bucket_expiry = asyncio.get_running_loop().call_later(
            seconds, lambda: asyncio.ensure_future(self._expire_bucket(bucket)))

    async def _expire_bucket(self, bucket: list) -> None:
        async with self.weights_lock:
            if self._bucket is bucket:
                logger.warning("no bucket for %.0f s: the open weight update (%d tensors) is dropped",
                               self.settings.bucket_timeout_s, len(bucket))
                self._bucket = None

    # The group's calls block on the other ranks: they run in worker threads, beside the engine
    # thread's generation, and only the received tensors go through the engine's queue.
    async def init_weights_update_group(self, request: Request) -> dict:
        body = parse_json(await _read_body(request, self.settings.max_body_bytes), WeightsGroupRequest)
        try:
            await asyncio.to_thread(self.engine.engine.init_weights_update_group, **body.model_dump())
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        except RuntimeError as exc:
            raise ApiError(500, f"could not join the weight-update group: {exc}") from None
        return {"group_name": body.group_name, "rank": body.rank_offset, "world_size": body.world_size,
                "success": True, "message": "joined the weight-update group"}

    async def update_weights_from_distributed(self, request: Request) -> dict:
        body = parse_json(await _read_body(request, self.settings.max_body_bytes), DistributedUpdateRequest)
        async with self.weights_lock:
            llm = self.engine.engine
            prequantizer = llm.prequantizer()
            try:
                tensors = await asyncio.to_thread(llm.receive_weights, body.names, body.dtypes, body.shapes,
                                                  prequantizer)
            except ValueError as exc:
                raise ApiError(400, str(exc)) from None
            except RuntimeError as exc:
                raise ApiError(500, str(exc), code="broadcast_failed") from None
            return _sglang_reply(await self._apply(tensors, body, lambda report: llm.received_report(
                report, body.names, prequantizer)))

    async def destroy_weights_update_group(self) -> dict:
        await asyncio.to_thread(self.engine.engine.destroy_weights_update_group)
        return {"destroyed": True}

    async def _add_bucket(self, data: bytes) -> None:
        try:
            tensors = await _load_safetensors(data)
            await self.engine.call(lambda llm: llm.check_weights(tensors))
        except (ApiError, ValueError) as exc:
            self._bucket = None
            raise ApiError(400, f"bad bucket, the whole update is discarded: {exc}", param="body") from None
        self._bucket += tensors

    async def _apply(self, tensors: list[tuple[str, torch.Tensor]], options: WeightUpdateOptions,
                     reported=lambda report: report) -> dict:
        try:
            report = reported(await self.engine.update_weights(tensors, weight_version=options.weight_version,
                                                               flush_cache=options.flush_cache,
                                                               in_flight=options.in_flight,
                                                               kv_on_update=options.kv_on_update))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="weights") from None
        self.metrics.update_seconds.observe(report.seconds)
        return dataclasses.asdict(report)

    def _allowed_directory(self, path: str) -> str:
        roots = [os.path.realpath(d) for d in self.settings.allowed_weight_dirs]
        if not roots:
            raise ApiError(403, "update_weights_from_disk is disabled: start the server with "
                                "--allowed-weight-dir", param="path", code="no_allowed_weight_dir")
        real = os.path.realpath(path)
        if ".." in Path(path).parts or not any(_inside(real, r) for r in roots):
            raise ApiError(403, f"path {path!r} is outside the allowed weight directories", param="path",
                           code="path_not_allowed")
        if not os.path.isdir(real):
            raise ApiError(400, f"path {path!r} is not a directory", param="path")
        escaping = [f for f in glob.glob(os.path.join(real, "*.safetensors"))
                    if not any(_inside(os.path.realpath(f), r) for r in roots)]
        if escaping:
            raise ApiError(403, f"{os.path.basename(escaping[0])!r} links outside the allowed weight "
                                f"directories", param="path", code="path_not_allowed")
        return real


# --------------------------------------------------------------------- streaming
class _EventStream(StreamingResponse):
    """Server-sent events that abort the requests behind them however the response ends."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


async def _sse_events(stream: RequestStream, builder: ResponseBuilder, timer: "Timer",
                      include_usage: bool) -> AsyncIterator[str]:
    try:
        async for index, out in stream:
            timer.tick(index, out)
            choices = builder.chunk_choices(index, out)
            if choices:
                yield _event(builder.chunk(choices))
        if include_usage:
            yield _event(builder.chunk([], usage=builder.usage()))
    except Exception as exc:
        logger.exception("stream %s failed", builder.id)
        yield _event(ApiError(500, f"generation failed ({type(exc).__name__}); the server log has the "
                                   f"details").body())
    yield "data: [DONE]\n\n"


# Characters JSON leaves raw with ensure_ascii=False that str.splitlines (and so httpx's aiter_lines and other
# line-splitting SSE clients) takes for line ends: a sampled token that decodes to one cut an event in two
# during a soak. Escaped, the event stays one line and the JSON the same value.
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def _event(payload: dict) -> str:
    data = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"


async def _final_outputs(stream: RequestStream, timer: "Timer") -> dict[int, RequestOutput]:
    finals = {}
    async for index, out in stream:
        timer.tick(index, out)
        finals[index] = out
    return finals


async def _until_disconnect(request: Request, work):
    """Await `work`, or return None as soon as the client disconnects (the work is cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()
    return task.result() if task in done else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --------------------------------------------------------------------- metrics
class Metrics:
    """Prometheus metrics: engine counters read at scrape time, latencies observed as they happen."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.engine_stats = _EngineStatsCollector()
        self.registry.register(self.engine_stats)
        self.ttft = Histogram("fp8engine_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("fp8engine_inter_token_latency_seconds",
                             "Time between consecutive token steps of a request",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.update_seconds = Histogram("fp8engine_update_weights_seconds", "update_weights duration",
                                        buckets=UPDATE_BUCKETS, registry=self.registry)

    def timer(self) -> "Timer":
        return Timer(self)


class Timer:
    """Observes time to first token and inter-token latency of one HTTP request."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.last = time.perf_counter()
        self.first = True
        self.num_tokens: dict[int, int] = {}

    def tick(self, prompt_index: int, out: RequestOutput) -> None:
        count = sum(len(s.token_ids) for s in out.outputs)
        if count <= self.num_tokens.get(prompt_index, 0):
            return
        self.num_tokens[prompt_index] = count
        now = time.perf_counter()
        (self.metrics.ttft if self.first else self.metrics.itl).observe(now - self.last)
        self.first, self.last = False, now


class _EngineStatsCollector:
    """Exposes the latest EngineStats snapshot (refreshed by each /metrics scrape)."""

    def __init__(self):
        self.latest: EngineStats | None = None

    def collect(self):
        s = self.latest
        if s is None:
            return
        yield CounterMetricFamily("fp8engine_num_preemptions", "Sequences preempted (recompute)",
                                  value=s.num_preemptions_total)
        yield CounterMetricFamily("fp8engine_prompt_tokens", "Prompt tokens computed", value=s.num_prompt_tokens_total)
        yield CounterMetricFamily("fp8engine_generation_tokens", "Tokens generated",
                                  value=s.num_generation_tokens_total)
        yield CounterMetricFamily("fp8engine_spec_draft_tokens", "Speculative draft tokens verified",
                                  value=s.spec_draft_tokens)
        yield CounterMetricFamily("fp8engine_spec_accepted_tokens", "Speculative draft tokens accepted (each equal "
                                  "to the token sampled at its position)", value=s.spec_accepted_tokens)
        gauges = {"num_requests_running": (s.num_running, "Sequences (samples) running"),
                  "num_requests_waiting": (s.num_waiting, "Sequences (samples) waiting"),
                  "kv_blocks_used": (s.num_kv_blocks_total - s.num_kv_blocks_free, "KV blocks in use"),
                  "kv_blocks_total": (s.num_kv_blocks_total, "KV blocks in the cache"),
                  "weight_version": (s.weight_version, "Weight version being served"),
                  "is_sleeping": (int(bool(s.sleeping)), "1 while a tag is released by sleep")}
        for name, (value, doc) in gauges.items():
            yield GaugeMetricFamily(f"fp8engine_{name}", doc, value=value)
        resident = GaugeMetricFamily("fp8engine_resident_bytes", "Bytes a sleep tag holds now (0 while it sleeps)",
                                     labels=["tag"])
        for tag, nbytes in s.resident_bytes.items():
            resident.add_metric([tag], nbytes)
        yield resident
        scales = GaugeMetricFamily("fp8engine_kv_scale", "Current FP8 KV-cache scale", labels=["layer", "tensor"])
        for layer, (k, v) in s.kv_scales.items():
            scales.add_metric([layer, "k"], k)
            scales.add_metric([layer, "v"], v)
        yield scales


# --------------------------------------------------------------------- helpers
def _query_lists(request: Request, repeated: tuple[str, ...]) -> dict:
    """The query parameters, those in `repeated` as the list of every value given (absent: left out)."""
    query = dict(request.query_params)
    for name in repeated:
        values = request.query_params.getlist(name)
        if values:
            query[name] = values
    return query


WEIGHT_UPDATE_PATHS = ("/update_weights", "/update_weights_from_disk", "/update_weights_from_distributed",
                       "/update_weights_from_tensor")


class TrimHeapAfterUpdates:
    """ASGI middleware: after a weight-update request, hand the allocator's free pages back to the OS.

    An update moves the whole model through this process (the body, its chunks, the parsed tensors, the
    staged copies): hundreds of MB freed in pieces that glibc keeps in its arenas, so the RSS of a server
    updated every RL step crept up (+17% in a 10-minute soak). Once the app has answered, the handler's
    locals are gone and their memory is free to trim. (Plain ASGI, not BaseHTTPMiddleware, so streamed
    responses and client disconnects pass through untouched.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)
        if scope["type"] == "http" and scope["path"] in WEIGHT_UPDATE_PATHS:
            await asyncio.to_thread(trim_heap)


@functools.cache
def _libc_malloc_trim():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)  # glibc only


def trim_heap() -> bool:
    """malloc_trim(0) where the C library has it (glibc); whether memory was returned to the OS."""
    trim = _libc_malloc_trim()
    return bool(trim(0)) if trim is not None else False


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body; ApiError 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes", param="body",
                    code="body_too_large")


def _lora_scaling(data: bytes) -> dict | None:
    """The "lora_scaling" entry of a safetensors file's metadata (module name -> number), if it has one."""
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
    if "lora_scaling" not in metadata:
        return None
    try:
        scaling = json.loads(metadata["lora_scaling"])
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body's metadata lora_scaling is not JSON: {exc}", param="scaling") from None
    if not isinstance(scaling, dict):
        raise ApiError(400, "the body's metadata lora_scaling must map module names to numbers", param="scaling")
    return scaling


async def _load_safetensors(data: bytes) -> list[tuple[str, torch.Tensor]]:
    if not data:
        raise ApiError(400, "the body must be a safetensors file, got an empty body", param="body")
    try:
        return list((await asyncio.to_thread(safetensors.torch.load, data)).items())
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise ApiError(400, f"the body is not a valid safetensors file: {exc}", param="body") from None


def _sglang_reply(report: dict) -> dict:
    """A weight route SGLang has too: our report with SGLang's keys beside it."""
    return report | {"success": True, "message": f"weight version {report['weight_version']}",
                     "num_paused_requests": 0}


def _is_json_object(request: Request, data: bytes) -> bool:
    """Whether a body is a JSON object sent as JSON (vLLM's shape of a route we also take other bodies on)."""
    if not request.headers.get("content-type", "").startswith("application/json"):
        return False
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


def _check_bearer(request: Request, keys: tuple[str | None, ...]) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode()
    if scheme.lower() != "bearer" or not any(k and hmac.compare_digest(given, k.encode()) for k in keys):
        raise ApiError(401, "missing or invalid key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _bad_request(exc: ValueError, default_param: str | None = None, body: SamplingRequest | None = None) -> ApiError:
    """400 naming the request field behind a SamplingParams error (a structured output's: the field that asked
    for it)."""
    message = str(exc)
    match = re.search(r"SamplingParams\.(\w+)", message)
    named = re.match(r"(\w+): ", message)  # a request check that names its field first
    param = match.group(1) if match else named.group(1) if named else default_param
    if match and param in STRUCTURED and body is not None:
        forced = isinstance(body, ChatCompletionRequest) and body.forces_call
        param = "tools" if forced else "response_format" if body.response_format else "structured_outputs"
        message = message.replace(match.group(0), param, 1)
    return ApiError(400, message, param=param)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return await _api_error(request, ApiError(exc.status_code, str(exc.detail)))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return await _api_error(request, ApiError(400, str(exc)))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    # The body names the error's type only: messages and tracebacks (paths, values) stay in the log.
    return await _api_error(request, ApiError(500, f"internal error ({type(exc).__name__}); the server log "
                                                   f"has the details"))
