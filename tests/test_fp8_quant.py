"""The reference FP8 block quantization (fp8engine.weights.quant) against hand-computed values."""

import numpy as np
import pytest
import torch

from fp8engine.weights import quant

E4M3 = torch.float8_e4m3fn


def _quantized_values(q: torch.Tensor) -> list[float]:
    return q.float().flatten().tolist()


def _block(values: dict[tuple[int, int], float], shape=(128, 128)) -> torch.Tensor:
    w = torch.zeros(shape)
    for (r, c), v in values.items():
        w[r, c] = v
    return w


def test_amax_448_gives_unit_scale_and_round_to_nearest_even():
    # scale 1: the codes are E4M3(value) directly. Ties: 1.0625 lies halfway between 1.0 and 1.125
    # (even mantissa 000 wins), 1.1875 between 1.125 and 1.25 (010 wins), 100 = 1.5625 * 2^6 between
    # 96 and 104 (96 wins); subnormals step by 2^-9, so 2^-10 ties to 0 and 3 * 2^-10 to 2^-8.
    cells = {(0, 0): 448.0, (0, 1): -448.0, (1, 0): 1.0625, (1, 1): 1.1875, (2, 0): 2.0 ** -10,
             (2, 1): 3 * 2.0 ** -10, (3, 0): 0.3, (3, 1): -100.0, (4, 0): 2.0 ** -9, (4, 1): 1e-5}
    expected = {(0, 0): 448.0, (0, 1): -448.0, (1, 0): 1.0, (1, 1): 1.25, (2, 0): 0.0, (2, 1): 2.0 ** -8,
                (3, 0): 0.3125, (3, 1): -96.0, (4, 0): 2.0 ** -9, (4, 1): 0.0}
    q, s = quant.quantize_weight_blockwise(_block(cells))
    assert s.tolist() == [[1.0]]
    assert torch.equal(q.float(), _block(expected))


def test_amax_896_gives_scale_two():
    # 896 / 2 = 448; 3 / 2 = 1.5; 500 / 2 = 250 = 1.953 * 2^7 rounds up to 2^8.
    q, s = quant.quantize_weight_blockwise(_block({(0, 0): 896.0, (5, 7): 3.0, (9, 9): -1.0, (127, 127): 500.0}))
    assert s.tolist() == [[2.0]]
    assert torch.equal(q.float(), _block({(0, 0): 448.0, (5, 7): 1.5, (9, 9): -0.5, (127, 127): 256.0}))


def test_ue8m0_rounds_the_scale_up_to_a_power_of_two():
    # 3.5 / 448 = 2^-7 exactly and stays; 4 / 448 rounds up to 2^-6; the float just above 3.5 gives a
    # scale one ulp above 2^-7, which must also round up (ceil(log2) in float32 used to round it down).
    just_above = float(np.nextafter(np.float32(3.5), np.float32(4.0)))
    amax = torch.tensor([3.5, 4.0, just_above])
    assert quant.compute_scale(amax, "ue8m0").tolist() == [2.0 ** -7, 2.0 ** -6, 2.0 ** -6]
    q, s = quant.quantize_weight_blockwise(_block({(0, 0): 4.0, (0, 1): 1.0}), scale_fmt="ue8m0")
    assert s.tolist() == [[2.0 ** -6]]
    assert _quantized_values(q[0, :2]) == [256.0, 64.0]
    q, s = quant.quantize_weight_blockwise(_block({(0, 0): just_above}), scale_fmt="ue8m0")
    assert s.tolist() == [[2.0 ** -6]] and q[0, 0].float().item() == 224.0


def test_ue8m0_never_clips():
    w = torch.randn(256, 384) * torch.logspace(-6, 6, 384)
    plain = quant.weight_block_amax(w) / quant.FP8_MAX
    q, s = quant.quantize_weight_blockwise(w, scale_fmt="ue8m0")
    assert torch.all(s >= plain) and torch.all(s < 2 * plain)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert q.float().abs().max() <= quant.FP8_MAX


def test_all_zero_block_uses_the_minimum_amax():
    q, s = quant.quantize_weight_blockwise(torch.zeros(128, 256))
    expected = float(np.float32(1e-12) / np.float32(448.0))
    assert s.tolist() == [[expected, expected]]
    assert not q.float().any()


def test_invalid_scale_fmt():
    with pytest.raises(ValueError, match="scale_fmt"):
        quant.compute_scale(torch.ones(1), "e8m0")


@pytest.mark.parametrize("shape", [(200, 300), (192, 576), (1, 5)])
def test_partial_blocks(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 3
    q, s = quant.quantize_weight_blockwise(w)
    n, k = shape
    assert q.shape == shape and q.dtype == E4M3
    assert s.shape == (quant.cdiv(n, 128), quant.cdiv(k, 128))
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            tile = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            scale = tile.abs().max() / 448.0
            assert s[bi, bj] == scale
            expected = (tile / scale).clamp(-448, 448).to(E4M3)
            got = q[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_dequant_round_trip_error(scale_fmt):
    torch.manual_seed(1)
    w = torch.randn(300, 200) * torch.rand(300, 1) * 10
    q, s = quant.quantize_weight_blockwise(w, scale_fmt=scale_fmt)
    deq = quant.dequantize_weight_blockwise(q, s)
    full = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    # 3 mantissa bits: half an ulp is 2^-4 relative; below 2^-6 the absolute step is 2^-9 * scale.
    bound = torch.maximum(w.abs() * 2.0 ** -4, full * 2.0 ** -10) * (1 + 1e-6)
    assert torch.all((deq - w).abs() <= bound)
    assert quant.dequantize_weight_blockwise(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_quantize_weight_into_reuses_buffers():
    w = torch.randn(192, 576, dtype=torch.bfloat16)
    out_q = torch.empty(192, 576, dtype=E4M3)
    out_s = torch.empty(2, 5)
    q_ptr, s_ptr = out_q.data_ptr(), out_s.data_ptr()
    quant.quantize_weight_into(w, out_q, out_s)
    q, s = quant.quantize_weight_blockwise(w)
    assert out_q.data_ptr() == q_ptr and out_s.data_ptr() == s_ptr
    assert torch.equal(out_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(out_s, s)


def test_activation_groups():
    x = torch.zeros(2, 300)
    x[0, 0], x[0, 5] = 896.0, 3.0  # group 0 of row 0: scale 2
    x[0, 299] = -44.8  # group 2 (cols 256..299) of row 0: scale 0.1
    x[1, 130] = 1.0625  # group 1 of row 1: scale 1.0625 / 448, the value itself becomes 448
    q, s = quant.quantize_activation_groups(x)
    assert q.shape == (2, 300) and s.shape == (2, 3)
    tiny = float(np.float32(1e-12) / np.float32(448.0))
    assert s[0].tolist() == [2.0, tiny, float(np.float32(44.8) / np.float32(448.0))]
    assert s[1].tolist() == [tiny, float(np.float32(1.0625) / np.float32(448.0)), tiny]
    assert q[0, 0].float() == 448.0 and q[0, 5].float() == 1.5 and q[0, 299].float() == -448.0
    assert q[1, 130].float() == 448.0
    assert int(q.float().count_nonzero()) == 4


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_activation_groups_round_trip(scale_fmt):
    torch.manual_seed(2)
    x = torch.randn(5, 200) * torch.logspace(-3, 3, 200)
    q, s = quant.quantize_activation_groups(x, scale_fmt=scale_fmt)
    full = s.repeat_interleave(128, 1)[:, :200]
    expected = (x / full).clamp(-448, 448).to(E4M3)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    bound = torch.maximum(x.abs() * 2.0 ** -4, full * 2.0 ** -10) * (1 + 1e-6)
    assert torch.all((q.float() * full - x).abs() <= bound)


def test_block_linear_ref_matches_dequantized_matmul():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 300, dtype=torch.bfloat16)
    w_q, w_s = quant.quantize_weight_blockwise(torch.randn(200, 300))
    bias = torch.randn(200, dtype=torch.bfloat16)
    y = quant.fp8_block_linear_ref(x, w_q, w_s, bias)
    assert y.shape == (2, 3, 200) and y.dtype == torch.bfloat16
    x_q, x_s = quant.quantize_activation_groups(x.reshape(6, 300))
    x_deq = x_q.double() * x_s.double().repeat_interleave(128, 1)[:, :300]
    w_deq = quant.dequantize_weight_blockwise(w_q, w_s, dtype=torch.float64)
    expected = (x_deq @ w_deq.t() + bias.double()).reshape(2, 3, 200)
    torch.testing.assert_close(y.double(), expected, rtol=2.0 ** -8, atol=1e-6)
