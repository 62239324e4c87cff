"""OpenAI request models and response shapes, with fp8engine's extensions.

OpenAI fields that work as OpenAI documents: model, prompt / messages, n, temperature, top_p,
max_tokens (completions: 0 computes and scores the prompt only) / max_completion_tokens, stop,
seed, stream, stream_options (with stream), logprobs, top_logprobs, echo (completions: the prompt,
its tokens and logprobs come first, the first token's logprob null), presence_penalty,
frequency_penalty, logit_bias, user (an end-user id; like OpenAI's, it changes no output),
response_format (text, json_object, json_schema: the output follows it, structured.py), and on chat tools,
tool_choice ("none" | "auto" | "required" | {"type": "function", "function": {"name"}}; "required" and a named
function force exactly one call whose arguments follow the function's parameters), parallel_tool_calls, tool
results as role "tool" messages with tool_call_id and assistant messages with tool_calls (tools.py renders them);
the no-op values best_of == n, suffix "", functions [], modalities ["text"], store false. Any other field or
value (suffix insertion, best_of > n, audio, ...) answers 400 naming it: none is silently ignored.

Logprobs are raw by default here (log-softmax of the model's logits, before temperature, penalties and
truncation, as in vLLM), so temperature 0 still gives k alternatives; `logprobs_mode: "processed"`
asks for the distribution actually sampled from, and `fp8engine serve --logprobs-mode processed` (vLLM's
`--logprobs-mode processed_logprobs`) makes that the default of requests that do not say. Echoed prompt
logprobs are always raw.

Request extensions (both endpoints): top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
repetition_penalty, return_token_ids, return_tokens_as_token_ids (vLLM's: every token in logprobs, top
logprobs included, written "token_id:<id>" instead of its text, so that tokens with the same text stay apart),
logprobs_mode ("raw" | "processed", default the server's --logprobs-mode, raw unless set),
return_routed_experts (MoE models), structured_outputs ({"json": schema} | {"regex": ...} | {"grammar": EBNF},
vLLM's names). Chat only: history_token_ids, the exact token ids of the conversation up to and including its
last assistant message (the previous response's prompt_token_ids + token_ids, or an episode's history): the
messages after that last assistant message are rendered alone and appended, so earlier turns are never
re-rendered or re-tokenized (tools.continuation_ids; vLLM has no such field).
Choice extensions: logprobs_mode, num_preemptions, weight_version (the version of the choice's last token),
token_weight_versions (the version that sampled each token; a choice spans versions only across an update
with in_flight=keep); token_ids and prompt_token_ids
with return_token_ids; log_kept_mass (per token, processed logprobs only) when logprobs are
requested; seed (the request's sampling seed, drawn by the engine when none was given: with the
same request it reproduces the choice), in a stream's first chunk of each choice; routed_experts
with return_routed_experts, [positions fed][MoE layers][top_k] expert ids, once the choice finishes.
In streams, token_ids / token_weight_versions / log_kept_mass hold the chunk's new tokens only.
"""

import itertools
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from fp8engine import tools
from fp8engine.engine import Prompt
from fp8engine.outputs import CompletionOutput, RequestOutput
from fp8engine.sampling_params import SamplingParams

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP = 32  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string (the stop check decodes a window ~4x this many tokens)
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MIN_TEMPERATURE = 0.01  # below this (and above 0) logits / T overflows float32; vLLM clamps to it
MIN_LOGPROB = -9999.0  # stands for -inf, which JSON cannot carry
RESPONSE_FORMATS = ("{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name', "
                    "'schema', 'description', 'strict'}}")

M = TypeVar("M", bound=BaseModel)
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                409: "conflict_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with HTTP `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        default = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": _ERROR_TYPES.get(self.status, default),
                          "param": self.param, "code": self.code}}


def parse_json(body: bytes, model: type[M]) -> M:
    """Validate a JSON request body against `model`; ApiError 400 names the offending field."""
    try:
        data = json.loads(body) if body.strip() else {}
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return validate(model, data)


def validate(model: type[M], data: dict) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        error = errors[0]
        loc = ".".join(str(x) for x in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        field = model.model_fields.get(str(error["loc"][0])) if error["loc"] else None
        if field is not None and field.description and len({e["loc"][:1] for e in errors}) == 1 < len(errors):
            loc, message = str(error["loc"][0]), f"must be {field.description}"  # no form of a union fits
        if error["type"] == "extra_forbidden":
            what = UNSUPPORTED.get(str(error["loc"][-1]), "does not know it")
            message = f"unsupported field: fp8engine {what}, and rejects what it does not implement " \
                      f"rather than ignore it"
        named = re.match(r"(\w+): ", message) if not error["loc"] else None  # a check across fields names one
        if named and named.group(1) in model.model_fields:
            raise ApiError(400, message, param=named.group(1)) from None
        raise ApiError(400, f"{loc or 'request'}: {message}",
                       param=str(error["loc"][0]) if error["loc"] else None) from None


UNSUPPORTED = {name: f"does not implement {what}" for name, what in (
    ("functions", "the deprecated function calling (use tools)"),
    ("function_call", "the deprecated function calling (use tools and tool_choice)"),
    ("audio", "audio output"), ("prediction", "predicted outputs"), ("reasoning_effort", "reasoning models"),
    ("web_search_options", "web search"), ("service_tier", "service tiers"),
    ("metadata", "stored completions"), ("verbosity", "verbosity control"))}


# ---------------------------------------------------------------------- requests
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _OpenAIRequest(_Request):
    """OpenAI bodies: an unknown field answers 400 instead of being ignored; numbers are finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_OpenAIRequest):
    include_usage: bool = False


def _only(allowed, what: str):
    """A field validator accepting only the values in `allowed` (OpenAI no-ops here)."""
    def check(cls, value):
        if value not in allowed:
            raise ValueError(f"only {' or '.join(map(repr, allowed))} is supported: fp8engine does not "
                             f"implement {what}")
        return value
    return classmethod(check)


class SamplingRequest(_OpenAIRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    prompt_field: ClassVar[str] = "prompt"
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, json_schema_extra={
        "anyOf": [{"const": 0}, {"minimum": MIN_TEMPERATURE}]})
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=0)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] = Field(
        default_factory=list,
        description=f"a string or a list of at most {MAX_STOP} strings, of at most {MAX_STOP_CHARS} characters each",
        json_schema_extra={"anyOf": [
            {"type": "string", "maxLength": MAX_STOP_CHARS},
            {"type": "array", "items": {"type": "string", "maxLength": MAX_STOP_CHARS}, "maxItems": MAX_STOP}]})
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    return_routed_experts: bool = False
    logprobs_mode: Literal["raw", "processed"] | None = None  # None: the server's --logprobs-mode (server.py)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS, json_schema_extra={
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    user: str | None = None
    response_format: dict | None = Field(None, description=RESPONSE_FORMATS, json_schema_extra={"oneOf": [
        {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"],
         "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "json_schema"}, "json_schema": {
            "type": "object", "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                                             "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}},
            "required": ["name"], "additionalProperties": False}},
         "required": ["type", "json_schema"], "additionalProperties": False}]})
    structured_outputs: dict | None = Field(None, description="one of {'json': schema}, {'regex': str}, "
                                            "{'grammar': EBNF}", json_schema_extra={
        "type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
        "properties": {"json": {"type": ["object", "string"]}, "regex": {"type": "string", "minLength": 1},
                       "grammar": {"type": "string", "minLength": 1}}})

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: dict | None) -> dict | None:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind in ("text", "json_object") and set(value) == {"type"}:
            return value
        spec = value.get("json_schema") if kind == "json_schema" else None
        if isinstance(spec, dict) and set(value) == {"type", "json_schema"} and isinstance(spec.get("name"), str) \
                and set(spec) <= {"name", "description", "schema", "strict"} \
                and isinstance(spec.get("schema", {}), dict):
            return value
        raise ValueError(f"must be {RESPONSE_FORMATS}")

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: dict | None) -> dict | None:
        if value is not None and (len(value) != 1 or not set(value) <= {"json", "regex", "grammar"}):
            raise ValueError(f"must hold exactly one of json, regex, grammar, got {sorted(value)}")
        return value

    def structured(self) -> dict:
        """SamplingParams' structured-output option this request asks for ({} for none)."""
        fmt = self.response_format or {"type": "text"}
        if fmt["type"] != "text" and self.structured_outputs:
            raise ValueError("response_format: give either response_format or structured_outputs, not both")
        if fmt["type"] == "json_object":
            return {"json_schema": {"type": "object"}}
        if fmt["type"] == "json_schema":
            return {"json_schema": fmt["json_schema"].get("schema", {})}  # {}: any JSON value
        if self.structured_outputs:
            (name, value), = self.structured_outputs.items()
            return {{"json": "json_schema"}.get(name, name): value}
        return {}

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, value: str | list[str]) -> str | list[str]:
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(cls, value: StreamOptions | None, info) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream=true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if abs(bias) > 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int, grammar: str | None = None) -> SamplingParams:
        """SamplingParams of this request generating up to `max_tokens` (grammar: a forced tool call's, which
        replaces any other structured output); ValueError names the offending field."""
        structured = {"grammar": grammar} if grammar is not None else self.structured()
        return SamplingParams(**structured,
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed,
            logprobs=self.num_logprobs, logprobs_mode=self.logprobs_mode or "raw",
            return_routed_experts=self.return_routed_experts,
            prompt_logprobs=self.num_prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions; `prompt` is text, token ids, or a list of either (one choice group each)."""

    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1)] = Field(description="a non-empty string, a non-empty list of token "
                                                     "ids (ints >= 0), or a non-empty list of either")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = Field(None, json_schema_extra={"enum": ["", None]})

    _no_suffix = field_validator("suffix")(_only([""], "suffix insertion"))

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, value: int | None, info) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"only best_of == n ({n}) is supported: fp8engine does not implement "
                             f"best-of reranking")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[Prompt]:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


class FunctionCall(_OpenAIRequest):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallMessage(_OpenAIRequest):
    """A tool call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"]}}]}
_NO_CALLS = {"tool_calls": {"type": "null"}}


class ChatMessage(_OpenAIRequest):
    """A chat message: content required, except in an assistant message with tool_calls; a tool result names its
    call (tool_call_id)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT, **_NO_CALLS},
         "required": ["content"]},
        {"properties": {"role": {"const": "assistant"}, "content": _CONTENT}, "required": ["content"]},
        {"properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
         "required": ["tool_calls"]},
        {"properties": {"role": {"const": "tool"}, "content": _CONTENT, "tool_call_id": {"type": "string",
                                                                                         "minLength": 1},
                        **_NO_CALLS}, "required": ["content", "tool_call_id"]}]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[dict]) -> str:
        if isinstance(content, str):
            return content
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
            raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return "".join(part["text"] for part in content)

    @model_validator(mode="after")
    def _complete(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required, except in an assistant message with tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry them, not {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message must name the call it answers")
        return self


class FunctionSpec(_OpenAIRequest):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(_OpenAIRequest):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_OpenAIRequest):
    name: str


class NamedToolChoice(_OpenAIRequest):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions; messages are rendered with the model's chat template (and tools, tools.py)."""

    prompt_field: ClassVar[str] = "messages"
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    functions: list | None = Field(None, json_schema_extra={"maxItems": 0})
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    history_token_ids: TokenIds | None = None
    modalities: list[str] | None = Field(None, json_schema_extra={"enum": [["text"], None]})
    store: bool | None = Field(None, json_schema_extra={"enum": [False, None]})

    _no_functions = field_validator("functions")(_only([[]], "the deprecated function calling (use tools)"))
    _text_modality = field_validator("modalities")(_only([["text"]], "audio output"))
    _not_stored = field_validator("store")(_only([False], "stored completions"))

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    @model_validator(mode="after")
    def _tool_choice_fits(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: function names must be distinct")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: names {choice.function.name!r}, which is not among the tools "
                             f"({', '.join(names) or 'none given'})")
        if choice not in (None, "none") and not names:
            raise ValueError(f"tool_choice: {choice if isinstance(choice, str) else 'a named function'!r} needs "
                             f"tools")
        if self.forces_call and (self.response_format or {"type": "text"})["type"] != "text":
            raise ValueError("tool_choice: a forced tool call cannot also follow response_format")
        if self.history_token_ids is not None and not any(m.role == "assistant" for m in self.messages):
            raise ValueError("history_token_ids: the messages must include the assistant turn the history ends "
                             "with (the messages after the last one are appended)")
        return self

    @property
    def tool_mode(self) -> str:
        """"none" (tools neither rendered nor parsed), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def forces_call(self) -> bool:
        return self.tool_mode in ("required", "named")

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def new_messages(self) -> list[dict]:
        """With history_token_ids: the messages after the last assistant one (those the history lacks)."""
        last = max(i for i, m in enumerate(self.messages) if m.role == "assistant")
        return self.message_dicts()[last + 1:]

    def prompts(self) -> list[Prompt]:
        return [self.message_dicts()]


class PauseRequest(_Request):
    mode: Literal["abort", "wait", "keep"] = "wait"


class WeightUpdateOptions(_Request):
    """How an update treats requests in flight (LLMEngine.update_weights): in_flight "wait" | "abort" | "keep";
    with "keep", kv_on_update "keep" (their KV stays) | "recompute" (re-prefilled under the new weights)."""

    weight_version: int | None = None
    flush_cache: bool = True
    in_flight: Literal["wait", "abort", "keep"] = "wait"
    kv_on_update: Literal["keep", "recompute"] = "keep"


class LoraQuery(WeightUpdateOptions):
    """POST /update_lora's query: LLMEngine.update_lora's options; scaling (lora_alpha / r) for every module the
    adapter names, unless the body's safetensors metadata holds "lora_scaling" (JSON: module name -> number)."""

    scaling: float | None = None


class DiskUpdateRequest(WeightUpdateOptions):
    """path: a directory of safetensors files (SGLang's body names it model_path; its load_format must be None or
    "auto", and abort_all_requests true means in_flight "abort")."""

    path: str = Field(validation_alias=AliasChoices("path", "model_path"))
    load_format: Literal["auto"] | None = None
    abort_all_requests: bool = False


class DirectoryUpdateRequest(WeightUpdateOptions):
    """prime-rl's POST /update_weights {"weight_dir"}: the safetensors files of a directory (an allowed one)."""

    weight_dir: str


class SleepQuery(_Request):
    """POST /sleep (vLLM's query parameters): level 1 keeps the weights off the device's budget and drops the KV
    cache, 2 drops both; tags (our extension, repeated: ?tags=weights&tags=kv_cache) what to release, all by
    default; mode how requests in flight fare (LLMEngine.sleep's in_flight; "abort" by default, as vLLM's)."""

    level: int = Field(1, ge=1, le=2)
    tags: list[Literal["weights", "kv_cache"]] | None = None
    mode: Literal["wait", "abort", "keep"] = "abort"  # vLLM's default


class WakeQuery(_Request):
    """POST /wake_up?tags=weights&tags=kv_cache (vLLM's): what to take back, all by default."""

    tags: list[Literal["weights", "kv_cache"]] | None = None


class MemoryOccupationRequest(_Request):
    """SGLang's POST /release_memory_occupation and /resume_memory_occupation: {"tags": [...]} ("weights",
    "kv_cache"; "cuda_graph", SGLang's third, goes with them: the engine's decode graphs are dropped and captured
    again with the memory they read). level (our extension, release only): 2 by default, SGLang's release, which
    keeps no copy of the weights (an update must follow); 1 keeps them. mode as /sleep's."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None
    level: int = Field(2, ge=1, le=2)
    mode: Literal["wait", "abort", "keep"] = "wait"

    def engine_tags(self) -> list[str] | None:
        """The engine's tags of the request's (None: all): "cuda_graph" alone asks for nothing more."""
        return None if self.tags is None else [t for t in self.tags if t != "cuda_graph"]


class BucketQuery(WeightUpdateOptions):
    bucket: Literal["start", "add", "commit"] | None = None


class WeightsGroupRequest(_Request):
    """POST /init_weights_update_group (LLMEngine.init_weights_update_group's arguments)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weights"
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(default=600.0, gt=0)


class TensorUpdateRequest(WeightUpdateOptions):
    """POST /update_weights_from_tensor (SGLang's body): serialized_named_tensors, one base64 pickle of handles to
    shared memory per rank (LLMEngine.update_weights_from_tensor); load_format None, "direct" or
    "flattened_bucket"."""

    serialized_named_tensors: list[str]
    load_format: str | None = None


class DistributedUpdateRequest(WeightUpdateOptions):
    """POST /update_weights_from_distributed: the tensors rank 0 broadcasts, in order (dtypes as
    torch attribute names: "bfloat16", "float32")."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @model_validator(mode="before")
    @classmethod
    def _singular(cls, data):
        """SkyRL's body names one tensor: {"name", "dtype", "shape"}."""
        if isinstance(data, dict) and "name" in data and "names" not in data:
            data = dict(data)
            data["names"], data["dtypes"], data["shapes"] = ([data.pop(key, None)]
                                                             for key in ("name", "dtype", "shape"))
        return data


# ---------------------------------------------------------------------- tokens
class TokenTable:
    """Every token's bytes and text, built once so that formatting never calls the tokenizer."""

    def __init__(self, tokenizer):
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        byte_of = {c: b for b, c in bytes_to_unicode().items()} if type(decoder).__name__ == "ByteLevel" else {}
        self._bytes = [_token_bytes(tok or "", byte_of) for tok in tokens]

    def bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def decode(self, token_ids: list[int]) -> str:
        """The text of a token sequence (special tokens included, as they were sent)."""
        return b"".join(map(self.bytes, token_ids)).decode("utf-8", errors="replace")

    def entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.text(token_id), "logprob": _finite(logprob), "bytes": list(self.bytes(token_id))}


def _token_id_label(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids spelling of a token."""
    return f"token_id:{token_id}"


def _token_bytes(token: str, byte_of: dict[str, int]) -> bytes:
    if byte_of and all(c in byte_of for c in token):
        return bytes(byte_of[c] for c in token)
    return token.replace("\u2581", " ").encode("utf-8")


def _finite(x: float | None) -> float | None:
    return None if x is None else x if x > MIN_LOGPROB else MIN_LOGPROB  # NaN too


# ---------------------------------------------------------------------- responses
@dataclass(slots=True)
class Piece:
    """What a sample adds since the last chunk: its new text and tokens (with their logprobs)."""

    text: str
    text_offset: int
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    log_kept_mass: list[float] | None
    finish_reason: str | None
    num_preemptions: int
    token_weight_versions: list[int]
    routed_experts: list | None = None  # the whole sample's, on its last piece


class Cursor:
    """How much of one sample was sent. Unfinished text holds back an incomplete UTF-8 character
    and the last len(longest stop string) - 1 characters, which a stop string may still cut."""

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.text = ""
        self.num_tokens = 0

    def advance(self, out: CompletionOutput) -> Piece | None:
        finished = out.finish_reason is not None
        text = out.text if finished else _stable(out.text, self.holdback)
        new_text = text[len(self.text):] if text.startswith(self.text) else ""
        start = self.num_tokens
        if not (finished or new_text or len(out.token_ids) > start):
            return None
        piece = Piece(new_text, len(self.text), out.token_ids[start:], _tail(out.logprobs, start),
                      _tail(out.top_logprobs, start), _tail(out.log_kept_mass, start),
                      out.finish_reason, out.num_preemptions, out.token_weight_versions[start:],
                      out.routed_experts.tolist() if finished and out.routed_experts is not None else None)
        self.text += new_text
        self.num_tokens = len(out.token_ids)
        return piece


def _stable(text: str, holdback: int) -> str:
    text = text.rstrip("\ufffd")
    return text[:len(text) - holdback] if holdback else text


def _tail(values: list | None, start: int) -> list | None:
    return None if values is None else values[start:]


class ResponseBuilder:
    """OpenAI bodies and stream chunks for one HTTP request (all its prompts and samples)."""

    object_name = chunk_object = id_prefix = ""

    def __init__(self, request: SamplingRequest, model: str, tokens: TokenTable):
        self.request = request
        self.model = model
        self.tokens = tokens
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        stops = [request.stop] if isinstance(request.stop, str) else request.stop
        self._holdback = max((len(s) - 1 for s in stops), default=0)
        self._cursors: dict[int, Cursor] = {}
        self._latest: dict[int, RequestOutput] = {}
        self.label = _token_id_label if request.return_tokens_as_token_ids else tokens.text  # a token in logprobs

    def chunk_choices(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """Stream choices for what `out` adds (empty when nothing new can be sent yet)."""
        self._latest[prompt_index] = out
        choices = []
        for sample in out.outputs:
            index = prompt_index * self.request.n + sample.index
            first = index not in self._cursors
            cursor = self._cursors.setdefault(index, Cursor(self._holdback))
            piece = cursor.advance(sample)
            if piece is not None:
                choices.append(self._choice(index, piece, out, first, stream=True))
        return choices

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        """The non-streaming body from the final output of every prompt."""
        self._latest = finals
        choices = [self._choice(i * self.request.n + s.index, Cursor(0).advance(s), out, True, stream=False)
                   for i, out in sorted(finals.items()) for s in out.outputs]
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def usage(self) -> dict:
        prompt = sum(len(out.prompt_token_ids) for out in self._latest.values())
        completion = sum(len(s.token_ids) for out in self._latest.values() for s in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _choice(self, index: int, piece: Piece, out: RequestOutput, first: bool, stream: bool) -> dict:
        raise NotImplementedError

    def _extensions(self, piece: Piece, out: RequestOutput, first: bool) -> dict:
        ext = {"logprobs_mode": self.request.logprobs_mode, "num_preemptions": piece.num_preemptions,
               "weight_version": out.weight_version, "token_weight_versions": piece.token_weight_versions}
        if self.request.return_token_ids:
            ext["token_ids"] = piece.token_ids
            if first:
                ext["prompt_token_ids"] = out.prompt_token_ids
        if first:
            ext["seed"] = out.outputs[0].seed
        if piece.routed_experts is not None:
            ext["routed_experts"] = piece.routed_experts
        if piece.log_kept_mass is not None:
            ext["log_kept_mass"] = piece.log_kept_mass
        return ext


class CompletionBuilder(ResponseBuilder):
    """With echo, each choice's first chunk starts with its prompt: the prompt text (as sent, or the
    token ids' text), and with logprobs its tokens, raw logprobs (the first null) and top-k, whose
    text offsets count from 0 like the completion's that follow."""

    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, request: CompletionRequest, model: str, tokens: TokenTable):
        super().__init__(request, model, tokens)
        self._prompt_texts = [p if isinstance(p, str) else tokens.decode(p) for p in request.prompts()] \
            if request.echo else []

    def _choice(self, index: int, piece: Piece, out: RequestOutput, first: bool, stream: bool) -> dict:
        echo = self._prompt_texts[index // self.request.n] if self.request.echo else ""
        logprobs = self._logprobs(piece.token_ids, piece.logprobs, piece.top_logprobs,
                                  len(echo) + piece.text_offset)
        text = piece.text
        if self.request.echo and first:
            text = echo + text
            logprobs = logprobs and _concat(self._prompt_logprobs(out), logprobs)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": piece.finish_reason,
                **self._extensions(piece, out, first)}

    def _prompt_logprobs(self, out: RequestOutput) -> dict:
        missing = [None] * len(out.prompt_token_ids)  # aborted before its prompt was computed
        return self._logprobs(out.prompt_token_ids, out.prompt_logprobs or missing,
                              out.prompt_top_logprobs or missing, 0)

    def _logprobs(self, token_ids: list[int], logprobs: list[float | None] | None,
                  top_logprobs: list[dict[int, float] | None] | None, text_offset: int) -> dict | None:
        if logprobs is None:
            return None
        texts = [self.tokens.text(t) for t in token_ids]
        # as vLLM's: at logprobs=0 each position's top holds the token itself (TRL's client reads it), None where
        # the token has no logprob (an echoed prompt's first)
        tops = [None if lp is None else {self.label(t): _finite(lp)} if top is None else
                {self.label(k): _finite(v) for k, v in top.items()}
                for t, lp, top in zip(token_ids, logprobs, top_logprobs or itertools.repeat(None))]
        return {"tokens": [self.label(t) for t in token_ids], "token_logprobs": [_finite(x) for x in logprobs],
                "top_logprobs": tops,
                "text_offset": list(itertools.accumulate(map(len, texts), initial=text_offset))[:-1]}


def _concat(first: dict, second: dict) -> dict:
    return {key: None if second[key] is None else first[key] + second[key] for key in second}


class ChatBuilder(ResponseBuilder):
    """With tools (tool_choice other than "none") the reply's tool calls, parsed by `parser` (tools.py), become
    the message's tool_calls and finish_reason "tool_calls"; their tokens stay in token_ids and logprobs. A stream
    sends content up to where a call starts or may still start, and the calls in the choice's last chunk."""

    object_name, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, request: ChatCompletionRequest, model: str, tokens: TokenTable, parser: str = "hermes"):
        super().__init__(request, model, tokens)
        self.parser = parser if request.tool_mode != "none" else None
        self._replies: dict[int, list[str]] = {}  # per streamed choice: [its text so far, the content sent]

    def _choice(self, index: int, piece: Piece, out: RequestOutput, first: bool, stream: bool) -> dict:
        content, calls = piece.text, []
        if self.parser is not None:
            content, calls = self._stream_content(index, piece) if stream else tools.parse(self.parser, piece.text)
        message = {"role": "assistant"} if first else {}
        if not stream or content or not calls:
            message["content"] = content if content or not calls else None
        if calls:
            message["tool_calls"] = [c.openai(i if stream else None) for i, c in enumerate(calls)]
        finish = "tool_calls" if calls and piece.finish_reason in ("stop", "length") else piece.finish_reason
        return {"index": index, ("delta" if stream else "message"): message, "logprobs": self._logprobs(piece),
                "finish_reason": finish, **self._extensions(piece, out, first)}

    def _stream_content(self, index: int, piece: Piece) -> tuple[str, list[tools.ToolCall]]:
        reply = self._replies.setdefault(index, ["", ""])
        reply[0] += piece.text
        if piece.finish_reason is None:
            content, calls = reply[0][:tools.call_may_start(self.parser, reply[0])].rstrip(), []
        else:
            content, calls = tools.parse(self.parser, reply[0])
        new = content[len(reply[1]):] if content.startswith(reply[1]) else ""
        reply[1] += new
        return new, calls

    def _logprobs(self, piece: Piece) -> dict | None:
        if piece.logprobs is None:
            return None
        k = self.request.top_logprobs or 0
        entries = []
        for i, (token, logprob) in enumerate(zip(piece.token_ids, piece.logprobs)):
            top = piece.top_logprobs[i] if piece.top_logprobs else {}
            best = sorted(top.items(), key=lambda item: -item[1])[:k]
            entries.append({**self._entry(token, logprob),
                            "top_logprobs": [self._entry(t, lp) for t, lp in best]})
        return {"content": entries}

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {**self.tokens.entry(token_id, logprob), "token": self.label(token_id)}
