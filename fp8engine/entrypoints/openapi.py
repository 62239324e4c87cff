"""The server's OpenAPI description: request bodies from protocol.py's models, response shapes below.

Handlers read and validate their bodies themselves (size limits while reading, OpenAI-shaped 400s
naming the field), so FastAPI cannot see the models; `describe` adds them to /openapi.json, with every
error status a route can answer, so that schema-driven clients and fuzzers (schemathesis) see the API
as it is.
"""

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"
JSON, BINARY, EVENTS, TEXT = "application/json", "application/octet-stream", "text/event-stream", "text/plain"
# One server-sent event as clients parse it (schemathesis validates each event of a stream against this): its data
# is a JSON chunk, or "[DONE]" last.
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
             "required": ["data"]}
ERROR_STATUSES = {400: "invalid request (the field is named in error.param)", 401: "missing or wrong key",
                  403: "not allowed (weight directory)", 404: "unknown model",
                  409: "conflict (an update's steps out of order)",
                  413: "body too large", 501: "not implemented on this device", 503: "paused or asleep"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChoiceExtensions(BaseModel):
    """fp8engine's fields on every choice (protocol.py lists them)."""

    logprobs_mode: Literal["raw", "processed"]
    num_preemptions: int
    weight_version: int
    seed: int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    log_kept_mass: list[float] | None = None
    routed_experts: list[list[list[int]]] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(ChoiceExtensions):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(ChoiceExtensions):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def describe(app: FastAPI, bodies: dict[str, type[BaseModel] | None], queries: dict[str, type[BaseModel]],
             responses: dict[str, type[BaseModel]], content_types: dict[str, tuple[str, ...]]) -> None:
    """Make app.openapi() describe, per path: the request body (a JSON model, or None for raw bytes),
    the query model, the 200 body (a model from `responses`, else any JSON object; text for the other
    `content_types`, default JSON only) and the error bodies."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models = {*filter(None, bodies.values()), *responses.values(), ErrorResponse}
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            schema.setdefault("components", {})["schemas"] = defs.get("$defs", {})
            for path, item in schema["paths"].items():
                for operation in item.values():
                    if path in bodies:
                        operation["requestBody"] = _request_body(bodies[path])
                    if path in queries:
                        operation["parameters"] = _query_parameters(queries[path])
                    operation["responses"] = _responses(responses.get(path), content_types.get(path, (JSON,)))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _request_body(model: type[BaseModel] | None) -> dict:
    if model is None:
        return {"required": False, "content": {BINARY: {"schema": {"type": "string", "format": "binary"}}}}
    return {"required": True, "content": {JSON: {"schema": _ref(model)}}}


def _query_parameters(model: type[BaseModel]) -> list[dict]:
    properties = model.model_json_schema(ref_template=REF)["properties"]
    return [{"name": name, "in": "query", "required": False, "schema": prop} for name, prop in properties.items()]


def _responses(model: type[BaseModel] | None, content_types: tuple[str, ...]) -> dict:
    ok = {media: {"schema": (_ref(model) if model else {"type": "object"}) if media == JSON else
                  SSE_EVENT if media == EVENTS else {"type": "string"}} for media in content_types}
    errors = {str(status): {"description": description, "content": {JSON: {"schema": _ref(ErrorResponse)}}}
              for status, description in ERROR_STATUSES.items()}
    return {"200": {"description": "OK", "content": ok}, **errors}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": REF.format(model=model.__name__)}
