"""The decoder layers in one C++ call (model_executor/fused_decoder.py, csrc/decoder.cpp) give the Python
layers' tokens and logprobs bit for bit, in every precision mode, with q/k norms and biases, batch invariant
or not; and the engine takes that path only where it applies."""

import collections
import glob

import pytest
import torch
from safetensors.torch import load_file

from fp8engine import SamplingParams
from tests.conftest import cpu_flags, make_engine, require_cpu_op
from tests.tiny_models import tiny_dir  # noqa: F401 (fixture)

MODES = {
    "bf16": dict(),
    "fp8-linear": dict(quantization="fp8"),
    "fp8-kv": dict(kv_cache_dtype="fp8_e4m3"),
    "full-fp8": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_attention=True),
}
PROMPTS = [list(range(100, 131)), list(range(700, 709)), list(range(2000, 2050)), [5, 6, 7]]
PARAMS = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=11 + i, logprobs=0)
          for i in range(len(PROMPTS))]


@pytest.fixture(autouse=True)
def _needs_plan():
    """The plan needs every op it calls: the attention and layer ops (AVX-512) and the BF16 linear (AVX512-BF16)."""
    if not require_cpu_op("decoder_plan_supported")():
        if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi"} <= cpu_flags():
            pytest.fail("this CPU has what the decoder plan's ops need, but they did not all load")
        pytest.skip("this CPU lacks an instruction set one of the decoder plan's ops needs")


def run(engine, fused: bool, prompts=PROMPTS, params=PARAMS):
    """Tokens and logprobs of the prompts, with the engine's plan on or off (prefix cache flushed first)."""
    model = engine.runner.model
    saved = model.fused
    model.fused = saved if fused else None
    engine.flush_prefix_cache()
    try:
        outs = engine.generate(prompts, params)
    finally:
        model.fused = saved
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def counting(engine) -> collections.Counter:
    """The plan's calls the engine makes from now on, by entry point: `forward` (the layers on the embeddings) and
    `forward_tokens` (embedding, layers and final norm)."""
    calls = collections.Counter()
    plan = engine.runner.model.fused
    inner = plan.plan

    def counted(name):
        def call(*args):
            calls[name] += 1
            return getattr(inner, name)(*args)
        return staticmethod(call)
    plan.plan = type("Counted", (), {name: counted(name) for name in ("forward", "forward_tokens")})()
    return calls


@pytest.mark.parametrize("arch", ["llama-yarn", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", list(MODES))
def test_fused_layers_match_the_python_layers(tiny_dir, tiny_qwen3_dir, arch, mode):  # noqa: F811
    model = tiny_qwen3_dir if arch == "qwen3" else tiny_dir(arch)
    engine = make_engine(model, **MODES[mode])
    assert engine.runner.model.fused is not None
    python = run(engine, fused=False)  # first: the KV-scale calibration (recompute) happens here
    calls = counting(engine)
    fused = run(engine, fused=True)
    assert calls["forward_tokens"] >= 10 and not calls["forward"]  # one prefill step, then a decode step per token
    assert fused == python
    assert all(len(tokens) == 10 for tokens, _ in fused)


@pytest.mark.parametrize("mode", ["bf16", "fp8-linear"])
def test_fused_layers_match_when_batch_invariant(tiny_dir, mode):  # noqa: F811
    engine = make_engine(tiny_dir("llama-yarn"), batch_invariant=True, **MODES[mode])
    calls = counting(engine)
    fused = run(engine, fused=True)
    assert calls.total() >= 10
    assert run(engine, fused=False) == fused


def test_default_model_decode_matches(default_dir, monkeypatch):
    """The default model: hidden 576 (partial FP8 blocks, per-shard scale rows for q/k/v), tied head; and the same
    bits without the plan's next-weight prefetch (FP8ENGINE_PREFETCH_NEXT=0)."""
    engine = make_engine(quantization="fp8")
    calls = counting(engine)
    one = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=5, logprobs=0)]
    fused = run(engine, True, PROMPTS[:1], one)
    # the prefill and 5 decode steps; a tied embedding in the nt16 layout is looked up in Python (layout.embedding)
    assert calls == {"forward" if engine.runner.model.model.embed_tokens.in_layout else "forward_tokens": 6}
    assert run(engine, False, PROMPTS[:1], one) == fused
    monkeypatch.setenv("FP8ENGINE_PREFETCH_NEXT", "0")
    assert run(make_engine(quantization="fp8"), True, PROMPTS[:1], one) == fused


def test_calibration_takes_the_python_layers(tiny_dir):  # noqa: F811
    engine = make_engine(tiny_dir("qwen2"), kv_cache_dtype="fp8_e4m3")
    fused = engine.runner.model.fused
    assert fused.usable()
    fused.attn[1].observer = lambda *args: None  # what KVScaleManager.calibrating sets
    assert not fused.usable()
    fused.attn[1].observer = None
    assert fused.usable()


def test_a_float32_head_keeps_its_final_norm_in_python(tiny_dir):  # noqa: F811
    """Before a float32 LM head the final norm is Python's float32 one: the plan runs the layers only (`forward`),
    and tokens and logprobs are the Python layers'."""
    engine = make_engine(tiny_dir("llama-yarn"), quantization="fp8", lm_head_fp32=True)
    python = run(engine, fused=False)
    calls = counting(engine)
    assert run(engine, fused=True) == python
    assert calls["forward"] >= 10 and not calls["forward_tokens"]


def test_bf16_rows_past_the_kernel_take_torch_in_the_plan_too(tiny_dir, monkeypatch):  # noqa: F811
    """Where the Python layer gives a BF16 projection's rows to torch's GEMM (bf16_linear_cpu.kernel_takes), the
    plan calls the same op for them: every step takes the plan, bit for bit the Python layers. (Weights as rows:
    in the nt16 layout the kernel takes every M.)"""
    monkeypatch.setenv("FP8ENGINE_NT16", "0")
    engine = make_engine(tiny_dir("qwen2"))
    monkeypatch.setattr("fp8engine.model_executor.kernels.bf16_linear_cpu.kernel_takes",
                        lambda m, batch_invariant, gemm, nt16=False: nt16 or m <= 2)
    python = run(engine, fused=False)
    calls = counting(engine)
    assert run(engine, fused=True) == python
    assert calls.total() >= 10


def test_where_the_plan_is_not_built(tiny_dir, monkeypatch):  # noqa: F811
    assert make_engine(tiny_dir("qwen2")).get_stats().decoder_backend == "cpp-plan"
    moe = make_engine(tiny_dir("qwen3_moe"), quantization="fp8")
    assert moe.runner.model.fused is None and moe.get_stats().decoder_backend == "python"
    assert make_engine(tiny_dir("qwen2"), dtype="float32").runner.model.fused is None
    for arch in ("qwen3_5_moe", "qwen3_next"):  # hybrids with MoE blocks
        assert make_engine(tiny_dir(arch), kv_cache_memory_bytes=4 << 20).runner.model.fused is None
    monkeypatch.setenv("FP8ENGINE_FUSED_DECODER", "0")
    assert make_engine(tiny_dir("qwen2")).runner.model.fused is None
    monkeypatch.setenv("FP8ENGINE_FUSED_DECODER", "yes")
    with pytest.raises(ValueError, match=r"FP8ENGINE_FUSED_DECODER must be one of \('0', '1'\), got 'yes'"):
        make_engine(tiny_dir("qwen2"))


def test_plan_checks_its_inputs():
    cos = torch.zeros(8, 32, dtype=torch.bfloat16)
    args = (cos, cos, [4, 2, 32, 0], 1e-6, 0.1, False, False, False, ["avx512", "avx512"], True)
    with pytest.raises(RuntimeError, match="32 tensors per layer expected, got 3"):
        torch.classes.fp8engine.DecoderPlan([None] * 3, *args, "", 1, False)
    with pytest.raises(RuntimeError, match="a layer norm weight is missing"):
        torch.classes.fp8engine.DecoderPlan([None] * 32, *args, "", 1, False)
    with pytest.raises(RuntimeError, match="a tensor-parallel group needs a name"):
        torch.classes.fp8engine.DecoderPlan([None] * 32, *args, "", 2, False)


def test_hybrid_plan_checks_its_inputs():
    cos = torch.zeros(8, 8, dtype=torch.bfloat16)
    args = (cos, cos, [4, 2, 32, 8, 0, 2, 4, 32, 32, 4], 1e-6, 0.1, False, False, ["avx512", "avx512"], True, "", 1,
            False)
    with pytest.raises(RuntimeError, match="55 tensors per layer expected, got 3 for 1 layers"):
        torch.classes.fp8engine.HybridPlan([None] * 3, [0], [-1] * 7, *args)
    with pytest.raises(RuntimeError, match="layer 0 has no input norm"):
        torch.classes.fp8engine.HybridPlan([None] * 55, [0], [-1] * 7, *args)
    with pytest.raises(RuntimeError, match="layer kind 0 \\(GDN\\) or 1 \\(attention\\) expected"):
        torch.classes.fp8engine.HybridPlan([cos] * 55, [2], [-1] * 7, *args)


@pytest.mark.parametrize("mode", ["bf16", "fp8-linear"])
def test_plan_sees_weight_updates(tiny_dir, mode):  # noqa: F811
    """update_weights writes into the tensors the plan holds: after an update the fused path gives the new
    weights' outputs, bit for bit the Python layers' ones."""
    model = tiny_dir("llama-yarn")
    engine = make_engine(model, **MODES[mode])
    before = run(engine, fused=True)
    state = {}
    for path in glob.glob(f"{model}/*.safetensors"):
        state |= load_file(path)
    gen = torch.Generator().manual_seed(5)
    update = {name: t + torch.randn(t.shape, generator=gen).to(t.dtype) * 0.05
              for name, t in state.items() if "layers.1." in name and t.dim() == 2}
    assert any("down_proj" in name for name in update)
    engine.update_weights(update)
    calls = counting(engine)
    after = run(engine, fused=True)
    assert calls.total() >= 10
    assert after != before
    assert run(engine, fused=False) == after


@pytest.mark.parametrize("mode", ["bf16", "fp8-linear"])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["plain", "batch-invariant"])
def test_plan_runs_a_lora_adapter_as_the_python_layers_do(tiny_dir, mode, batch_invariant):  # noqa: F811
    """A loaded adapter runs inside the plan (its two products per projection, the same ops as layers/lora.py):
    bit for bit the Python layers, and removing it gives the base's outputs again."""
    from tests.test_lora import adapter
    engine = make_engine(tiny_dir("llama-llama3"), max_lora_rank=8, batch_invariant=batch_invariant, **MODES[mode])
    base = run(engine, fused=True)
    engine.update_lora(adapter(8, seed=1), 2.0)
    calls = counting(engine)
    fused = run(engine, fused=True)
    assert calls.total() >= 10 and engine.get_stats().lora_active
    assert fused != base and run(engine, fused=False) == fused
    engine.update_lora({})
    assert run(engine, fused=True) == base


class StepChecked:
    """A hybrid plan that also runs each of its steps through the Python layers, from the same KV caches and states,
    and asserts the same output, residual, caches and states (snapshot slots included), bit for bit; `steps` counts
    them, `snapshots` the snapshots they wrote."""

    def __init__(self, model):
        self.plan, self.model, self.steps, self.snapshots = model.fused, model, 0, 0
        self.pools = [t for g in model.gdn_layers() for t in (g.conv_state, g.rec_state)]
        self.pools += [t for a in model.attention_layers() for t in (a.k_cache, a.v_cache)]

    def usable(self, rows, meta):
        return self.plan.usable(rows, meta)

    def __call__(self, x, positions, meta):
        before = [p.clone() for p in self.pools]
        out = self.plan(x, positions, meta)
        after = [p.clone() for p in self.pools]
        for pool, saved in zip(self.pools, before):
            pool.copy_(saved)
        y, residual = x, None
        for layer in self.model.model.layers:
            y, residual = layer(positions, y, residual, meta)
        assert torch.equal(out[0], y) and torch.equal(out[1], residual)
        assert all(torch.equal(pool, saved) for pool, saved in zip(self.pools, after))
        self.steps += 1
        self.snapshots += len(meta.state_snapshots)
        return out


@pytest.mark.parametrize("mode,batch_invariant", [("bf16", False), ("fp8-linear", False), ("full-fp8", False),
                                                  ("fp8-linear", True)])
def test_hybrid_decode_steps_match_the_python_layers(tiny_dir, mode, batch_invariant):  # noqa: F811
    """Qwen3.5's decode steps in one C++ call (fused_decoder.HybridDecoder): GDN layers (their conv and recurrent
    states), gated attention, zero-centred norms; each step's output, KV caches and states bit for bit the Python
    layers' from the same inputs, and so the tokens and logprobs. Prefill steps run in Python either way."""
    engine = make_engine(tiny_dir("qwen3_5"), batch_invariant=batch_invariant, max_num_seqs=4,
                         kv_cache_memory_bytes=4 << 20, **MODES[mode])  # small pools: a step copies them twice
    assert engine.get_stats().decoder_backend == "cpp-plan-decode"
    python = run(engine, fused=False)
    model = engine.runner.model
    plan = model.fused
    model.fused = checked = StepChecked(model)
    try:
        fused = run(engine, fused=True)
    finally:
        model.fused = plan
    assert checked.steps == 9 and checked.snapshots > 0  # every decode step, some writing a sequence's snapshot
    assert fused == python and all(len(tokens) == 10 for tokens, _ in fused)


def test_hybrid_plan_runs_lora_and_sees_updates(tiny_dir):  # noqa: F811
    """An FP8 Qwen3.5 engine's plan with a LoRA adapter on GDN and attention projections, then after an update of the
    GDN's conv, A_log, dt_bias, in_proj_a (model dtype) and in_proj_qkv (FP8) and the gated attention's q_proj: every
    decode step bit for bit the Python layers (StepChecked), and the outputs change with each."""
    engine = make_engine(tiny_dir("qwen3_5"), quantization="fp8", max_lora_rank=4, max_num_seqs=4,
                         kv_cache_memory_bytes=4 << 20)
    model = engine.runner.model
    model.fused = checked = StepChecked(model)
    base = run(engine, fused=True)
    gen = torch.Generator().manual_seed(0)
    adapter = {}
    for module, (k, n) in {"model.layers.0.linear_attn.in_proj_qkv": (128, 256),
                           "model.layers.1.linear_attn.out_proj": (128, 128),
                           "model.layers.3.self_attn.q_proj": (128, 256)}.items():
        adapter[f"base_model.model.{module}.lora_A.weight"] = torch.randn(4, k, generator=gen) * 0.2
        adapter[f"base_model.model.{module}.lora_B.weight"] = torch.randn(n, 4, generator=gen) * 0.2
    engine.update_lora(adapter, 2.0)
    with_lora = run(engine, fused=True)
    gdn = ("conv1d.weight", "A_log", "dt_bias", "in_proj_a.weight", "in_proj_qkv.weight")
    names = [f"model.layers.0.linear_attn.{n}" for n in gdn] + ["model.layers.3.self_attn.q_proj.weight"]
    engine.update_weights({name: engine.get_weights_by_name(name) * 1.5 for name in names})
    updated = run(engine, fused=True)
    assert base != with_lora != updated and checked.steps >= 15
