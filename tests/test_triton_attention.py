"""The Triton paged-attention and KV-cache-write kernels on the Triton CPU interpreter against the torch
reference (attention_ref).

Cache writes must match bit for bit; attention must match the float32 reference up to summation order
(and, with a bf16 q, bf16 output rounding); full FP8 up to rare E4M3 rounding-tie flips.
"""

import functools
import os

# The interpreter is chosen when the kernels are decorated, so this must precede importing triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from fp8engine.model_executor.kernels import attention_triton as at  # noqa: E402
from fp8engine.model_executor.kernels.attention_ref import (FP8_DTYPE, FP8_MAX, paged_attention_ref,  # noqa: E402
                                                            write_kv_cache_ref)
from fp8engine.weights.quant import quantize_activation_groups  # noqa: E402
from tests import attention_batches  # noqa: E402
from tests.attention_batches import K_SCALE, Q_SCALE, V_SCALE, random_cache  # noqa: E402

make_batch = functools.partial(attention_batches.make_batch, strided_q=True)


# (num_heads, num_kv_heads, head_dim, block_size): GQA groups of 3 and 2.
HEADS = [(9, 3, 64, 16), (4, 2, 32, 8)]
CACHE_DTYPES = [torch.float32, torch.bfloat16, FP8_DTYPE]
# Per sequence: (context length including the new tokens, new query tokens). Contexts end inside and on
# block boundaries; 36 queries need two query tiles; sequences without queries sit at both ends.
BATCHES = {
    "decode": [(1, 1), (8, 1), (16, 1), (17, 1), (40, 1)],
    "chunked_prefill": [(40, 24), (16, 16), (33, 7)],
    "mixed": [(20, 0), (36, 36), (40, 1), (29, 9), (17, 1), (5, 5), (9, 0)],
}


def output_rtol(dtype: torch.dtype) -> float:
    # float32 sums in another order; a bf16 result a few fp32 ulps off may round one bf16 step away.
    return 2 ** -7 if dtype == torch.bfloat16 else 1e-5


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=output_rtol(out.dtype), atol=1e-5)


# ------------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q_fp32", "q_bf16"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "{}q{}kv{}d_bs{}".format(*h))
def test_matches_reference(heads, cache_dtype, q_dtype, batch):
    args = make_batch(BATCHES[batch], *heads, cache_dtype, q_dtype)
    assert_matches(at.paged_attention_triton(**args), paged_attention_ref(**args))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
def test_long_decode_contexts_split_over_the_keys_and_combine(cache_dtype, monkeypatch):
    """A decode step whose programs would leave SMs idle walks each context in runs of SPLIT_KEYS keys (3 here: the
    block tables hold 704 keys) and combines them in split order: the reference's values; a context of <= 256 keys
    takes one split and gives the unsplit kernel's bits."""
    batch = [(700, 1), (300, 1), (40, 1), (256, 1), (257, 1)]
    args = make_batch(batch, 4, 2, 32, 8, cache_dtype, torch.bfloat16)
    assert at.decode_splits(len(batch), 2, args["block_tables"].shape[1] * 8) == 3
    out = at.paged_attention_triton(**args)
    assert_matches(out, paged_attention_ref(**args))
    monkeypatch.setattr(at, "SPLIT_TARGET_PROGRAMS", 1)  # every batch fills the device: one program per sequence
    assert at.decode_splits(len(batch), 2, 704) == 1
    unsplit = at.paged_attention_triton(**args)
    assert torch.equal(out[2:4].view(torch.int16), unsplit[2:4].view(torch.int16))


def _quantized_reference(args: dict, scale_fmt: str | None, batch_invariant: bool = False):
    out = at.paged_attention_triton(**args, batch_invariant=batch_invariant)
    return quantize_activation_groups(out.reshape(out.shape[0], -1), scale_fmt=scale_fmt)


@pytest.mark.parametrize("case", ["decode", "mixed", "long", "bi", "full-fp8", "ue8m0"])
def test_the_output_quantized_for_o_proj_in_the_attention_launch(case, monkeypatch):
    """attention_quant (128-wide heads): the attention launch, or its combine on a split decode, writes the output
    as the FP8 o_proj takes it, bit for bit the group quant of the rounded output (E4M3 codes, one scale a head);
    tokens outside every sequence get zero codes and scales; other head sizes quantize after, the same bits."""
    seqs = {"long": [(700, 1), (300, 1), (40, 1)], "mixed": BATCHES["mixed"]}.get(case, BATCHES["decode"])
    cache = torch.bfloat16 if case == "mixed" else FP8_DTYPE
    args = make_batch(seqs, 4, 2, 128, 8, cache, torch.bfloat16)
    args["q"] = torch.cat([args["q"], torch.randn(2, 4, 128).bfloat16()])  # a graph's padding after the last
    if case == "full-fp8":
        args["fp8_q_scale"] = Q_SCALE
    fmt, bi = "ue8m0" if case == "ue8m0" else None, case == "bi"
    launches = []
    monkeypatch.setattr(at, "per_token_group_quant_fp8", lambda *a: launches.append(a) or (_ for _ in ()).throw(
        AssertionError("quantized after the launch")))
    x_q, x_s = at.paged_attention_quant_triton(**args, scale_fmt=fmt, batch_invariant=bi)
    monkeypatch.undo()
    if case == "long":
        assert at.decode_splits(3, 2, args["block_tables"].shape[1] * 8) > 1
    want_q, want_s = _quantized_reference(args, fmt, bi)
    assert x_q.shape == (len(args["q"]), 512) and x_s.shape == (len(args["q"]), 4)
    assert torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(x_s[:-2], want_s[:-2])
    # padding: zero codes (as the group quant's of a zero row) with zero scales (its are 1e-12 / 448): o_proj gives
    # the same zero rows
    assert not x_q[-2:].view(torch.uint8).any() and not x_s[-2:].any()
    small = make_batch(BATCHES["decode"], 4, 2, 64, 8, FP8_DTYPE, torch.bfloat16)
    got = at.paged_attention_quant_triton(**small)
    want = _quantized_reference(small, None)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert got[1].shape == (len(small["q"]), 2)  # 64-wide heads: two to a group


def test_head_dim_not_a_power_of_two():
    args = make_batch(BATCHES["mixed"], 6, 2, 40, 16, FP8_DTYPE, torch.bfloat16)
    assert_matches(at.paged_attention_triton(**args), paged_attention_ref(**args))


def test_tokens_outside_every_sequence_are_zero():
    args = make_batch(BATCHES["chunked_prefill"], 4, 2, 32, 8, torch.bfloat16, torch.bfloat16)
    args["q"] = torch.cat([args["q"], torch.randn(3, 4, 32).bfloat16()])  # padding after the last sequence
    out = at.paged_attention_triton(**args)
    assert_matches(out, paged_attention_ref(**args))
    assert not out[-3:].any()


def test_fp8_cache_decodes_every_code():
    """A one-token context returns its V row times v_scale exactly; the rows hold all 256 E4M3 codes
    (subnormals, +-0, max, NaN)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).view(4, 64)
    v_cache = torch.zeros(4, 16, 1, 64, dtype=FP8_DTYPE)
    v_cache[:, 0, 0] = codes
    out = at.paged_attention_triton(torch.randn(4, 1, 64), torch.zeros_like(v_cache), v_cache,
                                    torch.arange(4, dtype=torch.int32)[:, None],
                                    torch.arange(5, dtype=torch.int32), torch.ones(4, dtype=torch.int32), 0.1,
                                    k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out[:, 0], codes.float() * V_SCALE, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q_fp32", "q_bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "{}q{}kv{}d_bs{}".format(*h))
def test_full_fp8_matches_reference(heads, q_dtype, batch):
    args = make_batch(BATCHES[batch], *heads, FP8_DTYPE, q_dtype)
    out = at.paged_attention_triton(**args, fp8_q_scale=Q_SCALE).float()
    ref = paged_attention_ref(**args, fp8_q_scale=Q_SCALE).float()
    # Both quantise the normalised P (two passes here), but exp and summation order differ in the last
    # float32 bits, so a P * 448 next to an E4M3 rounding tie may round the other way: allow that for a
    # few outputs, by at most one E4M3 step of P * 448 (<= 32, at the top of the range) times max |V|.
    close = torch.isclose(out, ref, rtol=output_rtol(q_dtype), atol=1e-5)
    assert close.float().mean() >= 0.999
    max_v = args["v_cache"].float().abs().max() * V_SCALE
    torch.testing.assert_close(out, ref, rtol=0, atol=float(32 / FP8_MAX * max_v))
    # And the mode does quantise: it differs visibly from FP8-cache attention with exact q and P.
    assert (out - at.paged_attention_triton(**args).float()).abs().max() > 1e-3


def test_full_fp8_needs_an_fp8_cache():
    args = make_batch([(10, 4)], 4, 2, 32, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="needs an FP8 KV cache"):
        at.paged_attention_triton(**args, fp8_q_scale=Q_SCALE)


def test_flashinfer_is_probed_and_says_why_not():
    assert "flashinfer does not import" in at.probe_flashinfer(torch.device("cpu"))


# ------------------------------------------------------------------------------------------ cache write


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["src_fp32", "src_bf16"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["fp32", "bf16", "fp8"])
def test_write_kv_cache_bit_exact(cache_dtype, src_dtype):
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 37, 3, 40, 16, 5  # masked heads and dims
    # Wide dynamic range: saturation beyond 448 * scale, E4M3 subnormals, bf16 rounding ties; plus specials.
    wide = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen)
    wide *= torch.exp(3 * torch.randn(wide.shape, generator=gen))
    wide[0, 0, :6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan")])
    wide[1, 0, :4] = torch.tensor([1e-40, -1e-42, 1 + 2 ** -8, 1 + 3 * 2 ** -8])  # fp32 subnormals, bf16 ties
    k, v = (x.to(src_dtype) for x in wide.chunk(2, dim=1))  # strided views, as sliced from a qkv output
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2::4] = -1  # padding tokens are skipped

    k_cache, v_cache = (random_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, gen) for _ in "kv")
    expected = [k_cache.clone(), v_cache.clone()]
    write_kv_cache_ref(k, v, *expected, slots, K_SCALE, V_SCALE)
    at.write_kv_cache_triton(k, v, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    for got, want in zip((k_cache, v_cache), expected):
        # NaN payloads differ between implementations (torch's own CPU and CUDA casts disagree).
        nan = want.float().isnan()
        assert torch.equal(got.float().isnan(), nan)
        assert torch.equal(got[~nan].view(torch.uint8), want[~nan].view(torch.uint8))


def test_write_kv_cache_without_tokens():
    k_cache = torch.zeros(2, 8, 1, 32, dtype=FP8_DTYPE)
    empty = torch.zeros(0, 1, 32)
    at.write_kv_cache_triton(empty, empty, k_cache, k_cache.clone(), torch.zeros(0, dtype=torch.int64))
    assert not k_cache.float().any()


def test_flashinfer_is_planned_once_a_step(monkeypatch):
    """plan() reads the batch layout on the host: every layer of a step hands the same metadata tensors, so the
    wrapper plans when they change (a new step), not at each layer. A stand-in wrapper counts the calls."""
    calls = []

    class Wrapper:
        def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, *args, **kwargs):
            calls.append(("plan", qo_indptr.tolist(), kv_indices.tolist()))

        def run(self, q, kv, k_scale, v_scale, out):
            calls.append(("run", q.shape[0]))
            out.fill_(1.0)
    wrapper = Wrapper()
    monkeypatch.setattr(at, "_flashinfer_wrapper", lambda device: wrapper)
    q = torch.zeros(5, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)
    step = (torch.tensor([0, 4, 5], dtype=torch.int32), torch.tensor([20, 3], dtype=torch.int32),
            torch.tensor([[1, 2], [3, 0]], dtype=torch.int32))
    for _layer in range(3):
        out = at._flashinfer_attention(q, cache, cache, step[2], step[0], step[1], 0.125, 1.0, 1.0)
    assert out.float().sum() == 5 * 4 * 64
    assert calls == [("plan", [0, 4, 5], [1, 2, 3])] + [("run", 5)] * 3
    next_step = tuple(t.clone() for t in step)
    at._flashinfer_attention(q, cache, cache, next_step[2], next_step[0], next_step[1], 0.125, 1.0, 1.0)
    assert [c[0] for c in calls[4:]] == ["plan", "run"]
