"""The C++ BF16 linear kernel (csrc/bf16_linear.cpp) against the float32 product rounded once to bf16.

Its GEMM (batch_invariant, and large M) runs on AVX-512 BF16 dot products, or on AMX tiles where the CPU has
them; tests that take the `gemm` fixture run on each one this machine has (the op's `gemm` argument picks it, as
the engine's kernel set does once at start-up)."""

import functools

import pytest
import torch

from fp8engine import EngineConfig
from fp8engine.model_executor import kernel_set
from fp8engine.model_executor.kernels import bf16_linear_cpu
from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops
from fp8engine.model_executor.layers.linear import Linear
from fp8engine.weights import layout
from tests.conftest import cpu_flags, ops_without, require_cpu_op

BF16 = torch.bfloat16
AMX = {"amx_bf16", "amx_tile"} <= cpu_flags()


@pytest.fixture(scope="module")
def ops():
    require_cpu_op("bf16_linear")
    return load_cpu_ops()


@pytest.fixture(params=["avx512", "amx"])
def gemm(request):
    if request.param == "amx" and not AMX:
        pytest.skip("this CPU has no AMX tiles")
    return request.param


def _padded(rows: int, cols: int, pad: int) -> torch.Tensor:
    """A [rows, cols] bf16 view whose rows are cols + pad apart, with NaN in the padding: a kernel that
    reads past K returns NaN."""
    base = torch.full((rows, cols + pad), float("nan"), dtype=BF16)
    base[:, :cols] = torch.randn(rows, cols).to(BF16)
    return base[:, :cols]


def _assert_one_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    """y is the float32 result rounded once to bf16, up to a bf16 ulp where the float32 summation order
    decides the rounding."""
    exact = x.float() @ w.float().T + (0 if bias is None else bias.float())
    ref = exact.to(BF16).float()
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -100))) - 7)
    # float32 sums differ by a few float32 ulps of sum |x| |w|; that may cross a bf16 rounding boundary.
    slack = 1e-6 * (x.float().abs() @ w.float().abs().T)
    assert y.dtype == BF16 and y.shape == exact.shape
    assert ((y.float() - ref).abs() <= ulp + slack).all()
    assert (y.float() == ref).float().mean() > 0.99


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("n,k", [(37, 100), (1, 1), (48, 576), (130, 31), (64, 257)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_reference(ops, gemm, m, n, k, with_bias):
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k).to(BF16), torch.randn(n, k).to(BF16)
    bias = torch.randn(n).to(BF16) if with_bias else None
    _assert_one_rounding(ops.bf16_linear(x, w, bias, gemm=gemm), x, w, bias)


@pytest.mark.parametrize("m", [1, 5, 40])
def test_strided_rows_are_not_read_past_k(ops, m):
    torch.manual_seed(m)
    x, w = _padded(m, 333, 7), _padded(96, 333, 13)
    bias = torch.randn(96)
    _assert_one_rounding(ops.bf16_linear(x, w, bias), x, w, bias)


def test_default_model_shapes(ops):
    torch.manual_seed(0)
    for m in (1, 128):
        x = torch.randn(m, 576).to(BF16)
        w = (torch.randn(960, 576) * 0.05).to(BF16)
        _assert_one_rounding(ops.bf16_linear(x, w, None), x, w, None)


def test_rejects_bad_inputs(ops):
    x, w = torch.randn(4, 8).to(BF16), torch.randn(3, 8).to(BF16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.bf16_linear(x.float(), w, None)
    with pytest.raises(RuntimeError, match="K="):
        ops.bf16_linear(x, torch.randn(3, 9).to(BF16), None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.bf16_linear(x, w, torch.randn(4))


def test_wrapper_handles_batch_dims_and_float32(ops):
    torch.manual_seed(1)
    x, w, bias = torch.randn(2, 3, 64).to(BF16), torch.randn(40, 64).to(BF16), torch.randn(40).to(BF16)
    y = bf16_linear_cpu.bf16_linear(x, w, bias)
    _assert_one_rounding(y.reshape(6, 40), x.reshape(6, 64), w, bias)
    # float32 is not the kernel's: torch computes it, to float32 accuracy against a float64 product
    xf, wf = x.float() / 3, w.float() / 7
    yf = bf16_linear_cpu.bf16_linear(xf, wf, None)
    assert yf.dtype == torch.float32 and yf.shape == (2, 3, 40)
    torch.testing.assert_close(yf.double(), xf.double() @ wf.double().T, rtol=1e-6, atol=1e-6)


def test_linear_layer_sees_in_place_weight_updates(ops):
    torch.manual_seed(2)
    layer = Linear(64, [24, 8], BF16, kernel_set.select(EngineConfig()), bias=True)
    x = torch.randn(3, 64).to(BF16)
    for _ in range(2):  # an RL weight update writes into the same tensor
        layer.weight.copy_(torch.randn(32, 64))
        layer.bias.copy_(torch.randn(32))
        _assert_one_rounding(layer(x), x, layer.weight, layer.bias)


@pytest.mark.parametrize("m", [1, 3, 16, 17, 33, 130])
@pytest.mark.parametrize("n,k", [(37, 100), (1, 1), (48, 576), (130, 31), (64, 257), (100, 1536), (960, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_float32_reference(ops, gemm, m, n, k, with_bias):
    """batch_invariant takes the GEMM for every M: ragged M, N (tasks of fewer rows than a tile) and K."""
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k).to(BF16), torch.randn(n, k).to(BF16)
    bias = torch.randn(n).to(BF16) if with_bias else None
    _assert_one_rounding(ops.bf16_linear(x, w, bias, True, gemm=gemm), x, w, bias)


@pytest.mark.parametrize("m,n", [(1, 96), (40, 100), (130, 33)])
def test_gemm_does_not_read_past_k(ops, gemm, m, n):
    torch.manual_seed(m + n)
    x, w = _padded(m, 333, 7), _padded(n, 333, 13)
    bias = torch.randn(n)
    _assert_one_rounding(ops.bf16_linear(x, w, bias, True, gemm=gemm), x, w, bias)


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (100, 130)])
def test_gemm_rows_do_not_depend_on_the_batch(ops, gemm, k, n):
    """With batch_invariant a row's output is the same bits alone and anywhere in batches of any size (its
    16-row activation vector padded or shared, one or two vectors per tile group), with bias."""
    gen = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    x = torch.randn(70, k, generator=gen).to(BF16)
    full = ops.bf16_linear(x, w, bias, True, gemm=gemm)
    _assert_one_rounding(full, x, w, bias)
    for row in (0, 17, 69):
        alone = ops.bf16_linear(x[row:row + 1], w, bias, True, gemm=gemm)
        assert torch.equal(alone[0], full[row]), row
        for size, at in ((3, 1), (3, 2), (17, 0), (17, 16), (64, 40), (130, 5), (130, 129)):
            batch = torch.randn(size, k, generator=gen).to(BF16)
            batch[at] = x[row]
            assert torch.equal(ops.bf16_linear(batch, w, bias, True, gemm=gemm)[at], alone[0]), (row, size, at)


def test_gemm_large_m_in_chunks_gives_the_same_bits(ops, gemm):
    """AMX splits M into chunks of ~1 MiB of packed activations (336 rows at K = 1536): a row's bits do not
    change with the chunk it falls in."""
    torch.manual_seed(8)
    x, w, bias = torch.randn(700, 1536).to(BF16), (torch.randn(40, 1536) * 0.05).to(BF16), torch.randn(40)
    full = ops.bf16_linear(x, w, bias, True, gemm=gemm)
    _assert_one_rounding(full, x, w, bias)
    for row in (0, 335, 336, 699):
        assert torch.equal(ops.bf16_linear(x[row:row + 1], w, bias, True, gemm=gemm)[0], full[row]), row


@pytest.mark.parametrize("threads", [2, 3])
def test_gemm_split_over_threads_gives_the_same_bits(ops, gemm, threads):
    # 130 rows are 5 AMX tiles of 32 (3 AVX-512 tiles of 48), uneven over the threads: M is split too.
    torch.manual_seed(7)
    x, w, bias = torch.randn(40, 300).to(BF16), torch.randn(130, 300).to(BF16), torch.randn(130)
    one = ops.bf16_linear(x, w, bias, True, gemm=gemm)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        many = ops.bf16_linear(x, w, bias, True, gemm=gemm)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)
    _assert_one_rounding(many, x, w, bias)


def test_the_wrapper_takes_the_kernel_where_it_beats_torch(ops):
    takes = functools.partial(bf16_linear_cpu.kernel_takes, batch_invariant=False)
    assert [takes(m, gemm="avx512") for m in (1, 8, 32, 33, 256)] == [True, True, True, False, False]
    assert [takes(m, gemm="amx") for m in (1, 4, 5, 256, 257)] == [True, True, True, True, False]
    assert all(bf16_linear_cpu.kernel_takes(m, True, "avx512") for m in (1, 5, 257))


def test_the_environment_picks_the_gemm(ops, monkeypatch):
    """The GEMMs sum in different orders: AMX all of K in one running sum, AVX-512 per 256-k block, then the
    blocks. 256 products of 2^-22 vanish next to a running 256 but not in a block of their own."""
    x = torch.ones(1, 768, dtype=BF16)
    w = torch.zeros(1, 768)
    w[0, 0], w[0, 256:512], w[0, 512] = 256.0, 2.0 ** -22, -256.0
    w = w.to(BF16)
    below_amx = "avx512" if "avx512_bf16" in cpu_flags() else "avx2"  # AVX2: per 128-k block, the same sum here
    monkeypatch.delenv("FP8ENGINE_BF16_GEMM", raising=False)
    assert _bf16_gemm() == ("amx" if AMX else below_amx)
    monkeypatch.setenv("FP8ENGINE_BF16_GEMM", "avx512")
    assert _bf16_gemm() == below_amx
    assert kernel_set.select(EngineConfig(batch_invariant=True)).dense_linear(x, w, None).item() == 2.0 ** -14
    assert ops.bf16_linear(x, w, None, True, gemm="avx512").item() == 2.0 ** -14
    monkeypatch.setenv("FP8ENGINE_BF16_GEMM", "tiles")
    with pytest.raises(ValueError, match=r"FP8ENGINE_BF16_GEMM must be one of \('auto', 'avx512', 'amx'\), got 'tiles'"):
        _bf16_gemm()
    with pytest.raises(RuntimeError, match="gemm must be 'auto', 'avx512', 'amx', 'avx512-gemv', 'avx512-nt' or "
                                           "'avx512-gemm', got 'tiles'"):
        ops.bf16_linear(x, w, None, True, gemm="tiles")
    monkeypatch.setenv("FP8ENGINE_BF16_GEMM", "amx")
    if AMX:
        assert _bf16_gemm() == "amx"
        assert ops.bf16_linear(x, w, None, True, gemm="amx").item() == 0.0
    else:
        with pytest.raises(ValueError, match="does not allow AMX tiles"):
            _bf16_gemm()
        with pytest.raises(RuntimeError, match="does not allow AMX tiles"):
            ops.bf16_linear(x, w, None, True, gemm="amx")


def _bf16_gemm() -> str:
    return kernel_set.select(EngineConfig()).gemms[1]


def test_without_the_kernel_batch_invariant_linears_take_torch_in_fixed_chunks(monkeypatch):
    """A build without the C++ kernel still keeps a row's bits independent of the batch: torch's GEMM fed one
    shape only (chunks of BATCH_INVARIANT_ROWS rows)."""
    monkeypatch.setattr(kernel_set.cpu_ops, "load_cpu_ops", ops_without("bf16_linear"))
    monkeypatch.setenv("FP8ENGINE_BI_GEMM", "cpp")
    kernels = kernel_set.select(EngineConfig(batch_invariant=True))
    assert kernels.names["dense_linear"] == "torch-bf16-fixed-chunks"
    torch.manual_seed(5)
    x, w = torch.randn(150, 576).to(BF16), torch.randn(192, 576).to(BF16)
    batched = kernels.dense_linear(x, w, None)
    assert torch.equal(batched, bf16_linear_cpu.chunked_linear(x, w, None))
    for i in (0, 63, 64, 149):
        assert torch.equal(kernels.dense_linear(x[i:i + 1], w, None)[0], batched[i])


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_float32_out_is_the_sum_before_its_rounding_to_bf16(ops, gemm, m, batch_invariant):
    torch.manual_seed(m)
    x, w, bias = torch.randn(m, 200).to(BF16), torch.randn(70, 200).to(BF16), torch.randn(70).to(BF16)
    y32 = ops.bf16_linear(x, w, bias, batch_invariant, True, gemm=gemm)
    assert y32.dtype == torch.float32
    assert torch.equal(y32.to(BF16), ops.bf16_linear(x, w, bias, batch_invariant, gemm=gemm))


def _float32_head_inputs(m: int, n: int = 300, k: int = 576):
    torch.manual_seed(m + n)
    return torch.randn(m, k), (torch.randn(n, k) * 0.05).to(BF16)


@pytest.mark.skipif(not AMX, reason="the float32 head's split runs on AMX tiles")
def test_split_float32_head_is_as_accurate_as_float32_and_batch_invariant(ops):
    """x = hi + mid + lo in bf16 exactly, so the tiles' float32 sums are as close to the exact product as the
    float32 FMA kernel's; a row's bits do not depend on the rows beside it or on the 256-row chunks."""
    from fp8engine.model_executor.kernels.cpu_ops import cpu_kernel
    x, w = _float32_head_inputs(300)
    exact = x.double() @ w.double().T
    y = bf16_linear_cpu.split_float32_linear(x, w)
    fma = cpu_kernel("lm_head_f32")(x, w)
    err, fma_err = (y.double() - exact).abs(), (fma.double() - exact).abs()
    scale = x.double().abs() @ w.double().abs().T
    assert y.dtype == torch.float32 and y.shape == (300, 300)
    assert (err <= 2.0 ** -21 * scale).all()
    assert err.mean() <= 2 * fma_err.mean()
    bf16_err = (ops.bf16_linear(x.to(BF16), w, None, True, True).double() - exact).abs()
    assert err.mean() * 100 < bf16_err.mean()  # what the split is for: a bf16 input would lose ~2^-9 of x
    for i in (0, 15, 16, 255, 256, 299):
        assert torch.equal(bf16_linear_cpu.split_float32_linear(x[i:i + 1], w)[0], y[i])
    assert torch.equal(bf16_linear_cpu.split_float32_linear(x[250:270], w), y[250:270])


@pytest.mark.skipif(not AMX, reason="the kernel needs AMX tiles")
def test_terms_kernel_sums_the_terms_of_each_row(ops):
    torch.manual_seed(3)
    t = torch.randn(2, 16, 96).to(BF16)
    w = torch.randn(40, 96).to(BF16)
    y = ops.bf16_linear_terms_f32(t.view(32, 96), w, 2)
    exact = (t.double().sum(0)) @ w.double().T
    assert y.shape == (16, 40) and ((y.double() - exact).abs() <= 1e-4 * (1 + exact.abs())).all()
    assert torch.equal(ops.bf16_linear_terms_f32(t[:1].reshape(16, 96), w, 1),
                       ops.bf16_linear(t[0], w, None, True, True))
    with pytest.raises(RuntimeError, match="x's 24 rows are not 2 groups of a multiple of 16 rows"):
        ops.bf16_linear_terms_f32(torch.zeros(24, 96, dtype=BF16), w, 2)


def test_the_environment_picks_the_float32_head(ops, monkeypatch):
    require_cpu_op("lm_head_f32")

    def head(**options):
        return kernel_set.select(EngineConfig(lm_head_fp32=True, **options))
    x, w = _float32_head_inputs(4, 50, 64)
    monkeypatch.delenv("FP8ENGINE_BF16_GEMM", raising=False)  # the tiles need AMX, which make test-avx512 turns off
    monkeypatch.setenv("FP8ENGINE_FP32_HEAD", "fma")
    assert head().names["lm_head"] == "fp32-fma"
    assert torch.equal(head().lm_head(x, w), ops.lm_head_f32(x, w))
    monkeypatch.setenv("FP8ENGINE_FP32_HEAD", "tiles")
    assert (head().names["lm_head"] != "fp32-fma") == AMX
    if AMX:  # the tiles above 2 rows, and for every row count when batch invariant
        assert torch.equal(head().lm_head(x, w), bf16_linear_cpu.split_float32_linear(x, w))
        assert torch.equal(head(batch_invariant=True).lm_head(x[:1], w), bf16_linear_cpu.split_float32_linear(x[:1], w))
        assert torch.equal(head().lm_head(x[:2], w), ops.lm_head_f32(x[:2], w))
    monkeypatch.setenv("FP8ENGINE_FP32_HEAD", "fp64")
    with pytest.raises(ValueError, match=r"FP8ENGINE_FP32_HEAD must be one of \('tiles', 'fma'\), got 'fp64'"):
        head()


@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (77, 40), (300, 33)])
def test_nt_kernel_gives_the_gemms_bits_at_every_m(ops, k, n):
    """The nt kernel (weight rows in the lanes) sums every output as the AVX-512 GEMM does (per 256-k block one
    chain over the same pairs, the blocks added in order, the bias last): forced at the same M they give the same
    bits, bf16 and float32 out, ragged N and odd K; the gemv is within one rounding of the float32 product."""
    gen = torch.Generator().manual_seed(k + 5 * n)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16)
    bias = torch.randn(n, generator=gen)
    for m in (1, 3, 8, 9, 17, 33, 64, 70):
        x = torch.randn(m, k, generator=gen).to(BF16)
        for b in (None, bias):
            for f32 in (False, True):
                nt, gemm, gemv = (ops.bf16_linear(x, w, b, False, f32, kernel)
                                  for kernel in ("avx512-nt", "avx512-gemm", "avx512-gemv"))
                assert torch.equal(nt, gemm), (m, b is None, f32)
                if not f32:
                    _assert_one_rounding(gemv, x, w, b)
                    _assert_one_rounding(nt, x, w, b)


@pytest.mark.parametrize("n, k", [(37, 100), (130, 31), (64, 257), (1, 1), (960, 576)])
def test_gemv_rows_do_not_depend_on_the_rows_beside_them(ops, n, k):
    """The gemv walks its tile row by row at one activation row and across the rows per K chunk at 2-4; every
    output is the same chain either way, so a row's result alone equals its result among 2 or 4 (bf16 and float32
    out, with and without bias, ragged N and K)."""
    gen = torch.Generator().manual_seed(n + 7 * k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16)
    x = torch.randn(4, k, generator=gen).to(BF16)
    for b in (None, torch.randn(n, generator=gen)):
        for f32 in (False, True):
            for m in (2, 4):
                rows = ops.bf16_linear(x[:m], w, b, False, f32, "avx512-gemv")
                for i in range(m):
                    assert torch.equal(ops.bf16_linear(x[i:i + 1], w, b, False, f32, "avx512-gemv"), rows[i:i + 1])


@pytest.mark.parametrize("m", [1, 9, 40])
def test_nt_kernel_does_not_read_past_k(ops, m):
    """Rows K + pad apart with NaN in the padding: the nt kernel's in-place weight rows and its copies of the last
    block stop at K."""
    x, w = _padded(m, 300, 5), _padded(70, 300, 3)
    y = ops.bf16_linear(x, w, None, False, False, "avx512-nt")
    assert not y.isnan().any()
    _assert_one_rounding(y, x, w, None)


@pytest.mark.parametrize("k, n", [(576, 96), (576, 40), (130, 64), (512, 48), (31, 33), (2, 16)])
def test_nt16_weights_give_the_bits_of_rows_at_every_m(ops, k, n):
    """A BF16 weight in the nt16 layout (weights/layout.py: line q of a whole group of 16 rows is pair q of the 16
    rows; rows past the groups, and an odd K, as rows) gives bit for bit the batch-invariant result of the same
    weight as rows, through nt (straight from the lines at 1-2 rows, copied lines above) and the GEMM, with ragged
    N and K and a bias; a plain call takes nt too, and forcing the gemv on it is an error."""
    if ops.fp8_linear_isa() != "avx512bf16":
        pytest.skip("the nt16 layout is read by the AVX-512 BF16 kernels")
    gen = torch.Generator().manual_seed(k * 5 + n)
    w = torch.randn(n, k, generator=gen).to(BF16)
    grouped = layout.to_nt16_(w.clone())
    if k % 2 == 0:
        assert torch.equal(grouped.flatten()[:32].view(torch.int32), w[:16, :2].contiguous().view(torch.int32).flatten())
    bias = torch.randn(n, generator=gen).to(BF16)
    for m in (1, 2, 3, 5, 8, 9, 64, 65, 80):
        x = torch.randn(m, k, generator=gen).to(BF16)
        for b in (None, bias):
            expected = ops.bf16_linear(x, w, b, True, False, "avx512")
            for bi in (True, False):
                assert torch.equal(ops.bf16_linear(x, grouped, b, bi, False, "avx512", True), expected), (m, bi)
            for kernel in ("avx512-nt", "avx512-gemm"):
                assert torch.equal(ops.bf16_linear(x, grouped, b, False, False, kernel, True),
                                   ops.bf16_linear(x, w, b, False, False, kernel)), (m, kernel)
    if k % 2 == 0:
        with pytest.raises(RuntimeError, match="the gemv reads weight rows, not nt16 groups"):
            ops.bf16_linear(x, grouped, None, False, False, "avx512-gemv", True)


def _spread(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 values whose products stress a sum's order: magnitudes 2^-30 .. 2^30, each eighth column the negation
    of the one before (exact cancellation), and values below bf16's normals (which the tiles read as zero)."""
    x = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-30, 31, shape, generator=gen).float())
    x[..., 1::8] = -x[..., 0::8][..., : x[..., 1::8].shape[-1]]
    x[..., 5::16] = 3e-39
    return x.to(BF16)


@pytest.mark.skipif(not AMX, reason="the tiles' order is checked against the tiles")
@pytest.mark.parametrize("k, n", [(576, 96), (1536, 64), (130, 40), (34, 33), (576, 49152 // 64)])
def test_nt16_on_amx_gives_the_tiles_bits(ops, k, n):
    """A BF16 weight in the nt16 layout on AMX: at 1-4 rows nt16 in the tiles' order (csrc/linear_common.h: per
    32-k step C + (even + odd), denormals flushed), above the tiles reading the groups as B tiles, give the tiles'
    bits from rows, for float32 and bf16 outputs, with bias, ragged N and K, on inputs that tell other orders apart."""
    gen = torch.Generator().manual_seed(k + 3 * n)
    w = _spread(gen, n, k)
    grouped = layout.to_nt16_(w.clone())
    bias = torch.randn(n, generator=gen).to(BF16)
    differs = 0
    for m in (1, 2, 3, 4, 5, 17, 33):
        x = _spread(gen, m, k)
        for f32 in (True, False):
            tiles = ops.bf16_linear(x, w, bias, True, f32, "amx")
            for bi in (True, False):
                assert torch.equal(ops.bf16_linear(x, grouped, bias, bi, f32, "amx", True), tiles), (m, f32, bi)
            differs += int((ops.bf16_linear(x, w, bias, True, f32, "avx512") != tiles).sum())
    assert differs > 50, differs


@pytest.mark.skipif(not AMX, reason="AMX tiles")
def test_nt16_on_amx_rows_do_not_depend_on_the_batch_at_1_to_130_rows(ops):
    """A batch-invariant engine's BF16 weights on AMX are nt16: a row's bits are the same alone and at every batch
    size from 1 to 130 (nt16 in the tiles' order up to 4 rows, the tiles above)."""
    gen = torch.Generator().manual_seed(130)
    w = layout.to_nt16_(torch.randn(96, 576, generator=gen).to(BF16))
    x = torch.randn(130, 576, generator=gen).to(BF16)
    last = {size: ops.bf16_linear(x[size - 1:size], w, None, True, False, "amx", True) for size in (1, 4, 5, 130)}
    for m in range(1, 131):
        y = ops.bf16_linear(x[:m], w, None, True, False, "amx", True)
        for size, row in last.items():
            if m >= size:
                assert torch.equal(y[size - 1], row[0]), (m, size)
