"""The C++ CPU FP8 kernels (csrc/fp8_linear.cpp) against the torch reference in fp8engine.weights.quant.

The linear's GEMM runs on AVX-512 BF16 dot products, or on AMX tiles where the CPU has them; tests that
take the `gemm` fixture run on each one this machine has (the op's `gemm` argument picks it, as the engine's
kernel set does once at start-up)."""

import functools
import zlib

import pytest
import torch

from fp8engine import EngineConfig
from fp8engine.model_executor import kernel_set
from fp8engine.model_executor.kernels import fp8_linear_cpu
from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops
from fp8engine.weights import layout, quant
from tests.conftest import cpu_flags, require_cpu_op

E4M3 = torch.float8_e4m3fn
AMX = {"amx_bf16", "amx_tile"} <= cpu_flags()


@pytest.fixture(scope="module")
def ops():
    require_cpu_op("fp8_block_linear")
    return load_cpu_ops()


@pytest.fixture(params=["avx512", "amx"])
def gemm(request):
    if request.param == "amx" and not AMX:
        pytest.skip("this CPU has no AMX tiles")
    return request.param


def _quantize_with_kernel(ops, w: torch.Tensor, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    q = torch.empty(n, k, dtype=E4M3)
    s = torch.empty(quant.cdiv(n, 128), quant.cdiv(k, 128))
    ops.fp8_quantize_weight_(w, q, s, scale_fmt == "ue8m0")
    return q, s


def _assert_same_quant(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]):
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(got[1].view(torch.int32), expected[1].view(torch.int32))


def _fp8_backend() -> str:
    return kernel_set.select(EngineConfig(quantization="fp8")).names["fp8_linear"]


def test_backend_name_follows_the_gemm(ops, monkeypatch):
    monkeypatch.delenv("FP8ENGINE_FP8_GEMM", raising=False)
    assert _fp8_backend() in (("cpp-amx",) if AMX else ("cpp-avx512bf16", "cpp-avx2", "cpp-scalar"))
    monkeypatch.setenv("FP8ENGINE_FP8_GEMM", "avx512")
    assert _fp8_backend() in ("cpp-avx512bf16", "cpp-avx2", "cpp-scalar")
    monkeypatch.setenv("FP8ENGINE_FP8_GEMM", "tiles")
    with pytest.raises(ValueError, match=r"FP8ENGINE_FP8_GEMM must be one of \('auto', 'avx512', 'amx'\), got 'tiles'"):
        _fp8_backend()
    with pytest.raises(RuntimeError, match="gemm must be 'auto', 'avx512', 'amx', 'avx512-gemv', 'avx512-nt' or "
                                           "'avx512-gemm', got 'tiles'"):
        ops.fp8_block_linear(torch.ones(1, 128), *quant.quantize_weight_blockwise(torch.ones(1, 128)), None, False,
                             gemm="tiles")
    monkeypatch.setenv("FP8ENGINE_FP8_GEMM", "amx")
    if AMX:
        assert _fp8_backend() == "cpp-amx"
    else:
        with pytest.raises(ValueError, match="does not allow AMX tiles"):
            _fp8_backend()
        with pytest.raises(RuntimeError, match="does not allow AMX tiles"):
            ops.fp8_block_linear(torch.ones(1, 128), *quant.quantize_weight_blockwise(torch.ones(1, 128)), None,
                                 False, gemm="amx")


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (192, 576), (576, 1536), (1, 5), (257, 129)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_weight_quantization_bit_exact(ops, shape, dtype, scale_fmt):
    torch.manual_seed(zlib.crc32(repr((shape, dtype, scale_fmt)).encode()))  # hash() of a str differs per process
    w = (torch.randn(shape) * torch.logspace(-4, 2, shape[1])).to(dtype)
    expected = quant.quantize_weight_blockwise(w, scale_fmt=scale_fmt)
    _assert_same_quant(_quantize_with_kernel(ops, w, scale_fmt), expected)


def test_weight_quantization_rounding_edges(ops):
    # Every block holds 448, so its scale is 1 and the kernel's E4M3 rounding is compared value by value:
    # all E4M3 magnitudes, the midpoints between neighbours (ties) and one float32 ulp either side.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()
    mids = (grid[1:] + grid[:-1]) / 2
    edges = torch.cat([grid, mids, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 512.0)),
                       torch.tensor([448.0, 460.0, 1e4, 2.0 ** -10, 1e-30, 0.0])])
    values = torch.cat([edges, -edges, (torch.rand(16384 - 2 * edges.numel()) - 0.5) * 900])
    w = values.reshape(128, 128).repeat(1, 3)
    w[0, ::128] = 448.0
    _assert_same_quant(_quantize_with_kernel(ops, w, None), quant.quantize_weight_blockwise(w))
    wb = w.bfloat16()  # bf16 has its own load and amax path; E4M3 values and midpoints are exact in it
    _assert_same_quant(_quantize_with_kernel(ops, wb, None), quant.quantize_weight_blockwise(wb))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_block_scales_then_codes_equal_one_pass(ops, dtype, scale_fmt):
    # Weight updates compute the scales while validating and quantize with them at commit.
    torch.manual_seed(3)
    w = (torch.randn(300, 700) * torch.logspace(-3, 1, 700)).to(dtype)
    expected = quant.quantize_weight_blockwise(w, scale_fmt=scale_fmt)
    scales, finite = fp8_linear_cpu.block_scales_cpu(w, scale_fmt)
    assert finite and torch.equal(scales.view(torch.int32), expected[1].view(torch.int32))
    out_q, out_s = torch.empty(300, 700, dtype=E4M3), torch.full((3, 6), -1.0)
    fp8_linear_cpu.quantize_weight_into_cpu(w, out_q, out_s, scale_fmt=scale_fmt, scales=scales)
    _assert_same_quant((out_q, out_s), expected)
    w[299, 699] = float("nan")
    assert fp8_linear_cpu.block_scales_cpu(w, scale_fmt)[1] is False
    assert fp8_linear_cpu.block_scales_cpu(w.t(), scale_fmt) is None  # not unit-stride rows: caller validates


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_quantization_non_finite_blocks(ops, dtype):
    # A NaN makes its block's scale NaN and every code of the block NaN (0x7F); an Inf makes the scale
    # Inf, the finite values of its block 0 and the Inf itself NaN, exactly as in the reference.
    w = torch.randn(256, 300).to(dtype)
    w[5, 7] = float("nan")
    w[130, 260] = float("inf")
    w[200, 131] = -float("inf")
    q, s = _quantize_with_kernel(ops, w, None)
    _assert_same_quant((q, s), quant.quantize_weight_blockwise(w))
    assert s[0, 0].isnan() and s[1, 2].isinf() and s[1, 1].isinf() and s[0, 1].isfinite()


def test_weight_quantization_strided_source(ops):
    base = torch.randn(200, 640, dtype=torch.bfloat16)
    w = base[:, 20:620]  # rows 640 apart
    _assert_same_quant(_quantize_with_kernel(ops, w, None), quant.quantize_weight_blockwise(w))


def test_quantize_weight_into_cpu_wrapper(ops):
    w = torch.randn(192, 576)
    out_q = torch.empty(192, 576, dtype=E4M3)
    out_s = torch.empty(2, 5)
    ptrs = out_q.data_ptr(), out_s.data_ptr()
    fp8_linear_cpu.quantize_weight_into_cpu(w, out_q, out_s, scale_fmt="ue8m0")
    assert (out_q.data_ptr(), out_s.data_ptr()) == ptrs
    _assert_same_quant((out_q, out_s), quant.quantize_weight_blockwise(w, scale_fmt="ue8m0"))
    # Non-contiguous destinations (a column slice) go through a temporary.
    q_big, s_big = torch.zeros(192, 1152, dtype=E4M3), torch.zeros(2, 10)
    fp8_linear_cpu.quantize_weight_into_cpu(w, q_big[:, :576], s_big[:, :5])
    _assert_same_quant((q_big[:, :576], s_big[:, :5]), quant.quantize_weight_blockwise(w))
    assert not q_big[:, 576:].float().any()
    with pytest.raises(ValueError, match="scale_fmt"):
        fp8_linear_cpu.quantize_weight_into_cpu(w, out_q, out_s, scale_fmt="e8m0")


def _assert_linear_close(y: torch.Tensor, ref: torch.Tensor):
    assert y.dtype == ref.dtype and y.shape == ref.shape
    scale = ref.float().abs().max().item()
    err = (y.float() - ref.float()).abs()
    if ref.dtype == torch.float32:
        assert err.max().item() <= 1e-5 * scale + 1e-30
    else:  # one bf16 ulp: the float32 results may straddle a rounding boundary
        ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp(min=1e-30))) - 7)
        assert torch.all(err <= ulp + 1e-6 * scale)


@functools.cache
def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(n * 31 + k)
    return quant.quantize_weight_blockwise(torch.randn(n, k) * torch.rand(n, 1))


def _check_linear(ops, gemm: str, m: int, k: int, n: int, dtype: torch.dtype, scale_fmt: str | None,
                  batch_invariant: bool = False):
    w_q, w_s = _weights(n, k)
    torch.manual_seed(m * 7919 + k * 31 + n)
    x = (torch.randn(m, k) * torch.logspace(-2, 1, k)).to(dtype)
    bias = torch.randn(n).to(dtype)
    y = ops.fp8_block_linear(x, w_q, w_s, bias, scale_fmt == "ue8m0", None, batch_invariant, gemm)
    _assert_linear_close(y, quant.fp8_block_linear_ref(x, w_q, w_s, bias, scale_fmt=scale_fmt))


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k", [100, 576, 1536])
@pytest.mark.parametrize("n", [192, 576, 1536])
def test_block_linear_matches_reference(ops, gemm, m, k, n):
    _check_linear(ops, gemm, m, k, n, torch.float32, None)
    _check_linear(ops, gemm, m, k, n, torch.bfloat16, "ue8m0")


@pytest.mark.parametrize("k, n, dtype, scale_fmt", [(100, 1536, torch.bfloat16, None),
                                                    (576, 576, torch.float32, "ue8m0"),
                                                    (1536, 192, torch.bfloat16, "ue8m0"),
                                                    (576, 1536, torch.float32, None)])
def test_block_linear_matches_reference_m128(ops, gemm, k, n, dtype, scale_fmt):
    _check_linear(ops, gemm, 128, k, n, dtype, scale_fmt)


@pytest.mark.parametrize("m", [1, 2, 3, 16, 33, 64, 100, 300, 1000])
@pytest.mark.parametrize("k, n", [(576, 1536), (1536, 576), (100, 192), (576, 200)])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_gemm_matches_reference_for_every_m(ops, gemm, m, k, n, batch_invariant):
    """Each GEMM (batch_invariant: for every M; else from the small-M path's limit up) on K tails (576, 100),
    N off the 128 grid and odd numbers of 16-row activation vectors."""
    _check_linear(ops, gemm, m, k, n, torch.bfloat16, None, batch_invariant)
    _check_linear(ops, gemm, m, k, n, torch.float32, "ue8m0", batch_invariant)


@pytest.mark.parametrize("m", [2, 20])
def test_activation_rounding_through_identity_weight(ops, gemm, m):
    # W = I makes y[:, j] = x_q[:, j] * sx * sw, so every activation code shows in the output. Each group
    # holds +-448 (scale 1) and otherwise midpoints between E4M3 neighbours: round-half-even decides all.
    k = 300
    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()
    mids = (grid[1:] + grid[:-1]) / 2
    x = mids[torch.randint(len(mids), (m, k))] * (torch.randint(0, 2, (m, k)) * 2 - 1)
    x[:, ::128] = 448.0
    w_q, w_s = quant.quantize_weight_blockwise(torch.eye(k))
    y = ops.fp8_block_linear(x, w_q, w_s, None, False, gemm=gemm)
    ref = quant.fp8_block_linear_ref(x, w_q, w_s)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_block_linear_partial_and_tiny_shapes(ops, gemm, batch_invariant):
    torch.manual_seed(5)
    for m, n, k in [(5, 7, 33), (9, 1, 129), (16, 130, 64), (33, 49, 257), (1, 1, 1)]:
        w_q, w_s = quant.quantize_weight_blockwise(torch.randn(n, k))
        x = torch.randn(m, k, dtype=torch.bfloat16)
        _assert_linear_close(ops.fp8_block_linear(x, w_q, w_s, None, False, None, batch_invariant, gemm),
                             quant.fp8_block_linear_ref(x, w_q, w_s))


@pytest.mark.parametrize("threads", [2, 4])
def test_block_linear_split_over_rows(ops, gemm, threads):
    # The weight tiles (3 of 48 rows on AVX-512, 5 of 32 on AMX) do not divide evenly over the threads, so
    # the kernel also splits M (40 rows = 3 vectors of 16) into chunks of unequal size.
    torch.manual_seed(7)
    w_q, w_s = quant.quantize_weight_blockwise(torch.randn(130, 300))
    x = torch.randn(40, 300, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = ops.fp8_block_linear(x, w_q, w_s, None, False, gemm=gemm)
    finally:
        torch.set_num_threads(before)
    _assert_linear_close(y, quant.fp8_block_linear_ref(x, w_q, w_s))


def test_block_linear_zero_rows_and_zero_input(ops, gemm):
    w_q, w_s = quant.quantize_weight_blockwise(torch.randn(64, 256))
    assert ops.fp8_block_linear(torch.empty(0, 256), w_q, w_s, None, False, gemm=gemm).shape == (0, 64)
    bias = torch.randn(64)
    y = ops.fp8_block_linear(torch.zeros(3, 256), w_q, w_s, bias, False, gemm=gemm)
    assert torch.equal(y, bias.expand(3, 64))


def test_wrapper_batch_dims_and_noncontiguous_input(ops):
    torch.manual_seed(6)
    w_q, w_s = quant.quantize_weight_blockwise(torch.randn(192, 576))
    x = torch.randn(2, 576, 9, dtype=torch.bfloat16).transpose(1, 2)  # [2, 9, 576], not contiguous
    y = fp8_linear_cpu.fp8_block_linear_cpu(x, w_q, w_s)
    assert y.shape == (2, 9, 192)
    _assert_linear_close(y, quant.fp8_block_linear_ref(x, w_q, w_s))
    x16 = x.to(torch.float16)
    bias = torch.randn(192, dtype=torch.float16)
    y16 = fp8_linear_cpu.fp8_block_linear_cpu(x16, w_q, w_s, bias, scale_fmt="ue8m0")
    ref16 = quant.fp8_block_linear_ref(x16, w_q, w_s, bias, scale_fmt="ue8m0")
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16, ref16, rtol=2.0 ** -10, atol=1e-3)


def test_without_the_kernels_the_kernel_set_runs_the_reference(monkeypatch):
    """Without the C++ ops the kernel set's FP8 entry points are the torch reference (spied on: an exact-equality
    check alone would also pass on the kernel, which equals the reference on these inputs)."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(130, 200, generator=gen)
    w_q, w_s = quant.quantize_weight_blockwise(w)
    x = torch.randn(4, 200, generator=gen).bfloat16()
    want = quant.fp8_block_linear_ref(x, w_q, w_s)
    monkeypatch.setattr(kernel_set.cpu_ops, "load_cpu_ops", lambda: None)
    calls = []
    for name in ("fp8_block_linear_ref", "quantize_weight_into"):
        real = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    kernels = kernel_set.select(EngineConfig(quantization="fp8"))
    assert kernels.names["fp8_linear"] == "torch-reference"
    assert kernels.block_scales is None
    assert torch.equal(kernels.fp8_linear(x, w_q, w_s), want)
    out_q, out_s = torch.empty_like(w_q), torch.empty_like(w_s)
    kernels.quantize_into(w, out_q, out_s)
    _assert_same_quant((out_q, out_s), (w_q, w_s))
    assert calls == ["fp8_block_linear_ref", "quantize_weight_into"]


@pytest.mark.parametrize("m", [1, 3, 37, 300])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_scale_rows_serve_stacked_shard_grids_in_one_call(ops, gemm, m, batch_invariant):
    """q/k/v shards of 576/192/192 rows keep their own scale grids; one call with scale_rows equals
    one call per shard, bit for bit, in the kernel and in the reference."""
    gen = torch.Generator().manual_seed(m)
    shards = [torch.randn(n, 576, generator=gen) * (1 + i) for i, n in enumerate((576, 192, 192))]
    quantized = [quant.quantize_weight_blockwise(w) for w in shards]
    w_q = torch.cat([q for q, _ in quantized])
    w_s = torch.cat([s for _, s in quantized])
    rows = torch.cat([torch.arange(n, dtype=torch.int32) // 128 + off
                      for n, off in zip((576, 192, 192), (0, 5, 7))])
    x = torch.randn(m, 576, generator=gen).bfloat16()
    linear = functools.partial(fp8_linear_cpu.fp8_block_linear_cpu, batch_invariant=batch_invariant, gemm=gemm)
    want = torch.cat([linear(x, q, s) for q, s in quantized], dim=-1)
    assert torch.equal(linear(x, w_q, w_s, scale_rows=rows), want)
    _assert_linear_close(want, quant.fp8_block_linear_ref(x, w_q, w_s, scale_rows=rows))
    assert torch.equal(quant.fp8_block_linear_ref(x, w_q, w_s, scale_rows=rows),
                       torch.cat([quant.fp8_block_linear_ref(x, q, s) for q, s in quantized], dim=-1))
    with pytest.raises(RuntimeError, match="scale_rows must index rows"):
        fp8_linear_cpu.fp8_block_linear_cpu(x, w_q, w_s, scale_rows=rows + 2, gemm=gemm)


@pytest.mark.parametrize("k, n", [(576, 1536), (1536, 576), (100, 130)])
def test_batch_invariant_rows_do_not_depend_on_the_batch(ops, gemm, k, n):
    """With batch_invariant a row's output is the same bits alone and anywhere in batches of any size (its
    16-row activation vector padded or shared, one or two vectors per tile group, split over threads or
    not, in one chunk of rows or several sized for L2 — 1000 rows are 2 chunks at K=576, 3 at K=1536), with bias
    and stacked scale rows."""
    gen = torch.Generator().manual_seed(k + n)
    w_q, w_s = quant.quantize_weight_blockwise(torch.randn(n, k, generator=gen))
    rows = (torch.arange(n, dtype=torch.int32) // 128).flip(0).contiguous()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(70, k, generator=gen).bfloat16()

    def linear(batch: torch.Tensor) -> torch.Tensor:
        return ops.fp8_block_linear(batch, w_q, w_s, bias, False, rows, True, gemm)
    full = linear(x)
    _assert_linear_close(full, quant.fp8_block_linear_ref(x, w_q, w_s, bias, scale_rows=rows))
    for row in (0, 17, 69):
        alone = linear(x[row:row + 1])
        assert torch.equal(alone[0], full[row]), row
        for size, at in ((2, 1), (5, 3), (16, 15), (17, 16), (33, 0), (64, 40), (300, 299), (1000, 950)):
            batch = torch.randn(size, k, generator=gen).bfloat16()
            batch[at] = x[row]
            assert torch.equal(linear(batch)[at], alone[0]), (row, size, at)


AVX512_KERNELS = ("avx512-gemv", "avx512-nt", "avx512-gemm")


@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (130, 33), (64, 200), (512, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nt_kernel_gives_the_gemms_bits_at_every_m(ops, k, n, dtype):
    """The small-M kernel with weight rows in the lanes (nt) sums every output as the AVX-512 GEMM does (one chain
    per K block over the same pairs, the same scaling, the bias last): forced at the same M they give the same
    bits, from 1 row to past a 16-row vector and a register tile of 8, with ragged N and K (ragged N over whole K
    blocks too: rows past N convert from zero codes), bias and stacked scale rows; the gemv (K in the lanes) stays
    within the reference's bounds."""
    gen = torch.Generator().manual_seed(k * 7 + n)
    w_q, w_s = quant.quantize_weight_blockwise(torch.randn(n, k, generator=gen))
    rows = (torch.arange(n, dtype=torch.int32) // 128).flip(0).contiguous()
    bias = torch.randn(n, generator=gen).to(dtype)
    for m in (1, 2, 5, 8, 9, 16, 17, 31, 64, 70):
        x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)).to(dtype)
        for b, r in ((None, None), (bias, rows)):
            out = {kernel: ops.fp8_block_linear(x, w_q, w_s, b, False, r, False, kernel) for kernel in AVX512_KERNELS}
            assert torch.equal(out["avx512-nt"], out["avx512-gemm"]), (m, b is None)
            ref = quant.fp8_block_linear_ref(x, w_q, w_s, b, scale_rows=r)
            _assert_linear_close(out["avx512-gemv"], ref)
            _assert_linear_close(out["avx512-nt"], ref)


def test_batch_invariant_rows_are_the_same_bits_on_either_side_of_the_kernel_switch(ops):
    """batch_invariant takes the nt kernel up to 64 rows and the GEMM above (without AMX): a row's bits are the
    same in a batch of 1, 7, 64 or 129 rows; a plain call takes the gemv at 1 row, whose sums run in another
    order."""
    if AMX:
        pytest.skip("with AMX tiles batch_invariant runs the tiles for every M")
    gen = torch.Generator().manual_seed(3)
    w_q, w_s = quant.quantize_weight_blockwise(torch.randn(960, 576, generator=gen))
    x = torch.randn(129, 576, generator=gen).bfloat16()
    full = ops.fp8_block_linear(x, w_q, w_s, None, False, None, True, "avx512")
    assert torch.equal(full, ops.fp8_block_linear(x, w_q, w_s, None, False, None, False, "avx512-gemm"))
    for size in (1, 6, 7, 64):
        assert torch.equal(ops.fp8_block_linear(x[:size].contiguous(), w_q, w_s, None, False, None, True, "avx512"),
                           full[:size]), size
    alone = ops.fp8_block_linear(x[:1].contiguous(), w_q, w_s, None, False, None, False, "avx512")
    assert torch.equal(alone, ops.fp8_block_linear(x[:1].contiguous(), w_q, w_s, None, False, None, False,
                                                   "avx512-gemv"))


def test_subnormal_weight_codes_survive_flush_denormal(ops, gemm):
    """A block whose small weights quantize to E4M3 subnormals (codes 0x01-0x07) gives the reference's result
    with torch.set_flush_denormal(True) too (MXCSR's denormals-are-zero: the AVX2 kernels read subnormal codes as
    float32 subnormals, so they turn that flag off for their threads while they run)."""
    w = torch.full((64, 256), 1e-5)
    w[:, 0] = w[:, 128] = 1.0  # scale 1/448: 1e-5 * 448 = 0.00448, an E4M3 subnormal (below 2^-6)
    w_q, w_s = quant.quantize_weight_blockwise(w)
    codes = w_q.view(torch.uint8)[:, 1:128]
    assert ((codes > 0) & (codes < 8)).all()
    xs = [torch.ones(m, 256) for m in (1, 2, 5)]  # the in-register path at 1 and 2 rows, the panel path at 5
    expected = [quant.fp8_block_linear_ref(x, w_q, w_s) for x in xs]
    assert [torch.equal(ops.fp8_block_linear(x, w_q, w_s, None, False, None, True, gemm), e)
            for x, e in zip(xs, expected)] == [True] * 3
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        assert [torch.equal(ops.fp8_block_linear(x, w_q, w_s, None, False, None, True, gemm), e)
                for x, e in zip(xs, expected)] == [True] * 3
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("k, n", [(576, 960), (576, 40), (132, 64), (1536, 48), (130, 33), (64, 200)])
def test_nt16_weights_give_the_bits_of_rows_at_every_m(ops, k, n):
    """A weight stored in the nt16 layout (weights/layout.py: whole groups of 16 rows interleaved, rows past
    them and a K that is not a multiple of 4 as rows) gives bit for bit the batch-invariant result of the same
    weight as rows, through nt and the GEMM, at 1 row to past the switch between them, with ragged N and K
    (K = 132 ends a block mid 64-k chunk), bias and stacked scale rows; a plain call takes nt too (the gemv reads
    rows), and forcing the gemv on it is an error."""
    if fp8_linear_cpu_isa(ops) != "avx512bf16":
        pytest.skip("the nt16 layout is read by the AVX-512 BF16 kernels")
    gen = torch.Generator().manual_seed(k * 3 + n)
    w_q, w_s = quant.quantize_weight_blockwise(torch.randn(n, k, generator=gen))
    grouped = layout.to_nt16_(w_q.clone())
    assert torch.equal(grouped[n // 16 * 16:].view(torch.uint8), w_q[n // 16 * 16:].view(torch.uint8))
    if k % 4 == 0 and n >= 16:
        assert not torch.equal(grouped.view(torch.uint8), w_q.view(torch.uint8))
    rows = (torch.arange(n, dtype=torch.int32) // 128).flip(0).contiguous()
    bias = torch.randn(n, generator=gen).bfloat16()
    for m in (1, 2, 3, 5, 8, 9, 17, 64, 65, 80):
        x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)).bfloat16()
        for b, r in ((None, None), (bias, rows)):
            expected = ops.fp8_block_linear(x, w_q, w_s, b, False, r, True, "avx512")
            for bi in (True, False):
                got = ops.fp8_block_linear(x, grouped, w_s, b, False, r, bi, "avx512", True)
                assert torch.equal(got, expected), (m, bi, b is None)
            for kernel in ("avx512-nt", "avx512-gemm"):
                assert torch.equal(ops.fp8_block_linear(x, grouped, w_s, b, False, r, False, kernel, True),
                                   ops.fp8_block_linear(x, w_q, w_s, b, False, r, False, kernel)), (m, kernel)
    if k % 4 == 0:
        with pytest.raises(RuntimeError, match="the gemv reads weight rows, not nt16 groups"):
            ops.fp8_block_linear(x, grouped, w_s, None, False, None, False, "avx512-gemv", True)
    if AMX:  # the tiles read the groups too; up to 6 rows nt16 in the tiles' order gives their bits without them
        for m in (1, 2, 5, 6, 7, 33):
            x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)).bfloat16()
            expected = ops.fp8_block_linear(x, w_q, w_s, bias, False, rows, True, "amx")
            for bi in (True, False):
                assert torch.equal(ops.fp8_block_linear(x, grouped, w_s, bias, False, rows, bi, "amx", True),
                                   expected), (m, bi)


def _spread(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Values whose products stress the order of a sum: magnitudes 2^-8 .. 2^8 within every 128-wide group, which
    E4M3 keeps (products then span 32 bits, more than float32 holds), and exact cancellation (each eighth column
    the negation of the one before)."""
    x = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-8, 9, shape, generator=gen).float())
    x[..., 1::8] = -x[..., 0::8][..., : x[..., 1::8].shape[-1]]
    return x


@pytest.mark.skipif(not AMX, reason="the tiles' order is checked against the tiles")
def test_nt16_in_the_tiles_order_gives_the_tiles_bits(ops):
    """TDPBF16PS adds each 32-k step into C as C + (even + odd) (csrc/fp8_linear.cpp, nt16_blocks): the nt16
    kernel in that order gives the tiles' bits, at 1-6 rows where it replaces them, with ragged K (a partial last
    block, a single 64-k chunk), on inputs that tell sums in other orders apart (the plain nt kernel, one vdpbf16ps
    chain, differs on them)."""
    differs = 0
    for k, n in ((576, 960), (1536, 576), (192, 64), (64, 32)):
        gen = torch.Generator().manual_seed(k + 7 * n)
        w_q, w_s = quant.quantize_weight_blockwise(_spread(gen, n, k))
        grouped = layout.to_nt16_(w_q.clone())
        for m in range(1, 7):
            x = _spread(gen, m, k)  # float32 out: a bf16 output would round most differences away
            tiles = ops.fp8_block_linear(x, w_q, w_s, None, False, None, True, "amx")
            got = ops.fp8_block_linear(x, grouped, w_s, None, False, None, True, "amx", True)
            assert torch.equal(got, tiles), (k, n, m)
            differs += int((ops.fp8_block_linear(x, w_q, w_s, None, False, None, True, "avx512") != tiles).sum())
    assert differs > 100, differs  # the inputs tell the orders apart


@pytest.mark.skipif(not AMX, reason="AMX tiles")
def test_nt16_on_amx_rows_do_not_depend_on_the_batch_at_1_to_130_rows(ops):
    """A batch-invariant engine on AMX stores its FP8 weights as nt16: a row's bits are the same alone and at
    every batch size from 1 to 130 rows (nt16 in the tiles' order up to 6 rows, the tiles above), in the last
    position and in the first."""
    gen = torch.Generator().manual_seed(130)
    k, n = 576, 192
    w_q, w_s = quant.quantize_weight_blockwise(torch.randn(n, k, generator=gen))
    grouped = layout.to_nt16_(w_q)
    x = torch.randn(130, k, generator=gen).bfloat16()
    alone = ops.fp8_block_linear(x[:1], grouped, w_s, None, False, None, True, "amx", True)
    last = [ops.fp8_block_linear(x[m - 1:m], grouped, w_s, None, False, None, True, "amx", True) for m in (2, 6, 7)]
    for m in range(1, 131):
        y = ops.fp8_block_linear(x[:m], grouped, w_s, None, False, None, True, "amx", True)
        assert torch.equal(y[0], alone[0]), m
        for size, row in zip((2, 6, 7), last):
            if m >= size:
                assert torch.equal(y[size - 1], row[0]), (m, size)


def fp8_linear_cpu_isa(ops) -> str:
    return ops.fp8_linear_isa()
