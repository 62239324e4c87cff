"""EngineConfig(batch_invariant=True): a request's tokens and logprobs are the same bits alone, inside a batch
of 64, with its prefill chunked, after a prefix-cache hit and after preemption, in BF16, FP8 linear and full
FP8 (the C++ kernels; greedy and seeded T = 1)."""

import pytest
import torch

from fp8engine import EngineConfig, SamplingParams
from tests.conftest import make_engine
from tests.prompts import CHATS, QUESTIONS, RAW

MODES = {
    "bf16": dict(),
    "fp8-linear": dict(quantization="fp8"),
    "full-fp8": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_attention=True),
}
TARGETS = [CHATS[0], CHATS[3], RAW[1], RAW[6]]  # chat prompts span two KV blocks: a cache hit is possible
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, logprobs_mode="raw"),
          SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3, logprobs=0),
          SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=4, logprobs=0),
          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)]
FILLERS = [[{"role": "user", "content": f"{q} Answer in {w} words."}] for w in range(4) for q in QUESTIONS]


def results(outs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_request_does_not_depend_on_its_batch(mode):
    options = MODES[mode]
    engine = make_engine(batch_invariant=True, **options)
    alone = [results(engine.generate([p], q))[0] for p, q in zip(TARGETS, PARAMS)]
    assert all(len(tokens) == 12 for tokens, _ in alone)

    filler = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=9)
    outs = engine.generate(TARGETS + FILLERS + RAW[:12], PARAMS + [filler] * 60)
    assert len(outs) == 64 and results(outs[:4]) == alone

    hit = engine.generate(TARGETS, PARAMS)  # every target's prompt is cached by now
    assert min(o.num_cached_tokens for o in hit[:2]) >= 16 and results(hit) == alone

    chunked = make_engine(batch_invariant=True, max_num_batched_tokens=32, **options)
    assert results(chunked.generate(TARGETS, PARAMS)) == alone

    # admitted last, the targets are the ones preempted when the fillers' decodes need blocks
    tight = make_engine(batch_invariant=True, num_kv_blocks=9, **options)
    long_filler = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=9)
    outs = tight.generate(RAW[4:8] + TARGETS, [long_filler] * 4 + PARAMS)[4:]
    assert sum(o.outputs[0].num_preemptions for o in outs) > 0
    assert results(outs) == alone


def test_batch_invariant_needs_bf16_kernels():
    with pytest.raises(ValueError, match="batch_invariant=True needs device 'cpu'.*or 'cuda'.*dtype='bfloat16'; "
                                         "got device='cpu', dtype='float32'"):
        make_engine(batch_invariant=True, dtype="float32")


def test_batch_invariant_refuses_the_torch_fallback(monkeypatch):
    from fp8engine.model_executor import kernel_set
    from tests.conftest import ops_without
    monkeypatch.setattr(kernel_set.cpu_ops, "load_cpu_ops", ops_without("paged_attention"))  # as on a CPU without it
    with pytest.raises(ValueError, match="batch_invariant=True needs the C\\+\\+ CPU kernels or the Triton ones.*attention on 'torch'"):
        make_engine(batch_invariant=True)


def test_fixed_calibration_makes_kv_scales_a_function_of_the_weights():
    """With an FP8 KV cache, recompute mode calibrates on a fixed text, not on the first batch."""
    a = make_engine(batch_invariant=True, kv_cache_dtype="fp8_e4m3", num_kv_blocks=64)
    b = make_engine(batch_invariant=True, kv_cache_dtype="fp8_e4m3", num_kv_blocks=64)
    a.generate([RAW[0]], PARAMS[0])
    b.generate(FILLERS[:5], PARAMS[0])
    assert a.get_stats().kv_scales == b.get_stats().kv_scales
    assert a.runner.attn_layers[0].k_scale != 1.0
    norm = "model.norm.weight"  # a new weight version recalibrates: same weights, same scales
    a.update_weights({norm: a.get_weights_by_name(norm)})
    a.generate([RAW[2]], PARAMS[0])
    assert a.kv_scales.num_calibrations == 2 and a.get_stats().kv_scales == b.get_stats().kv_scales


def test_kernels_take_one_path_for_every_batch_size():
    from fp8engine.model_executor.kernels import bf16_linear_cpu, fp8_linear_cpu
    from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops
    from fp8engine.weights.quant import quantize_weight_blockwise
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(200, 576, generator=gen) * 0.05
    w_q, w_s = quantize_weight_blockwise(w)
    x = torch.randn(40, 576, generator=gen).bfloat16()
    for linear in (lambda x, bi: fp8_linear_cpu.fp8_block_linear_cpu(x, w_q, w_s, batch_invariant=bi),
                   lambda x, bi: bf16_linear_cpu.bf16_linear(x, w.bfloat16(), None, bi)):
        full = linear(x, True)
        assert all(torch.equal(linear(x[i:i + m], True), full[i:i + m]) for m in (1, 3, 4, 8) for i in (0, 9, 32))
    # the default small-batch FP8 path sums in another order: not the same float32 bits (what the flag is for);
    # the AVX2 kernels (CPUs without AVX512-BF16) have one path for every M
    xf = x.float()
    one_path = load_cpu_ops().fp8_linear_isa() == "avx2"
    assert torch.equal(fp8_linear_cpu.fp8_block_linear_cpu(xf[:1], w_q, w_s),
                       fp8_linear_cpu.fp8_block_linear_cpu(xf, w_q, w_s, batch_invariant=True)[:1]) is one_path


@pytest.mark.parametrize("gemm", ["amx", "avx512", "chunked"])
def test_bf16_linear_rows_do_not_depend_on_the_batch(gemm, monkeypatch):
    """Each batch-invariant BF16 GEMM: the C++ kernel's on AMX tiles (the default on AMX machines) or AVX-512
    BF16, and torch's GEMM fed fixed 64-row chunks. A plain torch GEMM is not invariant: its blocking follows M."""
    from fp8engine.model_executor import kernel_set
    from tests.conftest import cpu_flags, require_cpu_op
    if gemm == "amx" and not {"amx_bf16", "amx_tile"} <= cpu_flags():
        pytest.skip("this CPU has no AMX tiles")
    if gemm != "chunked":
        require_cpu_op("bf16_linear")
        monkeypatch.setenv("FP8ENGINE_BF16_GEMM", gemm)
    monkeypatch.setenv("FP8ENGINE_BI_GEMM", "chunked" if gemm == "chunked" else "cpp")
    linear = kernel_set.select(EngineConfig(batch_invariant=True)).dense_linear
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(1536, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(130, 576, generator=gen).bfloat16()
    full = linear(x, w, None)
    torch.testing.assert_close(full.float(), (x.float() @ w.float().T).bfloat16().float(), rtol=2 ** -7, atol=1e-3)
    for row in (0, 63, 64, 129):
        for size in (1, 2, 5, 17, 64, 65, 100):
            others = torch.randn(size - 1, 576, generator=gen).bfloat16()
            got = linear(torch.cat([others, x[row:row + 1]]), w, None)
            assert torch.equal(got[-1], full[row]), (gemm, row, size)


def test_the_backend_name_says_which_gemm_runs(monkeypatch):
    from fp8engine.model_executor import kernel_set
    from fp8engine.model_executor.kernels import bf16_linear_cpu
    from tests.conftest import cpu_flags, require_cpu_op
    require_cpu_op("bf16_linear")

    def linear_name() -> str:
        return kernel_set.select(EngineConfig(batch_invariant=True)).linear_name
    amx = {"amx_bf16", "amx_tile"} <= cpu_flags()
    below_amx = "cpp-bf16-avx512" if "avx512_bf16" in cpu_flags() else "cpp-bf16-avx2"
    monkeypatch.delenv("FP8ENGINE_BF16_GEMM", raising=False)
    for choice, name in (("cpp", "cpp-bf16-amx" if amx else below_amx), ("chunked", "torch-bf16-fixed-chunks")):
        monkeypatch.setenv("FP8ENGINE_BI_GEMM", choice)
        assert (kernel_set.select(EngineConfig(batch_invariant=True)).dense_linear is bf16_linear_cpu.chunked_linear) \
            is (choice == "chunked")
        assert linear_name() == name
    monkeypatch.setenv("FP8ENGINE_BI_GEMM", "cpp")
    monkeypatch.setenv("FP8ENGINE_BF16_GEMM", "avx512")
    assert linear_name() == below_amx
    monkeypatch.delenv("FP8ENGINE_BI_GEMM")
    assert linear_name() == below_amx
    monkeypatch.setenv("FP8ENGINE_BI_GEMM", "tiles")
    with pytest.raises(ValueError, match="FP8ENGINE_BI_GEMM must be one of"):
        linear_name()
