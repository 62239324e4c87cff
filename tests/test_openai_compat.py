"""OpenAI compatibility that evaluation clients rely on: echo with prompt logprobs, scoring with
max_tokens=0, raw logprobs by default (k alternatives at temperature 0), penalties and logit_bias,
and a 400 naming every field the server does not implement."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from fp8engine import SamplingParams
from fp8engine.bench.serve_load import serving
from fp8engine.entrypoints.protocol import TokenTable
from fp8engine.model_executor.layers.sampler import SampleRow, adjust_logits
from tests.conftest import make_engine
from tests.hf_reference import load_hf
from tests.prompts import CHATS, RAW

ENGINE_OPTIONS = dict(dtype="float32", num_kv_blocks=256)
ENGINE_TOL = 1e-5  # server vs in-process engine, float32 (other batch shapes may change the last bits)
HF_TOL = 1e-4  # the engine vs a Hugging Face teacher-forced pass, float32


@pytest.fixture(scope="module")
def server() -> httpx.Client:
    flags = ["--dtype", ENGINE_OPTIONS["dtype"], "--num-kv-blocks", str(ENGINE_OPTIONS["num_kv_blocks"])]
    with serving(flags) as base_url, httpx.Client(base_url=base_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    return make_engine(**ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def hf(default_dir):
    return load_hf(default_dir, torch.float32)


@pytest.fixture(scope="module")
def table(tokenizer) -> TokenTable:
    return TokenTable(tokenizer)


def hf_logprobs_all(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V] raw logprobs of the token after each position (teacher forced)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def generate(engine, prompts, params):
    """engine.generate from a worker thread on an empty prefix cache (see tests/test_server.py: torch's
    main-thread CPU team is much slower while the server steps its own engine)."""
    engine.flush_prefix_cache()
    with ThreadPoolExecutor(1) as worker:
        return worker.submit(engine.generate, prompts, params).result()


def complete(server: httpx.Client, **body) -> dict:
    response = server.post("/v1/completions", json={"model": "default", **body})
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------ echo and scoring
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
def test_echo_logprobs_equal_the_engine_and_hf(server, reference, hf, tokenizer, table, as_ids):
    prompts = [tokenizer(p)["input_ids"] for p in RAW[:2]] if as_ids else RAW[:2]
    body = complete(server, prompt=prompts, echo=True, logprobs=2, max_tokens=3, temperature=0.0,
                    ignore_eos=True, return_token_ids=True)
    expected = generate(reference, prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                          logprobs=2, logprobs_mode="raw", prompt_logprobs=2))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, out in zip(body["choices"], expected):
        ids, lp = out.prompt_token_ids, choice["logprobs"]
        num = len(ids)
        assert choice["prompt_token_ids"] == ids and choice["token_ids"] == out.outputs[0].token_ids
        prompt_text = table.decode(ids) if as_ids else RAW[body["choices"].index(choice)]
        assert choice["text"] == prompt_text + out.outputs[0].text
        assert lp["tokens"] == [table.text(t) for t in ids + out.outputs[0].token_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][:num] == [len("".join(lp["tokens"][:i])) for i in range(num)]
        assert lp["text_offset"][num] == len(prompt_text)
        ours = torch.tensor(lp["token_logprobs"][1:])
        engine = torch.tensor(out.prompt_logprobs[1:] + out.outputs[0].logprobs)
        assert (ours - engine).abs().max() < ENGINE_TOL
        full = ids + out.outputs[0].token_ids
        teacher = hf_logprobs_all(hf, full)
        assert (ours - teacher[torch.arange(len(full) - 1), torch.tensor(full[1:])]).abs().max() < HF_TOL
        for i, top in enumerate(lp["top_logprobs"][1:]):
            values, top_ids = teacher[i].topk(2)
            assert {table.text(t) for t in top_ids.tolist()} | {lp["tokens"][i + 1]} == set(top)
            assert abs(max(top.values()) - values[0].item()) < HF_TOL


def test_max_tokens_zero_scores_the_prompt_without_generating(server, reference, tokenizer, table):
    ids = [tokenizer(p)["input_ids"] for p in RAW[2:4]]
    body = complete(server, prompt=ids, echo=True, logprobs=0, max_tokens=0, n=2, temperature=1.0)
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 0,
                             "total_tokens": sum(map(len, ids))}
    expected = generate(reference, ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice in body["choices"]:
        out = expected[choice["index"] // 2]
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        assert choice["finish_reason"] == "length" and choice["text"] == table.decode(out.prompt_token_ids)
        assert len(choice["logprobs"]["tokens"]) == len(out.prompt_token_ids)
        tops, tokens = choice["logprobs"]["top_logprobs"], choice["logprobs"]["tokens"]  # vLLM's at logprobs=0
        assert tops[0] is None and tops[1:] == [{t: lp} for t, lp in zip(tokens[1:],
                                                                      choice["logprobs"]["token_logprobs"][1:])]
        got = torch.tensor(choice["logprobs"]["token_logprobs"][1:])
        assert (got - torch.tensor(out.prompt_logprobs[1:])).abs().max() < ENGINE_TOL

    plain = complete(server, prompt=RAW[0], max_tokens=0)
    assert plain["choices"][0]["text"] == "" and plain["usage"]["completion_tokens"] == 0

    with server.stream("POST", "/v1/completions", json={"prompt": RAW[0], "max_tokens": 0, "echo": True,
                                                        "stream": True, "logprobs": 1}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    [choice] = [c for chunk in chunks for c in chunk["choices"]]
    assert choice["text"] == RAW[0] and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["top_logprobs"]) == len(tokenizer(RAW[0])["input_ids"])


# ------------------------------------------------------------------ raw logprobs by default
def test_temperature_zero_returns_k_raw_alternatives_equal_to_hf(server, hf, tokenizer, table):
    body = complete(server, prompt=RAW[5], max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True,
                    return_token_ids=True)
    choice = body["choices"][0]
    assert choice["logprobs_mode"] == "raw"
    prompt, tokens = choice["prompt_token_ids"], choice["token_ids"]
    teacher = hf_logprobs_all(hf, prompt + tokens)[len(prompt) - 1:]
    for i, top in enumerate(choice["logprobs"]["top_logprobs"]):
        values, ids = teacher[i].topk(3)
        assert tokens[i] == ids[0].item() and len(top) == 3
        assert set(top) == {table.text(t) for t in ids.tolist()}
        assert max(abs(top[table.text(t)] - v) for t, v in zip(ids.tolist(), values.tolist())) < HF_TOL

    chat = server.post("/v1/chat/completions", json={"messages": CHATS[0], "max_tokens": 4, "temperature": 0,
                                                     "logprobs": True, "top_logprobs": 3}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert all(len(c["top_logprobs"]) == 3 and c["logprob"] == c["top_logprobs"][0]["logprob"] < 0
               for c in content)

    processed = complete(server, prompt=RAW[5], max_tokens=2, temperature=0.0, logprobs=3,
                         logprobs_mode="processed")["choices"][0]
    assert processed["logprobs"]["token_logprobs"] == [0.0, 0.0]
    assert all(len(top) == 1 for top in processed["logprobs"]["top_logprobs"])


# ------------------------------------------------------------------ penalties and logit_bias
def test_adjust_logits_follows_openai_and_ctrl_rules():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                            logit_bias={4: 10.0, 0: -1.0})
    row = SampleRow(params, 0, prompt_token_ids=[1], output_token_ids=[3, 3, 2])
    adjust_logits(logits, row)
    # bias first: [1, -1, .5, 3, 10]; repetition on {1, 2, 3}: [1, -2, .25, 1.5, 10];
    # presence + frequency on outputs 3 (x2) and 2 (x1): 3 -> 1.5 - .5 - .5, 2 -> .25 - .5 - .25
    assert logits.tolist() == [1.0, -2.0, -0.5, 0.5, 10.0]


def test_logit_bias_and_penalties_shape_sampling_but_not_raw_logprobs(server, reference, hf):
    greedy = complete(server, prompt=RAW[6], max_tokens=4, temperature=0.0, ignore_eos=True,
                      return_token_ids=True)["choices"][0]
    forced = greedy["token_ids"][0] + 1
    body = complete(server, prompt=RAW[6], max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0,
                    logit_bias={str(forced): 100}, return_token_ids=True)["choices"][0]
    assert body["token_ids"] == [forced] * 4
    teacher = hf_logprobs_all(hf, body["prompt_token_ids"] + body["token_ids"])[len(body["prompt_token_ids"]) - 1:]
    assert max(abs(lp - teacher[i, forced].item()) for i, lp in enumerate(body["logprobs"]["token_logprobs"])) \
        < HF_TOL  # raw: the model's own logprob of the forced token, not the biased one

    fields = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    penalized = complete(server, prompt=RAW[6], max_tokens=16, temperature=0.0, ignore_eos=True,
                         return_token_ids=True, **fields)["choices"][0]
    expected = generate(reference, [RAW[6]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                           **fields))[0].outputs[0]
    plain = generate(reference, [RAW[6]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert penalized["token_ids"] == expected.token_ids != plain.outputs[0].token_ids
    assert len(set(expected.token_ids)) > len(set(plain.outputs[0].token_ids))


def test_penalized_rows_do_not_depend_on_their_batch(reference):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=0,
                            logprobs_mode="processed", frequency_penalty=0.7, logit_bias={11: 2.0})
    alone = generate(reference, [RAW[7]], params)[0].outputs[0]
    batched = generate(reference, [RAW[7], RAW[8], RAW[9]], [params, SamplingParams(temperature=1.0, seed=1),
                                                            SamplingParams(temperature=0.0)])[0].outputs[0]
    assert alone.token_ids == batched.token_ids
    assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(batched.logprobs), atol=ENGINE_TOL)


# ------------------------------------------------------------------ no field silently ignored
UNSUPPORTED = [
    ("completions", "response_format", {"type": "yaml"}),
    ("chat", "response_format", {"type": "json_schema", "json_schema": {"schema": {}}}),
    ("completions", "structured_outputs", {"json": {}, "regex": "a"}),
    ("chat", "tools", [{"type": "function", "function": {"name": "no spaces"}}]),
    ("chat", "tool_choice", "auto"),
    ("chat", "functions", [{"name": "f"}]),
    ("chat", "function_call", "auto"),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "store", True),
    ("chat", "metadata", {"k": "v"}),
    ("chat", "reasoning_effort", "high"),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("chat", "echo", True),
    ("completions", "suffix", "the end"),
    ("completions", "best_of", 3),
    ("completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("completions", "no_such_field", 1),
    ("completions", "stream_options", {"include_usage": True}),
    ("completions", "logit_bias", {"not-a-token": 1}),
    ("completions", "logit_bias", {"5": 101}),
    ("completions", "logit_bias", {"10000000": 1}),
    ("completions", "presence_penalty", 2.5),
    ("completions", "frequency_penalty", -3),
    ("completions", "repetition_penalty", 0),
    ("completions", "temperature", 1e-4),
    ("completions", "stop", ["x"] * 33),
    ("completions", "top_k", -3),
]


@pytest.mark.parametrize("endpoint,field,value", UNSUPPORTED, ids=[f"{e}-{f}-{i}" for i, (e, f, _) in
                                                                   enumerate(UNSUPPORTED)])
def test_every_unsupported_field_gets_400_naming_it(server, endpoint, field, value):
    base = {"prompt": RAW[0]} if endpoint == "completions" else {"messages": CHATS[0]}
    response = server.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                           json={**base, "max_tokens": 1, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_top_k_0_is_off_as_vllm_takes_it(server):
    """TRL's server mode (and vLLM) send top_k 0 for "no top-k": the same tokens and logprobs as -1, which
    SamplingParams keeps it as; below -1 stays a 400."""
    from fp8engine import SamplingParams
    bodies = [complete(server, prompt=RAW[0], max_tokens=6, temperature=1.0, seed=7, logprobs=0, top_k=k)
              for k in (0, -1)]
    assert bodies[0]["choices"][0]["text"] == bodies[1]["choices"][0]["text"]
    assert bodies[0]["choices"][0]["logprobs"] == bodies[1]["choices"][0]["logprobs"]
    assert SamplingParams(top_k=0).top_k == -1
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=True)  # a bool is not a count


def test_no_op_values_of_unimplemented_fields_are_accepted(server):
    body = complete(server, prompt=RAW[0], max_tokens=2, n=2, best_of=2, suffix="", user="u-1",
                    response_format={"type": "text"}, temperature=0.0)
    assert len(body["choices"]) == 2
    chat = server.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi", "name": "ann"}], "max_tokens": 2, "tools": [],
        "tool_choice": "none", "parallel_tool_calls": False, "modalities": ["text"], "store": False,
        "response_format": {"type": "text"}, "user": "u-1"})
    assert chat.status_code == 200, chat.text
