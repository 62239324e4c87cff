"""The C++ kernels this machine can build are the ones that run: a broken csrc/ fails here (and, with
FP8ENGINE_REQUIRE_CPP=1 as `make test` sets, everywhere) instead of passing on the torch fallback."""

import logging

import pytest
import torch

from fp8engine import SamplingParams
from fp8engine.model_executor.kernels import cpu_ops
from tests.conftest import cpu_can_build, cpu_flags, cpu_kernels, make_engine

OPS = ("fp8_block_linear", "fp8_quantize_weight_", "fp8_block_scales_", "bf16_linear", "paged_attention",
       "write_kv_cache", "rms_norm", "rotary_embedding_", "silu_and_mul", "sample_rows")


@pytest.mark.parametrize("op", OPS)
def test_every_op_this_machine_can_build_is_loaded(op):
    if not cpu_can_build(op):
        pytest.skip(f"this machine cannot build {op}")
    assert cpu_ops.cpu_kernel(op) is not None


def _fp8_backend() -> str:
    """The FP8 linear's GEMM the CPU flags call for: AMX tiles, else AVX-512 BF16 dot products, else AVX2 + FMA,
    else scalar."""
    if not {"avx512_bf16", "avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        return "cpp-avx2" if {"avx2", "fma", "f16c"} <= cpu_flags() else "cpp-scalar"
    return "cpp-amx" if {"amx_bf16", "amx_tile"} <= cpu_flags() else "cpp-avx512bf16"


def test_fp8_backend_uses_the_best_dot_products_the_cpu_has(monkeypatch):
    if not cpu_can_build("fp8_block_linear"):
        pytest.skip("no C++ compiler")
    monkeypatch.delenv("FP8ENGINE_FP8_GEMM", raising=False)
    assert cpu_kernels(quantization="fp8").names["fp8_linear"] == _fp8_backend()


def test_engine_stats_name_the_kernels_that_run_and_count_steps_requests_tokens(monkeypatch):
    if not cpu_can_build("paged_attention") or not cpu_can_build("bf16_linear"):
        pytest.skip("this machine cannot build the AVX-512 kernels")
    monkeypatch.delenv("FP8ENGINE_FP8_GEMM", raising=False)
    monkeypatch.delenv("FP8ENGINE_BF16_GEMM", raising=False)
    prompts = [[1000, 1001, 1002, 1003, 1004], [2000, 2001, 2002]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    dense = ("cpp-bf16-gemv+amx+torch" if {"amx_bf16", "amx_tile"} <= cpu_flags() else
             "cpp-bf16-gemv+torch" if "avx512_bf16" in cpu_flags() else "cpp-bf16-avx2")
    for options, linear in ((dict(), dense), (dict(quantization="fp8"), _fp8_backend()),
                            (dict(dtype="float32"), "torch")):
        engine = make_engine(num_kv_blocks=16, **options)
        engine.generate(prompts, params)
        stats = engine.get_stats()
        assert (stats.linear_backend, stats.attention_backend, stats.device) == (linear, "cpp", "cpu"), options
        # one step prefills both prompts and samples their first tokens, then four decode steps
        assert (stats.num_steps_total, stats.num_requests_finished) == (5, 2)
        assert (stats.num_prompt_tokens_total, stats.num_generation_tokens_total) == (8, 10)


def _broken_csrc(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "broken.cpp").write_text("#include <torch/library.h>\nthis is not C++;\n")
    monkeypatch.setattr(cpu_ops, "CSRC_DIR", src)
    monkeypatch.setenv("FP8ENGINE_CACHE", str(tmp_path / "cache"))


def test_a_broken_build_falls_back_with_a_warning_by_default(tmp_path, monkeypatch, caplog):
    if not cpu_can_build("fp8_block_linear"):
        pytest.skip("no C++ compiler")
    _broken_csrc(tmp_path, monkeypatch)
    monkeypatch.delenv("FP8ENGINE_REQUIRE_CPP", raising=False)
    with caplog.at_level(logging.WARNING, logger=cpu_ops.__name__):
        assert cpu_ops.load_cpu_ops.__wrapped__() is None
    assert "C++ CPU kernels unavailable" in caplog.text


def test_a_broken_build_is_an_error_when_the_kernels_are_required(tmp_path, monkeypatch):
    if not cpu_can_build("fp8_block_linear"):
        pytest.skip("no C++ compiler")
    _broken_csrc(tmp_path, monkeypatch)
    monkeypatch.setenv("FP8ENGINE_REQUIRE_CPP", "1")
    with pytest.raises(RuntimeError, match="failed to build and FP8ENGINE_REQUIRE_CPP=1"):
        cpu_ops.load_cpu_ops.__wrapped__()


def test_a_passive_openmp_wait_policy_is_named_when_an_engine_starts(monkeypatch, caplog):
    """OMP_WAIT_POLICY=passive makes every parallel region of a step wake sleeping workers (~3x slower decode
    measured): the engine says so when it runs more than one thread, and stays quiet otherwise."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "Passive")
    assert "OMP_WAIT_POLICY=passive with 2 threads" in cpu_ops.thread_warning(2)
    assert cpu_ops.thread_warning(1) is None
    for value in ("active", ""):
        monkeypatch.setenv("OMP_WAIT_POLICY", value)
        assert cpu_ops.thread_warning(2) is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.WARNING, logger="fp8engine.model_executor.model_runner"):
            make_engine(num_kv_blocks=16)
    finally:
        torch.set_num_threads(threads)
    assert "OMP_WAIT_POLICY=passive with 2 threads" in caplog.text
