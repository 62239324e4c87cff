"""C++ fused layer ops (csrc/layer_ops.cpp) against the torch code they replace.

BF16 rounds at the same points as torch, so results are bit-identical; float32 may differ in the
last bit (fused multiply-adds, exp polynomial)."""

import pytest
import torch
from torch.nn import functional as F

from fp8engine.model_executor.kernels.layer_ops_ref import rms_norm_ref, rotate_half
from fp8engine.model_executor.layers import rotary
from fp8engine.model_executor.layers.norm import RMSNorm
from tests.conftest import cpu_kernels, require_cpu_op



@pytest.fixture(autouse=True)
def _kernels_built():
    for op in ("rms_norm", "rotary_embedding_", "silu_and_mul"):
        require_cpu_op(op)


DTYPES = [(torch.bfloat16, 0.0), (torch.float32, 2e-6)]


def _check(got, want, atol):
    if atol == 0:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm_with_and_without_residual(dtype, atol, hidden):
    gen = torch.Generator().manual_seed(0)
    kernels = cpu_kernels(dtype="float32" if dtype == torch.float32 else "bfloat16")
    assert kernels.names["layer_ops"] == "cpp"
    norm = RMSNorm(hidden, 1e-5, dtype, kernels)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    x, res = (torch.randn(37, hidden, generator=gen).to(dtype) for _ in range(2))
    out, summed = norm(x, res)
    assert torch.equal(summed, x + res)
    _check(out, rms_norm_ref(x + res, None, norm.weight, norm.eps)[0], atol)
    out, same = norm(x)
    assert same is x
    _check(out, rms_norm_ref(x, None, norm.weight, norm.eps)[0], atol)
    heads = x.reshape(37, -1, hidden // 4)[:, 1:3]  # a strided view, as Qwen3's per-head q/k norm sees
    head_norm = RMSNorm(hidden // 4, 1e-6, dtype, kernels)
    _check(head_norm(heads)[0], rms_norm_ref(heads, None, head_norm.weight, head_norm.eps)[0], atol)


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_rotary_in_place_on_qkv_views(dtype, atol):
    gen = torch.Generator().manual_seed(1)
    rope = rotary.RotaryEmbedding(64, 512, 10000.0, dtype, cpu_kernels())
    qkv = torch.randn(29, 960, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (29,), generator=gen)
    q, k = qkv[:, :576].reshape(-1, 9, 64), qkv[:, 576:768].reshape(-1, 3, 64)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    want_q = q * cos + rotate_half(q) * sin
    want_k = k * cos + rotate_half(k) * sin
    v_before = qkv[:, 768:].clone()
    got_q, got_k = rope(positions, q, k)
    _check(got_q, want_q, atol)
    _check(got_k, want_k, atol)
    assert torch.equal(qkv[:, 768:], v_before)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        rope(torch.tensor([512] * 29), q, k)


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_silu_and_mul(dtype, atol):
    x = (torch.randn(5, 3, 2 * 1000, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    got = cpu_kernels().silu_and_mul(x)
    assert got.shape == (5, 3, 1000)
    _check(got, F.silu(gate) * up, atol * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_out_variants_write_the_ops_bits_into_the_given_buffers(dtype):
    """rms_norm_out and silu_and_mul_out (the decoder plan's, which reuses its buffers every layer) give the bits
    of rms_norm and silu_and_mul; the residual may be updated in place."""
    require_cpu_op("rms_norm_out")
    ops = torch.ops.fp8engine
    gen = torch.Generator().manual_seed(3)
    x, res = (torch.randn(7, 576, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(576, generator=gen).to(dtype)
    want, want_sum = ops.rms_norm(x, res, w, 1e-5)
    out = torch.full_like(x, float("nan"))
    stream = res.clone()
    ops.rms_norm_out(x, stream, w, 1e-5, out, stream)  # in place, as the plan's residual stream
    assert torch.equal(out, want) and torch.equal(stream, want_sum)
    ops.rms_norm_out(x, None, w, 1e-5, out, None)
    assert torch.equal(out, ops.rms_norm(x, None, w, 1e-5)[0])
    g = torch.randn(7, 2 * 1536, generator=gen).to(dtype)
    act = torch.empty(7, 1536, dtype=dtype)
    ops.silu_and_mul_out(g, act)
    assert torch.equal(act, ops.silu_and_mul(g))
    with pytest.raises(RuntimeError, match="out must be a contiguous tensor of x's shape"):
        ops.rms_norm_out(x, None, w, 1e-5, out[:, :100], None)
    with pytest.raises(RuntimeError, match="out must not be x"):
        ops.rms_norm_out(x, None, w, 1e-5, x, None)
    with pytest.raises(RuntimeError, match="residual and residual_out go together"):
        ops.rms_norm_out(x, res, w, 1e-5, out, None)
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \[rows, n\]"):
        ops.silu_and_mul_out(g, torch.empty(7, 1000, dtype=dtype))
