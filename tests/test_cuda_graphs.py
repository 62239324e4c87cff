"""CUDA graphs for decode steps (model_executor/cuda_graphs.py), driven on the CPU: the engine's CUDA path under
tests/fake_cuda.py with a capture that records nothing but checks what a real one needs — no host
synchronisation inside the captured region, and a replay that reads only the static buffers (it runs the captured
function again on them and writes the captured output in place, as a graph replays into its own memory:
FakeCuda(graphs="replay")). What
the buffers, the padding, the buckets and the invalidation do is therefore what a GPU would replay; the capture
itself and the speed need a device (`make gpu-check`)."""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the interpreter

import pytest  # noqa: E402
import torch  # noqa: E402

from fp8engine import SamplingParams  # noqa: E402
from fp8engine.model_executor import cuda_graphs  # noqa: E402
from fp8engine.weights.loader import expected_names  # noqa: E402
from tests.conftest import make_engine  # noqa: E402
from tests.fake_cuda import FakeCuda  # noqa: E402
from tests.tiny_models import save_tiny, tiny_dir  # noqa: E402,F401

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41, 42], list(range(300, 330))]
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, ignore_eos=True, seed=3, logprobs=2)
KV_BLOCKS = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    return save_tiny("llama-llama3", tmp_path_factory.mktemp("graphs_llama"), tokenizer, vocab_size=1024)


@pytest.fixture()
def dev():
    with FakeCuda(graphs="replay") as mode:
        yield mode


def _engine(model, **options):
    return make_engine(model, device="cuda", num_kv_blocks=KV_BLOCKS, max_num_seqs=4, **options)


def _results(outs):
    return [[(c.token_ids, c.logprobs, c.top_logprobs) for c in o.outputs] for o in outs]


def test_buckets():
    assert cuda_graphs.buckets(1) == [1]
    assert cuda_graphs.buckets(5) == [1, 2, 4, 5]
    assert cuda_graphs.buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert cuda_graphs.buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert cuda_graphs.buckets(1000)[-3:] == [224, 240, 256]


@pytest.mark.parametrize("options", [dict(batch_invariant=True), dict(batch_invariant=True, quantization="fp8")],
                         ids=["bf16", "fp8"])
def test_decode_steps_from_graphs_equal_eager_steps_bitwise(dev, model, options):
    """Three sequences (bucket 4: one padding row) then fewer as they finish: tokens, logprobs and top-k
    alternatives bit for bit those of an eager engine, the KV cache too (padding writes nothing)."""
    graphs = _engine(model, **options)
    runner = graphs.runner
    assert runner.graphs is not None and graphs.get_stats().kernels["cuda_graphs"] == "decode"
    assert sorted(dev.captured) == [1, 2, 4]  # every bucket at start-up, on padding alone
    eager = _engine(model, enforce_eager=True, **options)
    assert eager.runner.graphs is None
    assert eager.get_stats().kernels["cuda_graphs"] == "off: enforce_eager=True"
    params = [SEEDED, dataclasses.replace(SEEDED, max_tokens=3), dataclasses.replace(SEEDED, max_tokens=7)]
    got = _results(graphs.generate(PROMPTS, params))
    assert got == _results(eager.generate(PROMPTS, params))
    # 6 decode steps: 3 sequences twice, 2 sequences once, 1 sequence three times (buckets 4, 2 and 1)
    assert runner.graphs.num_replays == 6 and runner.graphs.num_sampler_replays == 0  # top-p, top-k: eager
    with dev.allow_mixing():
        assert torch.equal(runner.kv_cache.view(torch.uint8), eager.runner.kv_cache.view(torch.uint8))
    if options.get("quantization"):
        return  # the sampler's graphs below do not depend on the weights' format
    # Greedy and tempered rows with the sampled token's logprob, raw and processed: the fused sampler, replayed
    # from each bucket's sampler graph after the model's (5 decode steps: 3 rows thrice, then 2, then 1)
    fused = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0),
             SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=4, logprobs=0, logprobs_mode="raw"),
             SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=5, logprobs=0)]
    got = _results(graphs.generate(PROMPTS, fused))
    assert got == _results(eager.generate(PROMPTS, fused))
    assert runner.graphs.num_replays == 11 and runner.graphs.num_sampler_replays == 5
    assert sorted(runner.graphs.samplers) == [(1, True), (2, True), (4, True)]


def test_async_scheduling_gives_the_outputs_of_steps_that_wait(dev, model):
    """With async_scheduling each decode step is launched before the host reads the tokens of the one before (fed
    on the device, read a step later): tokens, logprobs, stop tokens, stop strings, max_tokens, min_tokens (whose
    banned rows wait for the host) and n = 2 forks as an engine whose steps wait, bit for bit (batch invariant: a
    row that stopped one step earlier still rides in the next step's batch); an abort between steps returns the
    tokens that step() returned, as there."""
    plain = _engine(model, batch_invariant=True)
    ahead = _engine(model, batch_invariant=True, async_scheduling=True)
    assert ahead.get_stats().kernels["async_scheduling"] == "on"
    assert plain.get_stats().kernels["async_scheduling"] == "off: async_scheduling=False"
    probe = plain.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop_text = plain.detokenizer.decode(probe.token_ids[5:6])
    params = [SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[probe.token_ids[3]], logprobs=0),
              SamplingParams(temperature=0.9, max_tokens=7, seed=2, n=2, logprobs=0, logprobs_mode="raw"),
              SamplingParams(temperature=1.0, max_tokens=10, seed=3, min_tokens=4, stop=[stop_text], logprobs=0)]
    want = [[(c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
            for o in plain.generate(PROMPTS, params)]
    got = [[(c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
           for o in ahead.generate(PROMPTS, params)]
    assert got == want and ahead.num_steps_ahead >= 3
    assert {c[2] for o in got for c in o} == {"stop", "length"}
    # An abort after four steps: the tokens step() returned, whatever the device drew since
    for engine in (plain, ahead):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, dataclasses.replace(params[1], n=1, max_tokens=12), request_id=f"r{i}")
    seen = [{}, {}]
    for engine, outs in zip((plain, ahead), seen):
        for _ in range(4):
            outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    aborted = [engine.abort_request("r1").outputs[0].token_ids for engine in (plain, ahead)]
    assert aborted[0] == seen[0]["r1"] and aborted[1] == seen[1]["r1"]
    assert aborted[1] == aborted[0][:len(aborted[1])]  # the async engine's outputs trail by up to a step
    # ... then an update that the other two go on under (in_flight="keep"): every token after it is the new weights'
    name = "model.layers.0.mlp.down_proj.weight"
    for engine in (plain, ahead):  # once step() has returned r0's sixth token
        while len(next((o.outputs[0].token_ids for o in engine.step() if o.request_id == "r0"), ())) < 6:
            pass
        weight = engine.get_weights_by_name(name)
        engine.update_weights({name: (weight.float() * 1.5).bfloat16()}, in_flight="keep")
    rest = [{o.request_id: (o.outputs[0].token_ids, o.outputs[0].token_weight_versions) for o in _drain(engine)}
            for engine in (plain, ahead)]
    assert rest[0] == rest[1] and rest[0]["r0"][1] == [0] * 6 + [1] * 6
    assert len(dev.captured) > 3  # the sampler's graphs too
    # A capture that fails under a step launched ahead: that step runs eagerly on the tokens read from the device,
    # and the engine goes on without graphs, its outputs still those of the steps that wait
    for engine in (plain, ahead):
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(prompt, dataclasses.replace(params[1], n=1, max_tokens=5), request_id=f"s{i}")
    for _ in range(3):
        ahead.step()
    assert ahead._in_flight is not None

    def broken(forward):
        raise RuntimeError("no memory for a graph")
    ahead.runner.graphs.graphs.clear()
    ahead.runner.graphs.capture = broken
    ends = [{o.request_id: o.outputs[0].token_ids for o in _drain(engine)} for engine in (plain, ahead)]
    assert ends[0] == ends[1] and len(ends[0]) == 2 and ahead.runner.graphs is None


def _drain(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    return outs


def test_new_kv_scales_or_a_new_adapter_recapture(dev, model):
    """FP8 KV scales are baked into the attention launches: a weight update that recalibrates them drops the
    graphs, and the next steps equal an eager engine given the same update; so does a LoRA update. (Two sequences
    that finish together: every step's batch is a bucket, so the launches are the eager ones without
    batch_invariant, whose FP8 KV calibration runs fixed text that a 1024-token vocabulary cannot embed.)"""
    options = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", max_lora_rank=4)
    graphs, eager = _engine(model, **options), _engine(model, enforce_eager=True, **options)
    name = "model.layers.1.self_attn.k_proj.weight"
    update = {name: (torch.randn(graphs.get_weights_by_name(name).shape, generator=torch.Generator().manual_seed(1))
                     * 0.3).bfloat16()}
    g = torch.Generator().manual_seed(2)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    adapter = {f"{prefix}.lora_A.weight": torch.randn(4, 128, generator=g) * 0.1,
               f"{prefix}.lora_B.weight": torch.randn(128, 4, generator=g) * 0.1}
    runner = graphs.runner.graphs
    first = graphs.generate(PROMPTS[:2], SEEDED)
    assert _results(first) == _results(eager.generate(PROMPTS[:2], SEEDED))
    captures = runner.num_captures
    for engine in (graphs, eager):
        engine.update_weights(update, weight_version=1)
    after_update = graphs.generate(PROMPTS[:2], SEEDED)
    assert _results(after_update) == _results(eager.generate(PROMPTS[:2], SEEDED)) != _results(first)
    assert runner.num_captures > captures
    captures = runner.num_captures
    for engine in (graphs, eager):
        engine.update_lora(adapter, 2.0)
    after_lora = graphs.generate(PROMPTS[:2], SEEDED)
    assert _results(after_lora) == _results(eager.generate(PROMPTS[:2], SEEDED)) != _results(after_update)
    assert runner.num_captures > captures


def test_other_steps_run_eagerly_and_a_failed_capture_switches_graphs_off(dev, model, monkeypatch):
    """Prefill chunks, prompt logprobs and draft tokens are not graph steps; a capture that fails leaves the
    engine on its eager path, saying why."""
    engine = _engine(model, batch_invariant=True, speculative="ngram")
    runner = engine.runner
    outs = engine.generate([list(range(5, 25)) * 2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                   prompt_logprobs=1))
    assert outs[0].prompt_logprobs is not None and len(outs[0].outputs[0].token_ids) == 6
    drafted = engine.get_stats().spec_verifications
    assert runner.graphs.num_replays + drafted >= 1  # the prefill ran eagerly, the decodes from graphs or drafts

    def broken():
        def capture(forward):
            raise RuntimeError("operation not permitted when stream is capturing")
        return capture
    monkeypatch.setattr(cuda_graphs, "capture_cuda", broken)
    off = _engine(model, batch_invariant=True)
    assert off.runner.graphs is None
    assert off.get_stats().kernels["cuda_graphs"].startswith("off: capture failed (RuntimeError: operation not")
    assert _results(off.generate(PROMPTS[:1], SEEDED)) == _results(engine.generate(PROMPTS[:1], SEEDED))


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory, tokenizer):
    return save_tiny("qwen3_5", tmp_path_factory.mktemp("graphs_qwen3_5"), tokenizer, vocab_size=1024)


def test_a_hybrid_models_decode_steps_from_graphs_equal_eager_steps_bitwise(dev, hybrid_model):
    """Qwen3.5 (GDN layers and gated attention): decode steps replay from graphs, each row's state slot in the
    static buffer, padding rows advancing the scratch slot past the scheduler's; tokens, logprobs, the KV cache and
    every sequence's state slot bit for bit an eager engine's, n = 2 forks too. A decode step that writes a state
    snapshot (prefix caching: a block filled) runs eagerly."""
    options = dict(batch_invariant=True, quantization="fp8")
    graphs = _engine(hybrid_model, **options)
    runner = graphs.runner
    assert runner.graphs is not None and graphs.get_stats().kernels["cuda_graphs"] == "decode"
    eager = _engine(hybrid_model, enforce_eager=True, **options)
    params = [SEEDED, dataclasses.replace(SEEDED, max_tokens=3), dataclasses.replace(SEEDED, max_tokens=7)]
    got = _results(graphs.generate(PROMPTS, params))
    assert got == _results(eager.generate(PROMPTS, params))
    fork = SamplingParams(n=2, temperature=1.0, max_tokens=4, ignore_eos=True, seed=5, logprobs=0)
    assert _results(graphs.generate(PROMPTS[:2], fork)) == _results(eager.generate(PROMPTS[:2], fork))
    # 6 + 3 decode steps, one of them eager: the 30-token prompt's sequence fills its second block (a snapshot)
    assert runner.graphs.num_replays == 8
    scratch = runner.graph_state_scratch
    with dev.allow_mixing():
        assert torch.equal(runner.kv_cache.view(torch.uint8), eager.runner.kv_cache.view(torch.uint8))
        for mine, theirs in zip(runner.states, eager.runner.states):
            assert mine.shape[1] == scratch + 1 and torch.equal(mine[:, :scratch], theirs[:, :scratch])


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, tokenizer):
    """A small Qwen3-MoE (4 experts, top 2, 2 layers): the interpreter pays per tile."""
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("graphs_moe"), tokenizer, vocab_size=1024, num_experts=4,
                     num_experts_per_tok=2, num_hidden_layers=2)


def test_a_moe_models_decode_steps_from_graphs_equal_eager_steps_bitwise(dev, moe_model):
    """Qwen3-MoE: the routing sorts a step's rows by expert on the device into a fixed tile count (align_rows), so
    decode steps replay from graphs; tokens, logprobs and the routed experts bit for bit an eager engine's, padding
    rows' routing kept out of every token's slot (the buffer's spare row)."""
    options = dict(batch_invariant=True, quantization="fp8")
    graphs = _engine(moe_model, **options)
    assert graphs.get_stats().kernels["cuda_graphs"] == "decode"
    eager = _engine(moe_model, enforce_eager=True, **options)
    params = [dataclasses.replace(SEEDED, max_tokens=m, return_routed_experts=True) for m in (5, 3, 7)]
    outs = [e.generate(PROMPTS, params) for e in (graphs, eager)]
    assert _results(outs[0]) == _results(outs[1])
    for a, b in zip(*outs):
        assert torch.equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)
    assert graphs.runner.graphs.num_replays == 6
    routed = graphs.runner.routed_experts
    with dev.allow_mixing():
        assert torch.equal(routed[:-1], eager.runner.routed_experts[:-1])


def test_engines_the_graphs_cannot_serve_say_why(model, tiny_dir):  # noqa: F811
    assert make_engine(model, num_kv_blocks=KV_BLOCKS).get_stats().kernels["cuda_graphs"] == "off: not a CUDA device"


def test_an_in_flight_update_between_graph_steps_equals_eager_steps(dev, model):
    """update_weights(in_flight="keep") lands between two decode steps of live sequences (FP8 weights and KV):
    the next steps recapture for the new KV scales and go on bit for bit as an eager engine given the same
    update at the same step, per-token weight versions included."""
    options = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    name = "model.layers.0.mlp.down_proj.weight"
    engines = [_engine(model, **options), _engine(model, enforce_eager=True, **options)]
    update = {name: (torch.randn(engines[0].get_weights_by_name(name).shape,
                                 generator=torch.Generator().manual_seed(4)) * 0.2).bfloat16()}
    results = []
    for engine in engines:
        for prompt in PROMPTS[:2]:
            engine.add_request(prompt, dataclasses.replace(SEEDED, max_tokens=8))
        finished, steps = [], 0
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
            steps += 1
            if steps == 4:
                engine.update_weights(update, weight_version=1, in_flight="keep")
        results.append(sorted(((o.request_id, c.token_ids, c.logprobs, c.token_weight_versions)
                               for o in finished for c in o.outputs), key=lambda r: r[1]))
    assert results[0] == results[1]
    assert all(r[3][0] == 0 and r[3][-1] == 1 for r in results[0])  # each sample spans both versions
    # 7 decode steps: the first after the update calibrates the new KV scales eagerly (an observer), the rest replay
    assert engines[0].runner.graphs.num_replays == 6


def test_sleep_hands_the_device_memory_back_and_the_graphs_replay_after_wake(dev, model):
    """The CUDA path of sleep: level 2 leaves at most 1% of the device bytes the engine held (the storages shrink to
    nothing, the graphs, which hold their addresses, are dropped); after wake and a full update the graphs are
    captured again and decode steps give the bits they gave before (those of eager steps: the tests above); a
    level-1 sleep brings the same bits back from host memory."""
    graphs = make_engine(model, device="cuda", num_kv_blocks=KV_BLOCKS, max_num_seqs=1, batch_invariant=True)
    state = {name: graphs.get_weights_by_name(name).cpu() for name in expected_names(graphs.runner.model)}
    prompts, params = PROMPTS[:1], dataclasses.replace(SEEDED, max_tokens=3)
    before = _results(graphs.generate(prompts, params))
    held = dev.live_bytes()
    report = graphs.sleep(2)
    assert dev.live_bytes() <= 0.01 * held, (dev.live_bytes(), held)
    assert report.num_bytes >= 0.95 * held and graphs.runner.graphs is None
    graphs.wake_up()
    with pytest.raises(RuntimeError, match="sleep\\(level=2\\)"):
        graphs.generate(prompts, params)
    graphs.update_weights(state)
    stats = graphs.get_stats()
    assert stats.num_graph_recaptures_total == 1 and stats.kernels["cuda_graphs"] == "decode"
    captured = len(dev.captured)
    assert _results(graphs.generate(prompts, params)) == before
    assert graphs.runner.graphs.num_replays > 0
    graphs.sleep(1)
    graphs.wake_up()
    assert len(dev.captured) > captured and graphs.get_stats().num_graph_recaptures_total == 2
    assert _results(graphs.generate(prompts, params)) == before
