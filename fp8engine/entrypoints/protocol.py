"""OpenAI request models and response shapes, with fp8engine's extensions.

Request extensions (both endpoints): top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
return_token_ids, logprobs_mode ("raw" | "processed", default "processed"). Choice extensions:
logprobs_mode, num_preemptions, weight_version; token_ids and prompt_token_ids with
return_token_ids; log_kept_mass (per token, processed logprobs only) when logprobs are requested;
seed (the request's sampling seed, drawn by the engine when none was given: with the same
request it reproduces the choice), in a stream's first chunk of each choice.
In streams, token_ids / log_kept_mass hold the chunk's new tokens only.
"""

import itertools
import json
import time
import uuid
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from transformers.convert_slow_tokenizer import bytes_to_unicode

from fp8engine.engine import Prompt
from fp8engine.outputs import CompletionOutput, RequestOutput
from fp8engine.sampling_params import SamplingParams

MAX_N = 64
MAX_LOGPROBS = 20
MIN_LOGPROB = -9999.0  # stands for -inf, which JSON cannot carry

M = TypeVar("M", bound=BaseModel)

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
        error = exc.errors()[0]
        loc = ".".join(str(x) for x in error["loc"])
        raise ApiError(400, f"{loc or 'request'}: {error['msg']}",
                       param=str(error["loc"][0]) if error["loc"] else None) from None


# ---------------------------------------------------------------------- requests
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    prompt_field: ClassVar[str] = "prompt"
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = 0
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions = Field(default_factory=StreamOptions)
    return_token_ids: bool = False
    logprobs_mode: Literal["raw", "processed"] = "processed"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; only 0 is accepted")
        return value

    @property
    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams of this request; ValueError names the offending field."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=self.max_new_tokens or default_max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed,
            logprobs=self.num_logprobs, logprobs_mode=self.logprobs_mode)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions; `prompt` is text, token ids, or a list of either (one choice group each)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False
    suffix: None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[Prompt]:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


class ChatMessage(_Request):
    role: str
    content: str | list[dict]

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[dict]) -> str:
        if isinstance(content, str):
            return content
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
            raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return "".join(part["text"] for part in content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions; messages are rendered with the model's chat template."""

    prompt_field: ClassVar[str] = "messages"
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompts(self) -> list[Prompt]:
        return [[{"role": m.role, "content": m.content} for m in self.messages]]


class PauseRequest(_Request):
    mode: Literal["abort", "wait", "keep"] = "wait"


class WeightUpdateOptions(_Request):
    weight_version: int | None = None
    flush_cache: bool = True
    in_flight: Literal["wait", "abort"] = "wait"


class DiskUpdateRequest(WeightUpdateOptions):
    path: str


class BucketQuery(WeightUpdateOptions):
    bucket: Literal["start", "add", "commit"] | None = None


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

    def entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.text(token_id), "logprob": _finite(logprob), "bytes": list(self.bytes(token_id))}


def _token_bytes(token: str, byte_of: dict[str, int]) -> bytes:
    if byte_of and all(c in byte_of for c in token):
        return bytes(byte_of[c] for c in token)
    return token.replace("\u2581", " ").encode("utf-8")


def _finite(x: float) -> float:
    return max(x, MIN_LOGPROB)


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
                      out.finish_reason, out.num_preemptions)
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
               "weight_version": out.weight_version}
        if self.request.return_token_ids:
            ext["token_ids"] = piece.token_ids
            if first:
                ext["prompt_token_ids"] = out.prompt_token_ids
        if first:
            ext["seed"] = out.outputs[0].seed
        if piece.log_kept_mass is not None:
            ext["log_kept_mass"] = piece.log_kept_mass
        return ext


class CompletionBuilder(ResponseBuilder):
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def _choice(self, index: int, piece: Piece, out: RequestOutput, first: bool, stream: bool) -> dict:
        return {"index": index, "text": piece.text, "logprobs": self._logprobs(piece),
                "finish_reason": piece.finish_reason, **self._extensions(piece, out, first)}

    def _logprobs(self, piece: Piece) -> dict | None:
        if piece.logprobs is None:
            return None
        texts = [self.tokens.text(t) for t in piece.token_ids]
        tops = None if piece.top_logprobs is None else [
            {self.tokens.text(t): _finite(lp) for t, lp in top.items()} for top in piece.top_logprobs]
        return {"tokens": texts, "token_logprobs": [_finite(x) for x in piece.logprobs], "top_logprobs": tops,
                "text_offset": list(itertools.accumulate(map(len, texts), initial=piece.text_offset))[:-1]}


class ChatBuilder(ResponseBuilder):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _choice(self, index: int, piece: Piece, out: RequestOutput, first: bool, stream: bool) -> dict:
        message = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
        return {"index": index, ("delta" if stream else "message"): message, "logprobs": self._logprobs(piece),
                "finish_reason": piece.finish_reason, **self._extensions(piece, out, first)}

    def _logprobs(self, piece: Piece) -> dict | None:
        if piece.logprobs is None:
            return None
        k = self.request.top_logprobs or 0
        entries = []
        for i, (token, logprob) in enumerate(zip(piece.token_ids, piece.logprobs)):
            top = piece.top_logprobs[i] if piece.top_logprobs else {}
            best = sorted(top.items(), key=lambda item: -item[1])[:k]
            entries.append({**self.tokens.entry(token, logprob),
                            "top_logprobs": [self.tokens.entry(t, lp) for t, lp in best]})
        return {"content": entries}
