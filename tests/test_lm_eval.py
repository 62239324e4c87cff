"""lm-evaluation-harness against `fp8engine serve`, offline, on two tasks this test writes: a
multiple-choice loglikelihood task and a generate_until task. Through `local-completions` it must score
exactly as its own `hf` backend does on the same model in float32 (loglikelihoods within 1e-4), and every
loglikelihood it read from the server must equal the engine's own prompt logprobs bit for bit (and
LLMEngine.score, which batches every request in one forward, to float32 rounding)."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ["HF_DATASETS_OFFLINE"] = "1"  # datasets reads it when imported: nothing may be downloaded

from fp8engine import SamplingParams  # noqa: E402
from fp8engine.bench.serve_load import serving  # noqa: E402
from tests.conftest import make_engine  # noqa: E402

lm_eval = pytest.importorskip("lm_eval", reason="pip install -e .[dev] installs lm-eval[api]")

ENGINE_TOL = 1e-4  # the server's loglikelihoods vs LLMEngine.score over all requests in one batch (float32)
HF_TOL = 1e-4  # vs lm-eval's hf backend (Hugging Face, float32)

MC_DOCS = [
    {"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "red"], "answer": 0},
    {"question": "How many legs does a cat have?", "choices": ["two", "four", "six"], "answer": 1},
    {"question": "What is the capital of France?", "choices": ["Berlin", "Madrid", "Paris"], "answer": 2},
    {"question": "Which animal barks?", "choices": ["dog", "fish", "bird"], "answer": 0},
    {"question": "What is 2 + 2?", "choices": ["3", "4", "5"], "answer": 1},
    {"question": "Which is a fruit?", "choices": ["carrot", "potato", "apple"], "answer": 2},
]
GEN_DOCS = [
    {"question": "What is the capital of Japan?", "answer": "Tokyo"},
    {"question": "What is 3 + 4?", "answer": "7"},
    {"question": "What color is grass?", "answer": "Green"},
    {"question": "What is the opposite of hot?", "answer": "Cold"},
]
MC_TASK = """task: fp8engine_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_TASK = """task: fp8engine_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ['\\s']
"""
TASKS = ["fp8engine_mc", "fp8engine_gen"]


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, docs, template in (("mc", MC_DOCS, MC_TASK), ("gen", GEN_DOCS, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"{name}.yaml").write_text(template.format(data=data))
    return TaskManager(include_path=str(root))


def evaluate(model, task_manager, **model_args) -> tuple[dict, float]:
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=model, model_args=model_args or None, tasks=TASKS,
                                      task_manager=task_manager, log_samples=True, random_seed=0,
                                      numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return results, time.perf_counter() - start


def loglikelihoods(results: dict) -> dict[tuple[str, str], float]:
    """(context, continuation) -> the loglikelihood lm-eval read, over every multiple-choice request."""
    return {tuple(s["arguments"][i]): s["resps"][i][0][0]
            for s in results["samples"]["fp8engine_mc"] for i in range(len(s["arguments"]))}


def test_lm_eval_local_completions_scores_equal_hf_and_the_engine(task_manager, default_dir):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    with serving(["--dtype", "float32", "--num-kv-blocks", "256"]) as base_url:
        client = LocalCompletionsAPI(base_url=f"{base_url}/v1/completions", model="default", tokenizer=default_dir,
                                     tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1,
                                     max_retries=1, timeout=300)
        served, served_s = evaluate(client, task_manager)
    hf, hf_s = evaluate("hf", task_manager, pretrained=default_dir, dtype="float32", device="cpu", batch_size=1)
    print(f"lm-eval local-completions {served_s:.1f} s, hf {hf_s:.1f} s")
    for task in TASKS:
        print(task, {k: v for k, v in served["results"][task].items() if "stderr" not in k},
              {k: v for k, v in hf["results"][task].items() if "stderr" not in k})
        assert served["results"][task] == hf["results"][task]
    assert 0 < served["results"]["fp8engine_mc"]["acc,none"]
    generated = [s["filtered_resps"] for s in served["samples"]["fp8engine_gen"]]
    assert generated == [s["filtered_resps"] for s in hf["samples"]["fp8engine_gen"]]

    ours, theirs = loglikelihoods(served), loglikelihoods(hf)
    assert ours.keys() == theirs.keys() and len(ours) == sum(len(d["choices"]) for d in MC_DOCS)
    assert max(abs(ours[k] - theirs[k]) for k in ours) < HF_TOL

    engine = make_engine(dtype="float32", num_kv_blocks=256)
    pairs = [client._encode_pair(context, continuation) for context, continuation in ours]
    with ThreadPoolExecutor(1) as worker:  # one request at a time, as lm-eval sent them
        direct = [worker.submit(prompt_score, engine, c, r).result() for c, r in pairs]
        scores = worker.submit(engine.score, [c for c, _ in pairs], [r for _, r in pairs],
                               SamplingParams(temperature=0.0, logprobs_mode="raw")).result()
    assert list(ours.values()) == direct
    batched = max(abs(a - sum(b)) for a, b in zip(ours.values(), scores))
    print(f"max |server - LLMEngine.score, all in one batch| = {batched:.2e}, "
          f"max |server - hf| = {max(abs(ours[k] - theirs[k]) for k in ours):.2e}")
    assert batched < ENGINE_TOL


def prompt_score(engine, context: list[int], continuation: list[int]) -> float:
    """The continuation's loglikelihood from the engine's prompt logprobs, summed as lm-eval sums them."""
    out = engine.generate([context + continuation], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    return sum(out.prompt_logprobs[len(context):])
