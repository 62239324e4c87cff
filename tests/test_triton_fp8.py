"""Triton FP8 kernels on the Triton CPU interpreter against the plain-torch definitions in quant.py.

Quantized values and scales must match bit for bit; the GEMM must match the float32 reference up to
summation order.
"""

import os

# The interpreter is chosen when the kernels are decorated, so this must precede importing triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from fp8engine.model_executor.kernels import fp8_triton as ft, pdl  # noqa: E402
from fp8engine.weights import quant  # noqa: E402
from fp8engine.weights.quant import cdiv  # noqa: E402

SCALE_FMTS = [None, "ue8m0"]


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


QuantPair = tuple[torch.Tensor, torch.Tensor]


def _assert_same_quant(got: QuantPair, ref: QuantPair) -> None:
    (q, s), (rq, rs) = got, ref
    assert q.dtype == quant.FP8_DTYPE and s.dtype == torch.float32
    assert q.shape == rq.shape and s.shape == rs.shape
    mismatched = (_bits(q) != _bits(rq)).sum().item()
    assert mismatched == 0, f"{mismatched} fp8 codes differ"
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32)), (s - rs).abs().max()


@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 128), (5, 200), (5, 576), (3, 64)])
def test_activation_quant_bit_exact(m, k, dtype, scale_fmt):
    torch.manual_seed(m * k)
    x = (torch.randn(m, k) * torch.logspace(-3, 2, m).unsqueeze(1)).to(dtype)
    _assert_same_quant(ft.per_token_group_quant_fp8(x, scale_fmt=scale_fmt),
                       quant.quantize_activation_groups(x, scale_fmt=scale_fmt))


def _edge_rows() -> torch.Tensor:
    """Rows of one 128-group each: every E4M3 value and every midpoint (ties), fp8 subnormals,
    float32 subnormals, zero groups and exact power-of-two scales."""
    codes = torch.arange(256, dtype=torch.uint8).view(quant.FP8_DTYPE).float()
    grid = codes[codes.isfinite() & (codes >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e4))])
    values = torch.cat([values, -values, torch.tensor([1e-40, -1e-42, 2.0**-10, -(2.0**-10) * 3])])
    values = torch.cat([values, torch.zeros(-len(values) % 127)]).view(-1, 127)
    # amax 448 gives scale exactly 1, so the values above reach the fp8 cast unscaled.
    rows = torch.cat([torch.full((len(values), 1), 448.0), values], dim=1)
    special = torch.zeros(3, 128)
    special[1, 5] = 3.5  # 3.5 / 448 = 2^-7: ue8m0 must keep it, not round up
    special[2] = torch.linspace(-3e-13, 1e-13, 128)  # amax under the 1e-12 floor
    return torch.cat([rows, special])


@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_activation_quant_edge_values(scale_fmt):
    x = _edge_rows()
    _assert_same_quant(ft.per_token_group_quant_fp8(x, scale_fmt=scale_fmt),
                       quant.quantize_activation_groups(x, scale_fmt=scale_fmt))


def test_activation_quant_non_contiguous_input():
    x = torch.randn(6, 400)[::2, 10:310]
    _assert_same_quant(ft.per_token_group_quant_fp8(x), quant.quantize_activation_groups(x))


@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(64, 128), (192, 200), (130, 576)])
def test_weight_quant_bit_exact(n, k, dtype, scale_fmt):
    torch.manual_seed(n + k)
    w = (torch.randn(n, k) * 0.02).to(dtype)
    w[:, :64] *= 50  # blocks with different scales
    _assert_same_quant(ft.quantize_weight_blockwise_triton(w, scale_fmt=scale_fmt),
                       quant.quantize_weight_blockwise(w, scale_fmt=scale_fmt))


def test_weight_quant_edge_values():
    w = _edge_rows()
    _assert_same_quant(ft.quantize_weight_blockwise_triton(w), quant.quantize_weight_blockwise(w))


def test_weight_quant_into_given_buffers():
    w = torch.randn(192, 200, dtype=torch.bfloat16)
    out_q = torch.empty(192, 200, dtype=quant.FP8_DTYPE)
    out_scale = torch.empty(2, 2)
    q, s = ft.quantize_weight_blockwise_triton(w, out_q, out_scale, scale_fmt="ue8m0")
    assert q.data_ptr() == out_q.data_ptr() and s.data_ptr() == out_scale.data_ptr()
    _assert_same_quant((out_q, out_scale), quant.quantize_weight_blockwise(w, scale_fmt="ue8m0"))


def test_weight_quant_rejects_wrong_buffers():
    w = torch.randn(192, 200)
    with pytest.raises(ValueError, match="out_scale"):
        ft.quantize_weight_blockwise_triton(w, out_scale=torch.empty(1, 2))
    with pytest.raises(ValueError, match="out_q"):
        ft.quantize_weight_blockwise_triton(w, out_q=torch.empty(192, 200))


def _weight(n: int, k: int, scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(7 * n + k)
    return quant.quantize_weight_blockwise(torch.randn(n, k) * 0.05, scale_fmt=scale_fmt)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (5, 192, 200), (5, 64, 576), (1, 192, 576), (20, 130, 328)])
def test_linear_matches_reference_fp32(m, n, k, with_bias):
    w_q, w_s = _weight(n, k)
    x = torch.randn(m, k) * 2
    bias = torch.randn(n) if with_bias else None
    out = ft.fp8_block_linear_triton(x, w_q, w_s, bias)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out, quant.fp8_block_linear_ref(x, w_q, w_s, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_linear_bf16_batched_input(scale_fmt):
    w_q, w_s = _weight(192, 576, scale_fmt)
    x = torch.randn(2, 3, 576, dtype=torch.bfloat16)
    bias = torch.randn(192, dtype=torch.bfloat16)
    out = ft.fp8_block_linear_triton(x, w_q, w_s, bias, scale_fmt=scale_fmt)
    ref = quant.fp8_block_linear_ref(x, w_q, w_s, bias, scale_fmt=scale_fmt)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 192)
    # Same float32 sums up to order; at most a rare one-ulp flip when rounding to bf16.
    torch.testing.assert_close(out, ref, atol=0, rtol=2**-7)


def test_matmul_applies_each_scale_per_block():
    """Scales that differ per K block, per 128 rows of W and per token must each hit their own block."""
    m, n, k = 5, 192, 328
    torch.manual_seed(0)
    x_q = torch.randn(m, k).clamp(-448, 448).to(quant.FP8_DTYPE)
    w_q = torch.randn(n, k).to(quant.FP8_DTYPE)
    x_s = torch.rand(m, 3) + 0.5
    w_s = torch.tensor([[1.0, 2.0**-3, 2.0**5], [3.0, 0.25, 1.5]])
    expected = torch.zeros(m, n)
    for b in range(3):
        ks = slice(128 * b, min(k, 128 * (b + 1)))
        expected += (x_q[:, ks].float() @ w_q[:, ks].float().t()) * x_s[:, b:b + 1] \
            * w_s[:, b].repeat_interleave(128)[:n]
    out = ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", [(16, 64, 1, 4, 2), (16, 32, 3, 4, 2), (16, 128, 8, 4, 3), (64, 64, 2, 4, 2)])
def test_matmul_launches_agree(config):
    """Every launch the GPU sweep may pick gives the default's result: a narrower tile bit for bit (each output
    sums its K blocks in the same order), a K split within float32 reassociation, bias included."""
    m, n, k = 5, 192, 840  # 7 K blocks, the last partial: splits of 3 and 8 leave short and empty runs
    w_q, w_s = _weight(n, k)
    torch.manual_seed(1)
    x_q, x_s = quant.quantize_activation_groups(torch.randn(m, k))
    bias = torch.randn(n)
    config = ft.GemmConfig(*config)
    want = ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, bias)
    got = ft.w8a8_matmul_with(config, x_q, x_s, w_q, w_s, torch.float32, bias)
    if config.split_k == 1:
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        assert not torch.equal(got, want) or config.split_k >= 7  # the split really ran (partials in another order)


@pytest.mark.parametrize("k", [848, 840])
def test_tma_tiles_give_the_pointer_loads_bits(k, monkeypatch):
    """FP8ENGINE_TMA_GEMM's kernel: A and weight tiles through TMA descriptors, zeros past every edge (70 rows over two
    64-row tiles, 200 columns over two 128-wide ones, 7 K blocks the last one partial), bias; bit for bit the pointer
    kernel's result. K = 840 rows are not 16-byte multiples, which a descriptor needs: the pointer kernel runs."""
    m, n = 70, 200
    w_q, w_s = _weight(n, k)
    torch.manual_seed(2)
    x_q, x_s = quant.quantize_activation_groups(torch.randn(m, k))
    bias = torch.randn(n)
    want = ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16, bias)
    launched, kernel = [], ft._w8a8_block_matmul_tma_kernel

    class Counted:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]
    monkeypatch.setattr(ft, "_w8a8_block_matmul_tma_kernel", Counted())
    with pdl.TMA_GEMM.forced(True):
        config = ft.gemm_config(m, n, k, False)
        got = ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16, bias)
        assert ft.gemm_config(64, n, k, False).tma is False and ft.gemm_config(m, n, k, True).tma is False
    assert config == ft.GemmConfig(64, 128, 1, 4, 4, tma=True) and not ft.gemm_config(m, n, k, False).tma
    assert launched == ([(2, 2)] if k % 16 == 0 else [])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("m,n,k", [(1, 200, 848), (5, 192, 840), (13, 130, 300)])
def test_swapped_operands_give_the_launch_result(m, n, k, monkeypatch):
    """FP8ENGINE_SWAP_AB_GEMM's kernel (the weight tile times the rows' transpose): 8- and 16-row tiles, 64 weight
    rows a program over N = 130-200 (a partial tile), partial last K blocks, bias, K splits of 1-3 (some runs short
    or empty), partials kept for the fused norm: the default launch's result within float32 reassociation (the
    interpreter's matmul adds the transposed product in another order; on sm_90 E4M3 wgmma against f16 mma)."""
    w_q, w_s = _weight(n, k)
    torch.manual_seed(3)
    x_q, x_s = quant.quantize_activation_groups(torch.randn(m, k))
    bias = torch.randn(n)
    want = ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, bias)
    want_plain = ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32)
    launched, kernel = [], ft._w8a8_block_matmul_swap_kernel

    class Counted:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]
    monkeypatch.setattr(ft, "_w8a8_block_matmul_swap_kernel", Counted())
    tile = 8 if m <= 8 else 16
    for split in (1, 2, 3):
        got = ft.w8a8_matmul_with(ft.GemmConfig(tile, 64, split, 4, 2, swap_ab=True), x_q, x_s, w_q, w_s,
                                  torch.float32, bias)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    parts = ft.w8a8_matmul_with(ft.GemmConfig(tile, 64, 2, 4, 2, swap_ab=True), x_q, x_s, w_q, w_s, torch.float32,
                                partials=True)
    assert parts.shape == (2, m, n)
    torch.testing.assert_close(parts[0] + parts[1], want_plain, atol=1e-5, rtol=1e-5)
    with pdl.SWAP_AB_GEMM.forced(True):  # the switch's own launch, through the public entry
        got = ft.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16, bias)
    assert ft.gemm_config(m, n, k, False) == ft.GemmConfig(16, 32, 1, 4, 4)  # off again
    torch.testing.assert_close(got.float(), want, atol=0, rtol=2**-7)
    assert launched == [(1, cdiv(n, 64), s) for s in (1, 2, 3, 2)] + [(1, cdiv(n, 64), 1)]


def test_swapped_operand_launch_rules():
    """FP8ENGINE_SWAP_AB_GEMM at up to 16 rows: 64 weight rows a program, 8- or 16-row tiles; a deep layer splits K
    in 4 as before; a layer of under 128 programs splits K in 2 only where its partials go to the fused norm
    (o_proj), not where they would take a reduce launch (qkv_proj); 17 rows and batch-invariant engines are as
    before."""
    with pdl.SWAP_AB_GEMM.forced(True):
        assert ft.gemm_config(1, 4096, 4096, False, partials=True) == ft.GemmConfig(8, 64, 2, 4, 4, swap_ab=True)
        assert ft.gemm_config(9, 6144, 4096, False) == ft.GemmConfig(16, 64, 1, 4, 4, swap_ab=True)
        assert ft.gemm_config(16, 4096, 14336, False) == ft.GemmConfig(16, 64, 4, 4, 4, swap_ab=True)
        assert ft.gemm_config(4, 28672, 4096, False, partials=True) == ft.GemmConfig(8, 64, 1, 4, 4, swap_ab=True)
        assert ft.gemm_config(17, 4096, 14336, False) == ft.GemmConfig(64, 64, 1, 4, 4)
        assert ft.gemm_config(1, 4096, 4096, True) == ft.GemmConfig(64, 64, 1, 4, 4)


def test_launch_rules():
    """docs/gpu.md: decode splits K only for deep layers; the batch-invariant launch depends on N alone."""
    assert ft.gemm_config(1, 4096, 14336, False) == ft.GemmConfig(16, 32, 4, 4, 4)
    assert ft.gemm_config(16, 28672, 4096, False) == ft.GemmConfig(16, 64, 1, 4, 4)
    assert ft.gemm_config(17, 4096, 14336, False).split_k == 1
    assert {ft.gemm_config(m, 4096, 14336, True) for m in (1, 7, 64, 300)} == {ft.GemmConfig(64, 64, 1, 4, 4)}
    assert ft.gemm_config(5, 28672, 4096, True) == ft.GemmConfig(64, 128, 1, 4, 4)


def test_matmul_rejects_bad_launches():
    x_q, x_s = quant.quantize_activation_groups(torch.randn(2, 256))
    w_q, w_s = _weight(64, 256)
    with pytest.raises(ValueError, match="block_n must divide 128"):
        ft.w8a8_matmul_with(ft.GemmConfig(16, 96, 1, 4, 2), x_q, x_s, w_q, w_s, torch.float32)
    with pytest.raises(ValueError, match="no K split or swapped operands when batch invariant"):
        ft.w8a8_matmul_with(ft.GemmConfig(64, 128, 2, 4, 2), x_q, x_s, w_q, w_s, torch.float32, batch_invariant=True)
    with pytest.raises(ValueError, match="no K split or swapped operands when batch invariant"):
        ft.w8a8_matmul_with(ft.GemmConfig(16, 64, 1, 4, 2, swap_ab=True), x_q, x_s, w_q, w_s, torch.float32,
                            batch_invariant=True)


def test_matmul_rejects_mismatched_scales():
    x_q = torch.zeros(2, 256, dtype=quant.FP8_DTYPE)
    w_q = torch.zeros(64, 256, dtype=quant.FP8_DTYPE)
    with pytest.raises(ValueError, match="shape mismatch"):
        ft.w8a8_block_fp8_matmul(x_q, torch.ones(2, 1), w_q, torch.ones(1, 2), torch.float32)


def test_empty_batch():
    w_q, w_s = _weight(64, 200)
    out = ft.fp8_block_linear_triton(torch.randn(0, 200), w_q, w_s)
    assert out.shape == (0, 64)


def test_deepgemm_is_probed_and_says_why_not():
    """The kernel set asks once at start-up; without the library (or off a Hopper, or where its GEMM disagrees
    with the Triton kernel's) the answer is the reason, and Triton runs."""
    assert "deep_gemm does not import" in ft.probe_deepgemm(torch.device("cpu"))
