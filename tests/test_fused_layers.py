"""The fused decoder-layer kernels of the CUDA path (kernels/fused_triton.py, issue 64 item 1) on the Triton
interpreter: each bit for bit its torch reference (kernels/fused_ref.py), every row's bits the same alone or in a
batch; and in the engine on the stand-in device (tests/fake_cuda.py): an 8B-shaped decode step at <= 12 launches a
layer, its launches' bytes within 1.1x of what the step must read and write, and the fused engine's tokens the
unfused engine's (FP8ENGINE_CUDA_FUSION=0)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the interpreter

import pytest  # noqa: E402
import torch  # noqa: E402

from fp8engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from fp8engine.model_executor.kernels import fused_ref  # noqa: E402
from fp8engine.model_executor.kernels import fused_triton as ft  # noqa: E402
from fp8engine.model_executor.kernels.attention_ref import write_kv_cache_ref  # noqa: E402
from tests.conftest import make_engine  # noqa: E402
from tests.fake_cuda import FakeCuda  # noqa: E402
from tests.tiny_models import save_tiny  # noqa: E402


def _bits(t: torch.Tensor | None):
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) if t.element_size() == 2 else t


def _equal(got, want) -> list[bool]:
    return [(a is None and b is None) or torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want, strict=True)]


def _randn(*shape, seed, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# ------------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("hidden", [576, 256])
@pytest.mark.parametrize("case", ["residual", "first-layer", "partials", "ue8m0", "normed-only"])
def test_norm_quant_is_its_reference_bit_for_bit(hidden, case):
    """576 = 4.5 groups of 128 (the default model: a partial group and a padded row), 256 whole ones."""
    x, r = _randn(13, hidden, seed=1, scale=3.0), _randn(13, hidden, seed=2)
    w = (1 + _randn(hidden, seed=3, scale=0.1).float()).to(torch.bfloat16)
    x[4, 7] = 0.0
    x[5] = 0.0  # a zero row: scale 1e-12 / 448, codes 0
    fmt = "ue8m0" if case == "ue8m0" else None
    quant = case != "normed-only"
    if case == "partials":  # a K-split GEMM's float32 partials, summed in order by the kernel
        x = torch.randn(3, 13, hidden, generator=torch.Generator().manual_seed(4))
    residual = None if case == "first-layer" else r
    got = ft.norm_quant(x, residual, w, 1e-6, quant=quant, normed=True, scale_fmt=fmt)
    want = fused_ref.norm_quant_ref(x, residual, w, 1e-6, quant_out=quant, scale_fmt=fmt)
    assert _equal(got, want) == [True] * 4
    if case == "first-layer":
        assert got[2] is x  # s is x itself, as the unfused norm returns it
    if quant:
        assert got[0].dtype == torch.float8_e4m3fn and got[1].shape == (13, -(-hidden // 128))
    # the unfused path's norm (rsqrt, torch's sum order) is within a bf16 rounding of it
    from fp8engine.model_executor.kernels.layer_ops_ref import rms_norm_ref
    unfused, _ = rms_norm_ref(want[2], None, w, 1e-6)
    assert (unfused.float() - got[3].float()).abs().max() <= 2 ** -7 * unfused.float().abs().max()


@pytest.mark.parametrize("inter", [1536, 200])
@pytest.mark.parametrize("quant", [True, False])
def test_silu_mul_quant_is_its_reference_bit_for_bit(inter, quant):
    """1536: two programs of 1,024 columns, the second half full; 200: one group and a partial one."""
    x = _randn(9, 2 * inter, seed=5, scale=4.0)
    got = ft.silu_mul_quant(x, quant=quant)
    want = fused_ref.silu_mul_ref(x, quant_out=quant)
    assert _equal(got, want) == [True, True]
    h, _ = fused_ref.silu_mul_ref(x, quant_out=False)
    from fp8engine.model_executor.kernels.layer_ops_ref import silu_and_mul_ref
    assert torch.equal(_bits(h), _bits(silu_and_mul_ref(x)))  # the unfused op's bits on this CPU


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-kv", "fp8-kv"])
def test_qkv_epilogue_is_its_reference_bit_for_bit(qk_norm, cache):
    heads, kv_heads, dim, tokens = 6, 2, 64, 5
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, seed=6, scale=2.0)
    cos, sin = _randn(tokens, dim, seed=7), _randn(tokens, dim, seed=8)
    q_norm = (1 + _randn(dim, seed=9, scale=0.1).float()).to(torch.bfloat16) if qk_norm else None
    k_norm = (1 + _randn(dim, seed=10, scale=0.1).float()).to(torch.bfloat16) if qk_norm else None
    k_cache = _randn(4, 16, kv_heads, dim, seed=11).to(cache)
    v_cache = _randn(4, 16, kv_heads, dim, seed=12).to(cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, 17, -1, 40, 63])  # token 2 is not cached
    q = ft.qkv_epilogue(qkv, cos, sin, q_norm, k_norm, 1e-6, k_cache, v_cache, slots, 0.05, 0.07, heads, kv_heads,
                        dim)
    want_q, k, v = fused_ref.qkv_epilogue_ref(qkv, cos, sin, q_norm, k_norm, 1e-6, heads, kv_heads, dim)
    write_kv_cache_ref(k, v, want_k, want_v, slots, 0.05, 0.07)
    assert _equal((q, k_cache, v_cache), (want_q, want_k, want_v)) == [True] * 3
    if not qk_norm:  # the unfused RoPE (layer_ops_ref.rotary_ref on the gathered tables) gives the same bits
        from fp8engine.model_executor.kernels.layer_ops_ref import rotary_ref
        table_c, table_s = torch.cat([cos, cos]), torch.cat([sin, sin])
        q_ref, _ = rotary_ref(qkv[:, :heads * dim].reshape(tokens, heads, dim), k, table_c, table_s,
                              torch.arange(tokens))
        assert torch.equal(_bits(q), _bits(q_ref))


def test_every_fused_kernel_gives_a_row_the_same_bits_alone_and_in_any_batch():
    rows = 11
    x, r = _randn(rows, 576, seed=13, scale=2.0), _randn(rows, 576, seed=14)
    w = (1 + _randn(576, seed=15, scale=0.1).float()).to(torch.bfloat16)
    h = _randn(rows, 400, seed=16, scale=3.0)
    qkv = _randn(rows, 8 * 32, seed=17)
    cos, sin = _randn(rows, 32, seed=18), _randn(rows, 32, seed=19)
    norm_w = (1 + _randn(32, seed=20, scale=0.1).float()).to(torch.bfloat16)

    def run(sl: slice):
        cache = torch.zeros(2, 16, 1, 32, dtype=torch.float8_e4m3fn)
        v_cache = torch.zeros_like(cache)
        slots = torch.arange(rows)[sl]
        q = ft.qkv_epilogue(qkv[sl], cos[sl], sin[sl], norm_w, norm_w, 1e-6, cache, v_cache, slots, 0.1, 0.2, 6, 1,
                            32)
        cached = cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
        return (*ft.norm_quant(x[sl], r[sl], w, 1e-6, normed=True), *ft.silu_mul_quant(h[sl]), q, *cached)

    batch = run(slice(None))
    for sl in (slice(0, 1), slice(4, 5), slice(rows - 1, rows), slice(3, 9)):
        alone = run(sl)
        assert _equal(alone, [t[sl] for t in batch]) == [True] * len(batch), sl


# ------------------------------------------------------------------------------------------------ engine
def _decode_step_counts(model: str, options: dict) -> dict:
    """One batch-1 decode step of `model` on the stand-in device, its kernels stubbed: launches (Triton and torch
    kernels, views and allocations apart), their bytes with the KV caches left out, and the floor: every parameter
    once (the embedding's one row), the KV the step attends over, the logits."""
    with FakeCuda(stub_kernels=True) as dev:
        engine = LLMEngine(EngineConfig(model=model, device="cuda", num_kv_blocks=16, max_num_seqs=1,
                                        enforce_eager=True, **options))
        engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        engine.step()  # the prefill
        runner = engine.runner
        attention = runner.model.attention_layers()
        for layer in attention:
            dev.paged |= {layer.k_cache.untyped_storage()._cdata, layer.v_cache.untyped_storage()._cdata}
        before = (dev.torch_kernels, sum(dev.launches.values()), dev.bytes_moved, set(dev.launches))
        engine.step()
        layers = len(runner.model.model.layers)
        launches = dev.torch_kernels - before[0] + sum(dev.launches.values()) - before[1]
        embed = runner.model.model.embed_tokens.weight
        params = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        context = 5  # the prompt's 4 tokens and the one decoded
        kv = sum(2 * context * a.num_kv_heads * a.head_dim * a.k_cache.element_size() for a in attention)
        logits = runner.model.lm_head.weight.shape[0] * 4
        floor = params - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size() + kv + logits
        # the step reads exactly the context's KV through its block table: the bytes counted plus that
        return {"per_layer": launches / layers, "bytes": dev.bytes_moved - before[2] + kv, "floor": floor,
                "kernels": set(dev.launches)}


@pytest.fixture(scope="module")
def llama_8b_shape(tmp_path_factory):
    from benchmarks.host_side import _model_dir
    return _model_dir(str(tmp_path_factory.mktemp("llama_8b_shape")))


@pytest.mark.parametrize("mode", ["fp8", "bf16"])
def test_an_8b_shaped_decode_step_launches_at_most_12_kernels_a_layer_and_moves_its_floor(llama_8b_shape, mode,
                                                                                          monkeypatch):
    """32 layers of Llama-3-8B's structure (benchmarks/host_side.py's model): fused, <= 12 launches a layer (FP8:
    2 norms, 4 GEMMs, the qkv epilogue, attention quantizing o_proj's input itself and its zero-filled output,
    silu * mul) and the bytes of every launch's tensors within 1.1x of the floor; unfused (FP8ENGINE_CUDA_FUSION=0)
    ~44 a layer, what the fused kernels save."""
    options = dict(quantization="fp8") if mode == "fp8" else {}
    fused = _decode_step_counts(llama_8b_shape, options)
    assert fused["per_layer"] <= 12, fused
    if mode == "fp8":  # no activation-quant launch of its own left in the step
        assert "_group_quant_kernel" not in fused["kernels"] and fused["per_layer"] < 11, fused
    assert {"_norm_quant_kernel", "_qkv_epilogue_kernel", "_silu_mul_quant_kernel"} <= fused["kernels"]
    assert fused["bytes"] <= 1.1 * fused["floor"], fused
    monkeypatch.setenv("FP8ENGINE_CUDA_FUSION", "0")
    unfused = _decode_step_counts(llama_8b_shape, options)
    assert unfused["per_layer"] >= 3 * fused["per_layer"] and "_norm_quant_kernel" not in unfused["kernels"]


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory, tokenizer):
    """Qwen3 with q/k norms: the qwen3_moe-sparse config cut to its first two layers, whose MLPs are dense."""
    return save_tiny("qwen3_moe-sparse", tmp_path_factory.mktemp("fused_qwen3"), tokenizer, vocab_size=1024,
                     num_hidden_layers=2)


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory, tokenizer):
    return save_tiny("llama-llama3", tmp_path_factory.mktemp("fused_llama"), tokenizer, vocab_size=1024)


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(300, 318))]


@pytest.mark.parametrize("arch,options", [("llama", dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")),
                                          ("qwen3", dict(quantization="fp8"))], ids=["llama-fp8-kv", "qwen3-fp8"])
def test_the_fused_engine_generates_the_unfused_engines_tokens(arch, options, llama_model, qwen3_model,
                                                               monkeypatch):
    """Greedy tokens equal and logprobs within a few bf16 roundings of the unfused engine (they differ in the
    norms' sum order and rsqrt only); generation and scoring launch the fused kernels (with batch invariance,
    scoring on them gives the rollout's bits: test_device_path's scoring test)."""
    model = llama_model if arch == "llama" else qwen3_model
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0, logprobs_mode="raw")

    def run(score: bool):
        with FakeCuda() as dev:
            engine = make_engine(model, device="cuda", num_kv_blocks=32, **options)
            outs = engine.generate(PROMPTS, params)
            generated = set(dev.launches)
            dev.launches.clear()
            if score:
                engine.score(PROMPTS[:1], [outs[0].outputs[0].token_ids], params)
            return outs, generated, set(dev.launches)

    outs, generated, scoring = run(score=True)
    fused = {"_norm_quant_kernel", "_qkv_epilogue_kernel", "_silu_mul_quant_kernel"}
    assert fused <= generated and fused <= scoring
    monkeypatch.setenv("FP8ENGINE_CUDA_FUSION", "0")
    ref, unfused_kernels, _ = run(score=False)
    assert not fused & unfused_kernels
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    got = torch.tensor([o.outputs[0].logprobs for o in outs])
    want = torch.tensor([o.outputs[0].logprobs for o in ref])
    assert (got - want).abs().max() <= 0.05, (got, want)


def test_pdl_stays_off_on_the_interpreter_and_unless_asked(llama_model, monkeypatch):
    """Programmatic dependent launch (kernels/pdl.py): FP8ENGINE_PDL=1 on the stand-in device leaves it off (the
    interpreter has no griddepcontrol), and so launches as before; forced on, a launch asks for it
    (test_triton_compile checks the code that runs then)."""
    from fp8engine.model_executor.kernels import pdl
    monkeypatch.setenv("FP8ENGINE_PDL", "1")
    with FakeCuda():
        engine = make_engine(llama_model, device="cuda", num_kv_blocks=32, quantization="fp8")
        assert engine.get_stats().kernels["pdl"] == "off" and pdl.launch_options() == {}
        assert len(engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2))) == 2
    with pdl.forced(True):
        assert pdl.launch_options() == {"PDL": True, "launch_pdl": True}
    assert pdl.launch_options() == {}


def test_swapped_operands_run_the_fp8_engine_and_hand_their_partials_to_the_fused_norm(tmp_path, tokenizer,
                                                                                         monkeypatch):
    """FP8ENGINE_SWAP_AB_GEMM (forced on after start-up: the interpreter never turns it on): every FP8 GEMM of up to
    16 rows takes the swapped kernel, o_proj (8 heads x 64 = 512 inputs, one 64-row tile) split in 2 with its
    partials going to the fused norm, and the engine's greedy tokens and logprobs are the default launch's (within
    float32 reassociation)."""
    from fp8engine.model_executor.kernels import fp8_triton, pdl
    model = save_tiny("llama-llama3", tmp_path, tokenizer, vocab_size=1024, hidden_size=64, intermediate_size=128,
                      num_attention_heads=8, num_key_value_heads=1, head_dim=64)
    splits, kernel = [], fp8_triton._w8a8_block_matmul_swap_kernel

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                splits.append(kwargs["SPLIT_K"])
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(fp8_triton, "_w8a8_block_matmul_swap_kernel", Counted())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    with FakeCuda():
        engine = make_engine(model, device="cuda", num_kv_blocks=16, quantization="fp8", enforce_eager=True)
        want = engine.generate([[5, 6, 7], [8, 9, 10, 11]], params)
        assert splits == [] and engine.get_stats().kernels["swap_ab_gemm"] == "off"
        with pdl.SWAP_AB_GEMM.forced(True):
            got = engine.generate([[5, 6, 7], [8, 9, 10, 11]], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs,
                                                                      strict=True)) < 1e-3
    assert set(splits) == {1, 2}  # o_proj split, the other projections not


def test_a_row_parallel_fp8_projection_sums_over_the_ranks_on_the_fused_path_too(llama_model):
    """Tensor parallelism on CUDA runs the fused layers: a row-parallel FP8 projection's forward_quantized (o_proj,
    down_proj there) hands its rows to the group's reduce — whole sums, never K-split partials, even where its caller
    takes partials — and adds its bias after, as Linear.forward does."""
    from fp8engine.weights import quant
    with FakeCuda():
        engine = make_engine(llama_model, device="cuda", num_kv_blocks=16, quantization="fp8", enforce_eager=True)
        o = engine.runner.model.model.layers[0].self_attn.o_proj
        x_q, x_s = quant.quantize_activation_groups(_randn(3, o.weight.shape[1], seed=31).to("cuda"))
        alone = o.forward_quantized(x_q, x_s, torch.bfloat16, partials=True)
        seen = []
        o.reduce = lambda y: seen.append(tuple(y.shape)) or y * 2  # a stand-in group of "two equal ranks"
        o.bias = torch.ones(o.weight.shape[0], dtype=torch.bfloat16, device="cuda")
        try:
            summed = o.forward_quantized(x_q, x_s, torch.bfloat16, partials=True)
        finally:
            o.reduce, o.bias = None, None
    assert seen == [(3, o.weight.shape[0])]
    assert torch.equal(summed, alone * 2 + 1)


def test_a_k_split_down_proj_hands_its_partials_to_the_next_fused_norm(tmp_path, tokenizer, monkeypatch):
    """intermediate 8192: down_proj splits K in 4 at decode sizes (fp8_triton.gemm_config), and the next fused norm
    (here the final one) adds the float32 partials in order instead of a torch sum and a copy after the GEMM."""
    from fp8engine.model_executor.kernels import fp8_triton
    from fp8engine.weights import quant
    x = _randn(3, 8192, seed=21)
    w_q, w_s = quant.quantize_weight_blockwise(_randn(64, 8192, seed=22, scale=0.05))
    x_q, x_s = quant.quantize_activation_groups(x)
    parts = fp8_triton.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16, partials=True)
    summed = fp8_triton.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16)
    assert parts.shape == (4, 3, 64) and parts.dtype == torch.float32
    r, w = _randn(3, 64, seed=23), (1 + _randn(64, seed=24, scale=0.1).float()).to(torch.bfloat16)
    got = ft.norm_quant(parts, r, w, 1e-6, quant=False, normed=True)
    from fp8engine.model_executor.models.llama import summed_partials
    assert _equal(got, fused_ref.norm_quant_ref(summed_partials(parts, torch.bfloat16), r, w, 1e-6,
                                                quant_out=False)) == [True] * 4
    assert (summed_partials(parts, torch.bfloat16).float() - summed.float()).abs().max() <= \
        2 ** -8 * summed.float().abs().max()  # torch's sum of the 4 partials: another order, a rounding apart
    model = save_tiny("llama-llama3", tmp_path, tokenizer, vocab_size=1024, hidden_size=64, intermediate_size=8192,
                      num_attention_heads=2, num_key_value_heads=1)

    def decode_ops():
        with FakeCuda(stub_kernels=True) as dev:
            engine = make_engine(model, device="cuda", num_kv_blocks=16, quantization="fp8", enforce_eager=True)
            engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
            engine.step()
            before = dict(dev.torch_kernel_names)
            engine.step()
            return {k: v - before.get(k, 0) for k, v in dev.torch_kernel_names.items() if v != before.get(k, 0)}

    assert "sum" not in decode_ops()
    monkeypatch.setenv("FP8ENGINE_CUDA_FUSION", "0")
    assert decode_ops()["sum"] == 2  # one per layer's down_proj
