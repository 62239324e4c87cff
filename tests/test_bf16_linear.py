"""The C++ BF16 linear kernel (csrc/bf16_linear.cpp) against the float32 product rounded once to bf16."""

import pytest
import torch

from fp8engine.model_executor.kernels import bf16_linear_cpu
from fp8engine.model_executor.layers.linear import Linear
from tests.conftest import require_cpu_op

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ops():
    require_cpu_op("bf16_linear")
    return bf16_linear_cpu.kernel_ops()


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
def test_matches_float32_reference(ops, m, n, k, with_bias):
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k).to(BF16), torch.randn(n, k).to(BF16)
    bias = torch.randn(n).to(BF16) if with_bias else None
    _assert_one_rounding(ops.bf16_linear(x, w, bias), x, w, bias)


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
    layer = Linear(64, [24, 8], BF16, bias=True)
    x = torch.randn(3, 64).to(BF16)
    for _ in range(2):  # an RL weight update writes into the same tensor
        layer.weight.copy_(torch.randn(32, 64))
        layer.bias.copy_(torch.randn(32))
        _assert_one_rounding(layer(x), x, layer.weight, layer.bias)
