"""Chat turns for agents: tools rendered into the prompt, the model's tool calls parsed out of its text, the grammar
that forces a call, and exact continuations of a conversation's token history.

Parsers, by the format a model family was trained on (`--tool-call-parser`):
    hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call (Qwen2, Qwen3,
                 Hermes; and the fallback for templates that do not render tools, such as SmolLM2's)
    llama3_json  the reply is {"name": ..., "parameters": {...}} (several joined by ";"), optionally after
                 <|python_tag|> (Llama 3.1 and later)
A template that renders `tools` itself gets them as `tools=`; any other gets a system message in the Hermes form,
and the history's assistant tool calls and tool results are written in that form too, so any chat model can be
given tools. A forced call (tool_choice "required" or a named function) is a grammar (structured.py) over exactly
one call block whose arguments follow the function's parameter schema.

Continuations (`continuation_ids`): a multi-turn history is kept as the exact token ids that were sampled and
appended; a new turn's messages are rendered alone, after a fixed two-message conversation whose rendering is then
cut off, so earlier turns are never re-rendered or re-tokenized (chat templates are not append-only: rendering
the whole chat again can give other tokens than the ones the model saw).
"""

import json
import re
import uuid
from dataclasses import dataclass

from fp8engine.structured import compile_error

PARSERS = ("hermes", "llama3_json")
_REPLY = "<<reply>>"
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _REPLY}]

HERMES_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "The functions you can call are described within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def default_parser(tokenizer) -> str:
    """The parser for this tokenizer's chat template: llama3_json for Llama 3 templates, else hermes."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "llama3_json" if "<|python_tag|>" in template or "ipython" in template else "hermes"


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return name


def renders_tools(tokenizer) -> bool:
    """Whether the chat template uses the `tools` it is given."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


# ---------------------------------------------------------------------- rendering
def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """The chat template's text for messages (OpenAI form: assistant tool_calls, role "tool" results) and tools."""
    if tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template")
    if tools and renders_tools(tokenizer):
        return tokenizer.apply_chat_template(_plain_contents(messages), tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    messages = [_hermes_message(m) for m in messages]
    if tools:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + system}] + messages[1:]
        else:
            messages = [{"role": "system", "content": system}] + messages
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a whole chat with a generation prompt (the first turn of a conversation)."""
    return tokenizer(render(tokenizer, messages, tools), add_special_tokens=False)["input_ids"]


def continuation_ids(tokenizer, history: list[int], messages: list[dict], end_token_ids: set[int]) -> list[int]:
    """The tokens to append to `history` (a conversation's exact ids, ending with the model's last reply) for new
    `messages` and the next assistant turn's generation prompt. The end of a turn the template writes after an
    assistant message is added where the reply does not end with it (a reply cut by max_tokens, a stop string)."""
    if not messages:
        raise ValueError("continuation needs at least one new message")
    base = render(tokenizer, _BASE, add_generation_prompt=False)
    full = render(tokenizer, _BASE + messages)
    if not full.startswith(base):
        raise ValueError("this chat template does not render a new message after earlier ones unchanged; "
                         "its conversations cannot be continued token-exactly")
    after_reply = base[base.rindex(_REPLY) + len(_REPLY):]  # what the template puts after an assistant reply
    ended = bool(history) and history[-1] in end_token_ids
    if ended:
        end_text = tokenizer.decode([history[-1]])
        after_reply = after_reply[len(end_text):] if after_reply.startswith(end_text) else after_reply
    return tokenizer(after_reply + full[len(base):], add_special_tokens=False)["input_ids"]


def _plain_contents(messages: list[dict]) -> list[dict]:
    """Messages for a template that renders tools: tool-call arguments as objects, as HF templates expect."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _as_object(c["function"])}}
                               for c in m["tool_calls"]]
        m.setdefault("content", "")
        out.append(m)
    return out


def _hermes_message(m: dict) -> dict:
    """A message in the Hermes form for templates that know only role and content."""
    content = m.get("content") or ""
    if m.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = m.get("tool_calls") or []
    if calls:
        blocks = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _as_object(c['function'])})}"
                  f"\n</tool_call>" for c in calls]
        content = "\n".join(([content] if content else []) + blocks)
    return {"role": m["role"], "content": content}


def _as_object(function: dict):
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            raise ValueError(f"tool call {function.get('name')!r}: arguments must be JSON text, got "
                             f"{arguments!r:.80}") from None
    return arguments


# ---------------------------------------------------------------------- parsing
def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(the text without its tool calls, the calls) from a reply; text that is not a well-formed call stays text."""
    return _parse_llama3(text) if parser == "llama3_json" else _parse_hermes(text)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Each <tool_call> holds one JSON object, read by a JSON decoder (a string argument may itself contain
    "</tool_call>"), then its closing tag or the end of the text."""
    calls, first = [], text.find("<tool_call>")
    at = first
    while at >= 0:
        value, end = _json_at(text, at + len("<tool_call>"))
        call = _call(value, "arguments")
        if call is None:
            return text, []
        calls.append(call)
        end = _skip_space(text, end)
        if text.startswith("</tool_call>", end):
            end += len("</tool_call>")
        elif end != len(text):
            return text, []
        at = text.find("<tool_call>", end)
    if not calls:
        return text, []
    return text[:first].rstrip(), calls


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    """JSON objects separated by ';' (read by a JSON decoder: a ';' inside a string is not a separator)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls, at = [], 0
    while at < len(body):
        value, at = _json_at(body, at)
        call = _call(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        at = _skip_space(body, at)
        if at < len(body) and body[at] == ";":
            at = _skip_space(body, at + 1)
        elif at < len(body):
            return text, []
    return "", calls


_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def _skip_space(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()


def _json_at(text: str, at: int) -> tuple[object, int]:
    """The JSON value starting at text[at] (after whitespace) and where it ends; (None, at) where there is none."""
    at = _skip_space(text, at)
    try:
        return _DECODER.raw_decode(text, at)
    except ValueError:
        return None, at


def _call(value: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def call_may_start(parser: str, text: str) -> int:
    """Where a tool call starts or may still start in a streamed reply (len(text) when it cannot): text before it
    can be sent as content, the rest is held until the calls are complete."""
    if parser == "llama3_json":
        stripped = text.lstrip()
        return 0 if not stripped or stripped[0] in "{<" else len(text)
    at = text.find("<tool_call>")
    if at >= 0:
        return at
    for k in range(min(len("<tool_call>") - 1, len(text)), 0, -1):
        if "<tool_call>".startswith(text[-k:]):
            return len(text) - k
    return len(text)


# ---------------------------------------------------------------------- forced calls
def forced_call_grammar(parser: str, tools: list[dict], name: str | None) -> str:
    """EBNF (xgrammar's dialect) for exactly one call: to the function `name`, or to any of tools (None)."""
    import xgrammar
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    key = "parameters" if parser == "llama3_json" else "arguments"
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 key: f.get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False} for f in functions]
    try:
        calls = [xgrammar.Grammar.from_json_schema(json.dumps(s), any_whitespace=False) for s in schemas]
    except RuntimeError as exc:
        raise ValueError(f"tools: a function's parameters are not a schema the engine can compile: "
                         f"{compile_error(exc)}") from None
    call = calls[0] if len(calls) == 1 else xgrammar.Grammar.union(*calls)
    if parser == "llama3_json":
        return str(call)
    return str(xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), call,
                                       xgrammar.Grammar.from_ebnf('root ::= "\\n</tool_call>"')))
