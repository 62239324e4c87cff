"""Agents over the OpenAI API: token ids in and out exact through the official client (a history's ids appended to,
never re-rendered); tools rendered (Hermes fallback for templates without tools) and the model's calls parsed into
tool_calls, in streams too; a named or required call and a json_schema reply follow their schemas at T=1 across
seeds; bad schemas and tool choices answer 400 naming the field."""

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from fp8engine import tools
from fp8engine.bench.serve_load import serving

CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate an arithmetic expression",
                                         "parameters": {"type": "object", "properties": {
                                             "expr": {"type": "string", "maxLength": 24},
                                             "digits": {"type": "integer", "minimum": 0, "maximum": 9}},
                                             "required": ["expr"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is 17*23? Use the calculator."}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
# A template that renders tools itself, in the Qwen style (what Qwen2/Qwen3 tokenizers ship, reduced).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def client():
    # batch invariant: a request repeated with its seed (the stream test) hits the prefix cache, and only a batch
    # invariant engine promises the same bits after a hit on every CPU (docs/exact-rollouts.md)
    with serving(["--dtype", "bfloat16", "--num-kv-blocks", "256", "--batch-invariant"]) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


# ---------------------------------------------------------------------- parsing and rendering
def test_parsers_read_calls_and_leave_anything_else_as_text():
    content, calls = tools.parse("hermes", 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": '
                                           '{"expr": "17*23"}}\n</tool_call>\n<tool_call>{"name": "clock", '
                                           '"arguments": {"zone": "UTC"}}</tool_call>')
    assert content == "Let me compute." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("calc", {"expr": "17*23"}), ("clock", {"zone": "UTC"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    broken = 'x <tool_call>{"name": "calc", "arguments": {"expr": </tool_call>'
    assert tools.parse("hermes", broken) == (broken, [])
    assert tools.parse("hermes", "no call here") == ("no call here", [])
    _, [call] = tools.parse("llama3_json", '<|python_tag|>{"name": "calc", "parameters": {"expr": "1+1"}}')
    assert (call.name, json.loads(call.arguments)) == ("calc", {"expr": "1+1"})
    assert len(tools.parse("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}')[1]) == 2
    assert tools.parse("llama3_json", "The answer is 4.") == ("The answer is 4.", [])
    # a string argument may hold the closing tag or the separator: the calls are read as JSON, not split on them
    tricky = '<tool_call>\n{"name": "calc", "arguments": {"expr": "12(25)}}</tool_call> = 2"}}\n</tool_call>'
    assert [json.loads(c.arguments) for c in tools.parse("hermes", tricky)[1]] == [{"expr": "12(25)}}</tool_call> = 2"}]
    _, semi = tools.parse("llama3_json", '{"name": "a", "parameters": {"s": "x; y"}};{"name": "b", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in semi] == [("a", {"s": "x; y"}), ("b", {})]
    assert tools.parse("hermes", '<tool_call>{"name": "calc"} trailing') == ('<tool_call>{"name": "calc"} trailing', [])
    assert tools.call_may_start("hermes", "Sure <tool_") == len("Sure ")
    assert tools.call_may_start("hermes", "Sure <tool_call>{") == len("Sure ")
    assert tools.call_may_start("hermes", "Sure.") == len("Sure.")
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        tools.check_parser("mistral")


def test_tools_render_through_the_template_or_the_hermes_fallback(tokenizer):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "17*23"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "391"}]
    assert not tools.renders_tools(tokenizer) and tools.default_parser(tokenizer) == "hermes"
    text = tools.render(tokenizer, history, [CALC])
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert json.dumps(CALC) in text and '<tool_call>\n{"name": "calc", "arguments": {"expr": "17*23"}}\n</tool_call>' \
        in text and "<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    qwen = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    qwen.chat_template = TOOL_TEMPLATE
    text = tools.render(qwen, history, [CALC])
    assert tools.renders_tools(qwen) and text.startswith("<|im_start|>system\n# Tools\n<tools>{")
    assert '"arguments": {"expr": "17*23"}' in text  # arguments handed to the template as an object


def test_a_continuation_appends_only_the_new_messages(tokenizer):
    first = tools.render_ids(tokenizer, ASK)
    reply = tokenizer("It is 391.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    new = [{"role": "user", "content": "And 2+2?"}]
    more = tools.continuation_ids(tokenizer, first + reply, new, {tokenizer.eos_token_id})
    assert tokenizer.decode(more) == "\n<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n"
    whole = tools.render_ids(tokenizer, ASK + [{"role": "assistant", "content": "It is 391."}] + new)
    assert first + reply + more == whole  # this template and reply round-trip; the history never depends on it
    cut = tools.continuation_ids(tokenizer, first + reply[:-1], new, {tokenizer.eos_token_id})
    assert tokenizer.decode(cut).startswith("<|im_end|>\n<|im_start|>user")  # a reply cut short gets its end
    with pytest.raises(ValueError, match="at least one new message"):
        tools.continuation_ids(tokenizer, first, [], {tokenizer.eos_token_id})


# ---------------------------------------------------------------------- over HTTP
def test_token_ids_in_and_out_are_exact_through_the_openai_client(client, tokenizer):
    ids = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    done = client.completions.create(model="default", prompt=ids, max_tokens=6, temperature=0.0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    assert done.choices[0].model_extra["prompt_token_ids"] == ids and len(done.choices[0].model_extra["token_ids"]) == 6
    first = client.chat.completions.create(model="default", messages=ASK, max_tokens=12, temperature=0.0,
                                           extra_body={"return_token_ids": True})
    extra = first.choices[0].model_extra
    assert extra["prompt_token_ids"] == tools.render_ids(tokenizer, ASK)
    history = extra["prompt_token_ids"] + extra["token_ids"]
    turn = [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    second = client.chat.completions.create(model="default", messages=ASK + turn, max_tokens=4, temperature=0.0,
                                            extra_body={"return_token_ids": True, "history_token_ids": history})
    prompt = second.choices[0].model_extra["prompt_token_ids"]
    assert prompt == history + tools.continuation_ids(tokenizer, history, turn[1:], {tokenizer.eos_token_id})
    chunks = client.chat.completions.create(model="default", messages=ASK, max_tokens=12, temperature=0.0,
                                            stream=True, extra_body={"return_token_ids": True})
    streamed = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [] if c.choices else [])]
    assert streamed == extra["token_ids"]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_follows_its_function_schema_at_t1_across_seeds(client, tokenizer, choice):
    tool_choice = {"type": "function", "function": {"name": "calc"}} if choice == "named" else "required"
    names = set()
    for seed in range(4):
        answer = client.chat.completions.create(
            model="default", messages=ASK, tools=[CALC, CLOCK], tool_choice=tool_choice, temperature=1.0, seed=seed,
            max_tokens=96, logprobs=True, extra_body={"return_token_ids": True})
        c = answer.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        [call] = c.message.tool_calls
        spec = {"calc": CALC, "clock": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
        names.add(call.function.name)
        ids = c.model_extra["token_ids"]
        assert tokenizer.decode(ids).startswith("<tool_call>\n{") and len(c.logprobs.content) == len(ids)
    assert names == {"calc"} if choice == "named" else names <= {"calc", "clock"}


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client):
    body = dict(model="default", messages=ASK, tools=[CALC], tool_choice="required", temperature=1.0, seed=3,
                max_tokens=96)
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls[0]
    calls, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert calls == {0: {"name": whole.function.name, "arguments": whole.function.arguments}}


def test_auto_parses_calls_the_model_writes_and_tool_results_are_taken(client):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "17*23"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "391"}]
    answer = client.chat.completions.create(model="default", messages=history, tools=[CALC], temperature=0.0,
                                            max_tokens=24)
    c = answer.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None and c.message.content


def test_a_json_schema_reply_follows_it_at_t1_across_seeds(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    for seed in range(4):
        c = client.chat.completions.create(model="default", messages=ASK, response_format=fmt, temperature=1.0,
                                           seed=seed, max_tokens=32).choices[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), ANSWER)
    text = client.completions.create(model="default", prompt="A JSON object:", max_tokens=40, temperature=1.0,
                                     seed=1, extra_body={"structured_outputs": {"regex": "[a-z]{2,5}"}})
    assert text.choices[0].text.isalpha()


@pytest.mark.parametrize("body,param,match", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}), "response_format", "cannot be compiled"),
    (dict(response_format={"type": "yaml"}), "response_format", "must be"),
    (dict(tools=[CALC], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "not among the tools"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[CALC, CALC]), "tools", "distinct"),
    (dict(messages=[{"role": "tool", "content": "1"}]), "messages", "tool_call_id"),
    (dict(extra_body={"history_token_ids": [1, 2, 3]}), "history_token_ids", "assistant turn"),
])
def test_bad_tools_and_formats_answer_400_naming_the_field(client, body, param, match):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**({"model": "default", "messages": ASK, "max_tokens": 4} | body))
    error = info.value.body
    assert error["param"] == param and match in error["message"], error
