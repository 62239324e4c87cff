"""SGLang's native API on `fp8engine serve`: what slime/miles, AReaL and SkyRL's remote SGLang backend call.

  POST /generate {"input_ids" | "text", "sampling_params", "return_logprob", "top_logprobs_num",
       "logprob_start_len", "return_routed_experts", "rid"}: answered in SGLang's shape, one object per prompt and
       sample (a list for a batch or n > 1): {"text", "output_ids", "meta_info": {"id", "finish_reason":
       {"type": "stop", "matched": token id | string} | {"type": "length", "length": n} | {"type": "abort",
       "message"}, "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
       "output_token_logprobs": [[logprob, token id, null], ...], ...}}
  POST /pause_generation {"mode": "abort" | "in_place" | "retract"}, /continue_generation
  POST /abort_request {"rid", "abort_all"}
  GET  /get_weight_version, /health_generate, /v1/loads; GET /flush_cache (and ours, POST)
  GET  /get_server_info: the server arguments SGLang would report for this engine, by SGLang's names (slime's
       external attach compares its expected tp_size, dp_size, pp_size, ep_size, nnodes, node_rank, host, port,
       base_gpu_id, gpu_id_step and enable_memory_saver with them), plus its state (weight_version,
       max_total_num_tokens, version); /get_model_info: model_path, tokenizer_path, is_generation, weight_version
The weight routes SGLang shares with ours (/init_weights_update_group, /update_weights_from_distributed,
/update_weights_from_tensor, /update_weights_from_disk, /release_memory_occupation, /resume_memory_occupation) are
server.py's, and their replies carry SGLang's "success" and "message" beside ours.

Logprobs are those of the distribution sampled from (temperature, top-k and top-p applied; at temperature 0, greedy,
the model's log-softmax, as SGLang reports it); "logprobs_mode": "raw" | "processed" (our extension) chooses, and
`fp8engine serve --logprobs-mode` sets what requests that do not say get.
SGLang's own are log-softmax(logits / temperature), before top-k and top-p. A rid list names each prompt; a single
rid names the request (an abort by it ends every prompt). max_new_tokens beyond the context is cut to it.
"retract" pauses as "in_place" does: the requests keep their KV cache until /continue_generation.
"""

import base64
import datetime
import time
import uuid
from typing import Annotated, Literal

import torch
from fastapi import Request
from pydantic import Field, field_validator, model_validator

import fp8engine
from fp8engine.entrypoints.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    ApiError,
    Text,
    TokenIds,
    _finite,
    _OpenAIRequest,
    _Request,
    parse_json,
)
from fp8engine.entrypoints.rollouts import Rollouts, spans
from fp8engine.outputs import CompletionOutput, RequestOutput
from fp8engine.sampling_params import SamplingParams

PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}


class SglangSamplingParams(_OpenAIRequest):
    """SGLang's sampling_params (an unknown key answers 400, as SGLang's own constructor refuses it)."""

    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    # text-only options: the tokens are the same whatever they say
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None

    @field_validator("top_k")
    @classmethod
    def _off(cls, value: int) -> int:
        return -1 if value <= 0 or value >= 1 << 30 else value  # SGLang writes "off" as -1 or 1 << 30

    def engine(self, room: int, logprobs: int | None, logprobs_mode: str, prompt_logprobs: int | None,
               routed: bool) -> SamplingParams:
        """Our SamplingParams for a prompt with `room` tokens of context left (max_new_tokens beyond it is cut)."""
        structured = {k: v for k, v in (("json_schema", self.json_schema), ("regex", self.regex),
                                         ("grammar", self.ebnf)) if v is not None}
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=min(self.max_new_tokens, room), min_tokens=self.min_new_tokens, stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, seed=self.sampling_seed,
            logprobs=logprobs, logprobs_mode=logprobs_mode, prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            return_routed_experts=routed, **structured)


class SglangGenerateRequest(_Request):
    """SGLang's POST /generate (GenerateReqInput): the fields that change what is sampled are implemented or
    refused by name; the rest (e.g. "stream" false, "bootstrap_host") are ignored as in SGLang's own
    single-server setup."""

    text: Text | Annotated[list[Text], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: SglangSamplingParams | list[SglangSamplingParams] = Field(default_factory=SglangSamplingParams)
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    logprobs_mode: Literal["raw", "processed"] | None = None  # our extension (default: see the module's doc)
    stream: Literal[False] = False
    input_embeds: None = None
    image_data: None = None
    lora_path: None = None
    custom_logit_processor: None = None

    @model_validator(mode="after")
    def _one_input(self) -> "SglangGenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("input_ids: give exactly one of text and input_ids")
        return self

    def prompts(self) -> list[str | list[int]]:
        single = isinstance(self.text, str) or (self.input_ids is not None and isinstance(self.input_ids[0], int))
        prompts = [self.text if self.text is not None else self.input_ids] if single else \
            list(self.text if self.text is not None else self.input_ids)
        return prompts

    @property
    def batched(self) -> bool:
        return not (isinstance(self.text, str) or (self.input_ids is not None and isinstance(self.input_ids[0], int)))

    def params(self, count: int) -> list[SglangSamplingParams]:
        given = self.sampling_params
        if not isinstance(given, list):
            return [given] * count
        if len(given) != count:
            raise ApiError(400, f"sampling_params: {len(given)} given for {count} prompts", param="sampling_params")
        return given


class PauseGenerationRequest(_Request):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class AbortRequest(_Request):
    rid: str = ""
    abort_all: bool = False


def finish_reason(sample: CompletionOutput, max_tokens: int) -> dict | None:
    """SGLang's finish_reason object for one sample."""
    if sample.finish_reason == "length":
        return {"type": "length", "length": max_tokens}
    if sample.finish_reason == "stop":
        matched = sample.stop_reason if sample.stop_reason is not None else \
            (sample.token_ids[-1] if sample.token_ids else None)
        return {"type": "stop", "matched": matched}
    if sample.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return None


class SglangRoutes:
    """SGLang's native routes on the server `server` (server.Server)."""

    def __init__(self, server):
        self.server = server
        self.engine = server.engine
        self.rollouts: Rollouts = server.rollouts

    def routes(self) -> list[tuple[str, str, object, bool]]:
        """(method, path, handler, admin): admin routes need the admin key, the others the api key."""
        return [("POST", "/generate", self.generate, False),
                ("POST", "/pause_generation", self.pause_generation, True),
                ("POST", "/continue_generation", self.continue_generation, True),
                ("POST", "/abort_request", self.abort_request, True),
                ("GET", "/get_weight_version", self.get_weight_version, False),
                ("GET", "/health_generate", self.health_generate, False),
                ("GET", "/v1/loads", self.loads, False),
                ("GET", "/get_server_info", self.get_server_info, False),
                ("GET", "/get_model_info", self.get_model_info, False)]

    async def generate(self, request: Request) -> list[dict] | dict:
        body = parse_json(await self.server.read(request), SglangGenerateRequest)
        try:
            prompts = await self.engine.call(lambda llm: [llm.tokenize(p) for p in body.prompts()])
        except ValueError as exc:
            field = "text" if body.text is not None else "input_ids"
            raise ApiError(400, f"{field}: {exc}", param=field) from None
        samplings = body.params(len(prompts))
        logprobs = body.top_logprobs_num if body.return_logprob else None
        prompt_logprobs = logprobs if body.logprob_start_len >= 0 else None
        params = []
        for sampling, prompt in zip(samplings, prompts):
            mode = body.logprobs_mode or self.server.settings.logprobs_mode or (
                "raw" if sampling.temperature == 0 else "processed")
            room = max(self.server.max_model_len - len(prompt), 1)
            try:
                params.append(sampling.engine(room, logprobs, mode, prompt_logprobs, body.return_routed_experts))
            except ValueError as exc:
                raise ApiError(400, f"sampling_params: {exc}", param="sampling_params") from None
        rid = body.rid if isinstance(body.rid, str) else uuid.uuid4().hex
        rids = body.rid if isinstance(body.rid, list) and len(body.rid) == len(prompts) else \
            [rid if not body.batched else f"{rid}-{i}" for i in range(len(prompts))]
        start = time.perf_counter()
        outs = await self.rollouts.run(prompts, params, rid, rids if isinstance(body.rid, list) else None)
        seconds = time.perf_counter() - start
        items = [self._item(out, sample, body, p.max_tokens, seconds, rids[i])
                 for i, (out, p) in enumerate(zip(outs, params)) for sample in out.outputs]
        return items if body.batched or len(items) > 1 else items[0]

    def _item(self, out: RequestOutput, sample: CompletionOutput, body: SglangGenerateRequest, max_tokens: int,
              seconds: float, rid: str) -> dict:
        meta = {"id": rid, "finish_reason": finish_reason(sample, max_tokens),
                "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(sample.token_ids),
                "cached_tokens": out.num_cached_tokens, "weight_version": str(out.weight_version),
                "e2e_latency": seconds, "num_preemptions": sample.num_preemptions,
                "token_weight_versions": sample.token_weight_versions}
        if body.return_logprob:
            meta["output_token_logprobs"] = self._entries(sample.logprobs or [], sample.token_ids, body)
            if body.top_logprobs_num:
                meta["output_top_logprobs"] = [self._tops(top, body) for top in sample.top_logprobs or []]
            if body.logprob_start_len >= 0:
                start = body.logprob_start_len
                prompt_logprobs = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                meta["input_token_logprobs"] = self._entries(prompt_logprobs[start:], out.prompt_token_ids[start:],
                                                             body)
        if len({*sample.token_weight_versions}) > 1:  # an update with in_flight="keep" landed during it
            meta["weight_versions"] = spans(sample.token_weight_versions)
        if sample.routed_experts is not None:  # SGLang's: base64 of int32 [positions fed, layers * top_k]
            meta["routed_experts"] = base64.b64encode(sample.routed_experts.to(torch.int32).contiguous()
                                                      .numpy().tobytes()).decode()
        return {"text": sample.text, "output_ids": sample.token_ids, "meta_info": meta}

    def _entries(self, logprobs: list, token_ids: list[int], body: SglangGenerateRequest) -> list[list]:
        text = self.server.tokens.text if body.return_text_in_logprobs else (lambda _: None)
        return [[_finite(lp), t, text(t)] for lp, t in zip(logprobs, token_ids)]

    def _tops(self, top: dict[int, float] | None, body: SglangGenerateRequest) -> list[list]:
        ranked = sorted((top or {}).items(), key=lambda item: -item[1])[:body.top_logprobs_num]
        return self._entries([lp for _, lp in ranked], [t for t, _ in ranked], body)

    async def pause_generation(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), PauseGenerationRequest)
        num_aborted = await self.engine.pause(PAUSE_MODES[body.mode])
        return {"status": "ok", "message": "Generation paused successfully.", "success": True,
                "num_aborted": num_aborted}

    async def continue_generation(self) -> dict:
        await self.engine.resume()
        return {"status": "ok", "message": "Generation continued successfully.", "success": True}

    async def abort_request(self, request: Request) -> dict:
        body = parse_json(await self.server.read(request), AbortRequest)
        if not body.abort_all and not body.rid:
            raise ApiError(400, "abort_request: give a rid or abort_all: true", param="rid")
        num_aborted = await self.rollouts.abort(None if body.abort_all else [body.rid])
        return {"success": True, "num_aborted": num_aborted}

    async def get_weight_version(self) -> dict:
        return {"weight_version": str((await self.engine.stats()).weight_version)}

    async def health_generate(self) -> dict:
        """Healthy when the engine can take a request and answers one token (SGLang's probe)."""
        if self.engine.pause_mode in ("abort", "wait"):
            raise ApiError(503, f"the engine is paused (mode {self.engine.pause_mode!r})", code="paused")
        bos = (await self.engine.call(lambda llm: llm.tokenize("ok")))[:1]
        await self.rollouts.run([bos], [SamplingParams(max_tokens=1, temperature=0.0)], None)
        return {"status": "ok"}

    async def get_server_info(self) -> dict:
        """SGLang's GET /get_server_info for one engine of this process: what SGLang's ServerArgs would hold for
        it, by their names (one node, one data-parallel rank, no pipeline stages; tp_size the engine's tensor
        parallelism, ep_size it where experts are split whole), and its state. enable_memory_saver is true: the
        engine always hands its memory back on /release_memory_occupation."""
        llm, s = self.engine.engine, await self.engine.stats()
        c = llm.config
        return {"model_path": llm.model_dir, "tokenizer_path": llm.model_dir,
                "served_model_name": self.server.model_name,
                "host": self.server.settings.host, "port": self.server.settings.port,
                "dtype": c.dtype, "quantization": c.quantization, "kv_cache_dtype": c.kv_cache_dtype,
                "context_length": self.server.max_model_len, "max_running_requests": c.max_num_seqs,
                "chunked_prefill_size": c.max_num_batched_tokens, "page_size": c.block_size,
                "tp_size": c.tensor_parallel_size, "dp_size": 1, "pp_size": 1,
                "ep_size": c.tensor_parallel_size if c.expert_parallel else 1,
                "nnodes": 1, "node_rank": 0, "base_gpu_id": 0, "gpu_id_step": 1, "random_seed": c.seed,
                "enable_memory_saver": True, "enable_return_routed_experts": bool(llm.runner.moe_blocks),
                "disaggregation_mode": "null",
                "enable_deterministic_inference": c.batch_invariant, "disable_radix_cache": not c.enable_prefix_caching,
                "weight_version": str(s.weight_version), "max_total_num_tokens": s.kv_cache_capacity_tokens,
                "version": fp8engine.__version__, "engine": "fp8engine"}

    async def get_model_info(self) -> dict:
        """SGLang's GET /get_model_info: a text generation model."""
        llm, s = self.engine.engine, await self.engine.stats()
        return {"model_path": llm.model_dir, "tokenizer_path": llm.model_dir, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": str(s.weight_version),
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": llm.runner.hf_config.model_type}

    async def loads(self) -> dict:
        """SGLang's GET /v1/loads (its "core" fields; query options are ignored): one data-parallel rank."""
        s = await self.engine.stats()
        used = s.num_kv_blocks_total - s.num_kv_blocks_free
        load = {"dp_rank": 0, "num_running_reqs": s.num_running, "num_waiting_reqs": s.num_waiting,
                "num_total_reqs": s.num_running + s.num_waiting,
                "num_used_tokens": used * (s.kv_cache_capacity_tokens // max(s.num_kv_blocks_total, 1)),
                "max_total_num_tokens": s.kv_cache_capacity_tokens,
                "token_usage": used / max(s.num_kv_blocks_total, 1)}
        return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": fp8engine.__version__,
                "accelerator": None if s.device == "cpu" else s.device, "num_accelerators": int(s.device != "cpu"),
                "loads": [load]}
