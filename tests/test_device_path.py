"""The engine's CUDA code path, run on the CPU with the device tracked (tests/fake_cuda.py): the same Python the
engine runs on a GPU, its Triton kernels on the interpreter. Generation with every sampling feature, scoring,
weight updates (KV recalibration, FP8 in place) and the server never mix device and host tensors, a decode step
synchronises with the host at most twice, and the values are the CPU engine's."""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the interpreter

import pytest  # noqa: E402
import torch  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from fp8engine import SamplingParams  # noqa: E402
from fp8engine.entrypoints import async_engine  # noqa: E402
from fp8engine.entrypoints.server import ServerSettings, create_app  # noqa: E402
from tests.conftest import make_engine  # noqa: E402
from tests.fake_cuda import FakeCuda, MixedDevices  # noqa: E402
from tests.tiny_models import save_tiny  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41, 42], list(range(300, 330))]
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, logprobs_mode="raw"),
    "truncated": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, max_tokens=6, ignore_eos=True,
                                seed=3, logprobs=3),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.2, logit_bias={5: 4.0, 9: -100.0}, max_tokens=6,
                                ignore_eos=True, seed=4, logprobs=0),
    "n-stop-prompt": SamplingParams(n=3, temperature=1.0, max_tokens=8, min_tokens=2, seed=5, logprobs=1,
                                    stop=["the"], prompt_logprobs=2),
}
KV_BLOCKS = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    """A tiny Llama with a 1024-token vocabulary: the interpreter runs every Triton program of a step on the host,
    the LM head's included."""
    return save_tiny("llama-llama3", tmp_path_factory.mktemp("device_llama"), tokenizer, vocab_size=1024)


@pytest.fixture()
def dev():
    with FakeCuda() as mode:
        yield mode


def _on_device(model, **options):
    engine = make_engine(model, device="cuda", num_kv_blocks=KV_BLOCKS, **options)
    assert engine.get_stats().device == "cuda" and engine.get_stats().attention_backend == "triton"
    return engine


def _results(outs):
    return [[(c.token_ids, c.logprobs, c.top_logprobs, c.log_kept_mass, c.finish_reason) for c in o.outputs]
            + [o.prompt_logprobs] for o in outs]


def test_the_tracking_catches_mixing_and_counts_syncs(dev):
    x = torch.ones(3, device="cuda")
    assert dev.is_device(x) and x.is_cuda and x.device.type == "cuda" and not dev.is_device(torch.ones(3))
    with pytest.raises(MixedDevices, match="mixes device and host tensors"):
        x + torch.ones(3)
    with pytest.raises(MixedDevices):
        x * torch.tensor(2.0)  # a 0-dim host tensor too
    y = x * 2.0  # a Python scalar is fine
    assert dev.is_device(y) and dev.is_device(y[1:]) and dev.host_syncs() == 0
    assert y.tolist() == [2.0] * 3 and float(y[0]) == 2.0 and y.cpu().sum().item() == 6.0
    assert dict(dev.syncs) == {"tolist": 1, "float": 1, "cpu": 1}  # .sum().item() of the host copy: no sync
    torch.empty(3, device="cuda").copy_(torch.arange(3.0))  # host -> device: a copy, not a sync
    assert dev.host_syncs() == 3


@pytest.mark.parametrize("options", [dict(dtype="float32"), dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"),
                                     dict(batch_invariant=True)], ids=["float32", "fp8", "bi"])
def test_generation_mixes_no_devices_and_syncs_at_most_twice_a_decode_step(dev, model, options):
    """Every sampling feature in one batch (each prompt its own params), stepped by hand to count the host
    synchronisations of each decode step."""
    engine = _on_device(model, **options)
    ids = [engine.add_request(prompt, params) for prompt, params in zip(PROMPTS * 2, PARAMS.values())]
    engine.step()  # the prefill (prompt logprobs, the fork of n = 3)
    per_step, finished = [], {}
    while engine.has_unfinished_requests():
        before = dev.host_syncs()
        finished |= {o.request_id: o for o in engine.step() if o.finished}
        per_step.append(dev.host_syncs() - before)
    assert sorted(finished) == sorted(ids)
    assert all(len(c.token_ids) >= 2 and c.logprobs is not None for o in finished.values() for c in o.outputs)
    assert finished[ids[3]].prompt_logprobs is not None and len(finished[ids[3]].outputs) == 3
    assert len(per_step) >= 5 and max(per_step) <= 2, per_step


def test_float32_values_equal_the_cpu_engine(dev, model):
    """Triton attention on the interpreter and torch's linears in float32: the CPU engine's tokens, logprobs
    within float32 summation order."""
    got = _results(_on_device(model, dtype="float32").generate(PROMPTS, [PARAMS["greedy"], PARAMS["truncated"],
                                                                         PARAMS["n-stop-prompt"]]))
    with torch.overrides._pop_mode_temporarily():
        cpu = make_engine(model, dtype="float32", device="cpu", num_kv_blocks=KV_BLOCKS)
        want = _results(cpu.generate(PROMPTS, [PARAMS["greedy"], PARAMS["truncated"], PARAMS["n-stop-prompt"]]))
    for g, w in zip(got, want):
        for (gt, glp, gtop, gkept, greason), (wt, wlp, wtop, wkept, wreason) in zip(g[:-1], w[:-1]):
            assert gt == wt and greason == wreason
            torch.testing.assert_close(torch.tensor(glp), torch.tensor(wlp), atol=1e-4, rtol=0)
            assert (gtop is None) == (wtop is None) and (gkept is None) == (wkept is None)
        assert (g[-1] is None) == (w[-1] is None)
        if g[-1] is not None:
            torch.testing.assert_close(torch.tensor(g[-1][1:]), torch.tensor(w[-1][1:]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["bf16-short-runs", "fp8-head"])
def test_batch_invariant_scoring_on_the_device_equals_the_rollout_bitwise(dev, model, mode, monkeypatch):
    """bf16-short-runs: a BF16 engine (no FP8 activation quant to hide an ulp) with attention in 16-key runs, so
    that the 30-token prompt's scoring folds 2-3 runs per row in a prefill program and its decode steps split them
    over programs that the combine folds."""
    if mode == "bf16-short-runs":
        from fp8engine.model_executor.kernels import attention_triton
        monkeypatch.setattr(attention_triton, "ATTENTION_BLOCK_N", 16)
        monkeypatch.setattr(attention_triton, "SPLIT_KEYS", 16)
    fp8_head = mode == "fp8-head"
    engine = _on_device(model, batch_invariant=True, quantization="fp8" if fp8_head else None, lm_head_fp8=fp8_head)
    assert engine.runner.kernels.names["lm_head"] == ("fp8:triton" if fp8_head else "triton-bf16")
    params = dataclasses.replace(PARAMS["truncated"], max_tokens=4)
    outs = engine.generate(PROMPTS, params)
    prompts = [o.prompt_token_ids for o in outs]
    responses = [o.outputs[0].token_ids for o in outs]
    assert engine.score(prompts, responses, params) == [o.outputs[0].logprobs for o in outs]
    alone = engine.generate([PROMPTS[2]], params)[0].outputs[0]
    assert (alone.token_ids, alone.logprobs) == (outs[2].outputs[0].token_ids, outs[2].outputs[0].logprobs)


def test_weight_updates_on_the_device_are_in_place_and_recalibrate(dev, model):
    engine = _on_device(model, quantization="fp8", kv_cache_dtype="fp8_e4m3")
    engine.generate(PROMPTS[:1], PARAMS["greedy"])
    pointers = {name: p.data_ptr() for name, p in engine.named_parameters()}
    scales = engine.get_stats().kv_scales
    name = "model.layers.1.self_attn.k_proj.weight"
    new = torch.randn(engine.get_weights_by_name(name).shape) * 0.3  # the trainer's tensors: on the host
    report = engine.update_weights({name: new.bfloat16(), "model.norm.weight": torch.ones(128)}, weight_version=3)
    assert report.num_quantized == 1 and report.weight_version == 3
    assert {n: p.data_ptr() for n, p in engine.named_parameters()} == pointers
    before = engine.kv_scales.num_calibrations
    engine.generate(PROMPTS[:2], PARAMS["truncated"])
    assert engine.kv_scales.num_calibrations == before + 1 and engine.get_stats().kv_scales != scales
    back = engine.get_weights_by_name(name).cpu().float()
    assert (back - new).abs().max() <= new.abs().max() / 8  # one E4M3 rounding of the new weight


def test_the_server_path_on_the_device(dev, model, monkeypatch):
    run = async_engine.AsyncEngine._run

    def in_the_device_thread(self):
        with dev.in_this_thread():
            run(self)
    monkeypatch.setattr(async_engine.AsyncEngine, "_run", in_the_device_thread)
    engine = _on_device(model)
    with TestClient(create_app(engine, ServerSettings())) as client:
        response = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0.7,
                                                        "top_p": 0.9, "seed": 1, "logprobs": 2, "n": 2})
        assert response.status_code == 200, response.text
        assert [len(c["logprobs"]["token_logprobs"]) for c in response.json()["choices"]] == [5, 5]
        streamed = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4, "stream": True,
                                                        "temperature": 0.0, "logprobs": 1})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text


def test_the_kv_budget_leaves_room_for_a_profiled_step(model):
    """Without num_kv_blocks on CUDA, a forward of max_num_batched_tokens (with its logits) runs before the cache
    is sized, and its peak beyond the weights comes off the free memory first (the private cache it writes is not
    counted: the KV budget holds those bytes)."""
    from fp8engine.config import DEFAULT_GPU_KV_FRACTION
    from tests.fake_cuda import CUDA_FREE_BYTES
    with FakeCuda() as mode:
        mode.peak_bytes = 3 << 30  # of the 4 GiB FakeCuda calls free: a cache of ~0.85 GiB
        engine = make_engine(model, device="cuda", max_num_batched_tokens=40, max_num_seqs=4)
        assert mode.launches["_paged_attention_kernel"] == 4  # the profile forward, then the prefill warm-up (2 layers)
    runner = engine.runner
    first = runner.attn_layers[0]
    scratch = 2 * 48 * first.num_kv_heads * first.head_dim * 2  # 40 tokens -> 3 blocks of 16, K and V, bf16
    budget = int((CUDA_FREE_BYTES - ((3 << 30) - scratch)) * DEFAULT_GPU_KV_FRACTION)
    assert runner.num_blocks == budget // runner.kv_bytes_per_block()
    assert runner.kv_cache.shape[2] == runner.num_blocks


TP_FREE_BYTES = 16 << 20  # what the stand-in device says is free to a tensor-parallel engine: a small KV cache


def _ranks_on_the_device(monkeypatch, devices: int, graphs: str | None = None) -> None:
    """Tensor-parallel workers on the stand-in device (tests/fake_cuda_worker.py), gloo standing in for NCCL."""
    from fp8engine.model_executor import tensor_parallel
    monkeypatch.setattr(tensor_parallel, "WORKER_MODULE", "tests.fake_cuda_worker")
    monkeypatch.setenv("FP8ENGINE_TP_DEVICE_BACKEND", "gloo")
    monkeypatch.setenv("FP8ENGINE_TEST_CUDA_DEVICES", str(devices))
    monkeypatch.setenv("FP8ENGINE_TEST_CUDA_GRAPHS", graphs or "")
    monkeypatch.setenv("FP8ENGINE_TEST_CUDA_FREE_BYTES", str(TP_FREE_BYTES))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))


def test_two_ranks_on_the_device_equal_one(model, monkeypatch):
    """Tensor parallelism on CUDA (issue 65): rank 1 a process of its own on the second device, its shard, KV cache
    and step inputs there, none of its ops mixing them with host tensors (the stand-in raises, and the worker's last
    words reach the caller). Decode steps from CUDA graphs on both ranks (rank 1 captures and replays its own as rank
    0 says). Float32 T = 2 gives T = 1's greedy tokens with logprobs within 1e-4, before and after an update of a
    row-parallel weight (whose read-back gathers rank 1's half) and after a sleep and wake of every rank (which drops
    the graphs and captures them again), and T = 1's scores."""
    _ranks_on_the_device(monkeypatch, 2, graphs="replay")
    with FakeCuda(num_devices=2, graphs="replay", free_bytes=TP_FREE_BYTES):
        one = _on_device(model, dtype="float32", max_num_seqs=4)  # graph buckets 1, 2 and 4
        # its KV cache sized from the free memory: every rank profiles a forward (collectives of their own), then
        # takes the smallest rank's blocks
        two = make_engine(model, device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                          tensor_parallel_size=2)
        try:
            assert two.runner.num_blocks > 100
            kernels = two.get_stats().kernels
            assert kernels["tensor_parallel"] == "2 ranks, gloo all-reduce" and kernels["cuda_graphs"] == "decode"
            assert kernels["async_scheduling"].startswith("off")
            name = "model.layers.1.mlp.down_proj.weight"
            new = torch.randn(one.get_weights_by_name(name).shape, generator=torch.Generator().manual_seed(3)) * 0.2
            for step in ("before", "updated", "woken"):
                outs = [[(c.token_ids, c.logprobs) for o in e.generate(PROMPTS, PARAMS["greedy"]) for c in o.outputs]
                        for e in (one, two)]
                assert [t for t, _ in outs[0]] == [t for t, _ in outs[1]], step
                assert max(abs(a - b) for (_, x), (_, y) in zip(*outs) for a, b in zip(x, y)) < 1e-4, step
                if step == "before":
                    for engine in (one, two):
                        engine.update_weights({name: new.clone()}, weight_version=1)
                elif step == "updated":
                    two.sleep(level=1)
                    two.wake_up()
            # 5 decode steps from the graphs captured again at the wake (3 sequences, then 2: buckets 4 and 2)
            graphs = two.runner.graphs
            assert graphs.num_replays == 5 and two.runner.graph_captures == 1
            assert two.runner.tp_leader.call("graph_counts") == [(graphs.num_captures, 5)]  # rank 1's, in step
            assert torch.equal(two.get_weights_by_name(name).cpu(), new)
            # scoring: rank 0 sends the hidden rows, every rank's LM head computes its vocabulary rows' logits
            responses = [tokens for tokens, _ in outs[0]]
            scored = [e.score(PROMPTS, responses, PARAMS["greedy"]) for e in (one, two)]
            assert max(abs(a - b) for x, y in zip(*scored) for a, b in zip(x, y)) < 1e-4
        finally:
            two.shutdown()


def test_two_fp8_ranks_on_the_device_score_as_one(tmp_path, tokenizer, monkeypatch):
    """FP8 linears on CUDA run the fused decoder layers under tensor parallelism too, where o_proj's and down_proj's
    FP8 GEMMs (Linear.forward_quantized) add their partial sums over the ranks (until session 41 they did not: each
    rank went on with its own share). T = 2 scores T = 1's greedy responses near T = 1 (a rank's partial sums are
    rounded before they are added, and the next layer's activation quant can turn that into an E4M3 step: 0.16 at
    most over 8 tokens here; without the sums, 5.8)."""
    shape = dict(vocab_size=1024, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512)  # o_proj and down_proj: whole 128-wide FP8 blocks a rank
    tp_model = save_tiny("llama-llama3", tmp_path, tokenizer, **shape)
    _ranks_on_the_device(monkeypatch, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0, logprobs_mode="raw")
    with FakeCuda(num_devices=2, free_bytes=TP_FREE_BYTES):
        one = make_engine(tp_model, device="cuda", quantization="fp8", enforce_eager=True, num_kv_blocks=KV_BLOCKS)
        two = make_engine(tp_model, device="cuda", quantization="fp8", enforce_eager=True, num_kv_blocks=KV_BLOCKS,
                          tensor_parallel_size=2)
        try:
            assert two.get_stats().kernels["fusion"] == "norm+qkv+attn+act"
            responses = [c.token_ids for o in one.generate(PROMPTS[:2], greedy) for c in o.outputs]
            scored = [e.score(PROMPTS[:2], responses, greedy) for e in (one, two)]
        finally:
            two.shutdown()
    assert max(abs(a - b) for x, y in zip(*scored) for a, b in zip(x, y)) < 0.5


def test_ranks_need_a_device_each(model, monkeypatch):
    _ranks_on_the_device(monkeypatch, 1)
    with FakeCuda(num_devices=1), pytest.raises(ValueError, match="tensor_parallel_size=2 needs a CUDA device per "
                                                                 "rank; this process sees 1"):
        make_engine(model, device="cuda", tensor_parallel_size=2)


def test_a_graph_capture_that_fails_under_tensor_parallelism_ends_the_group(model, monkeypatch):
    """The workers capture what rank 0 says; a capture that then fails on rank 0 leaves their collectives out of
    step, so it is an error naming the way out (a single-rank engine just runs eagerly)."""
    _ranks_on_the_device(monkeypatch, 2)
    from fp8engine.model_executor import tensor_parallel
    monkeypatch.setattr(tensor_parallel, "DEATH_WAIT_S", 0.2)  # the workers are alive: no exit status to wait for
    failed = "CUDA graphs failed under tensor parallelism .*enforce_eager=True runs without them"
    with FakeCuda(num_devices=2, free_bytes=TP_FREE_BYTES), pytest.raises(RuntimeError, match=failed):
        make_engine(model, device="cuda", max_num_seqs=2, num_kv_blocks=KV_BLOCKS, tensor_parallel_size=2)
