"""The C++ paged-attention and cache-write kernels (csrc/paged_attention.cpp) against the torch reference,
and the reference itself against SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F

from fp8engine.model_executor import kernel_set
from fp8engine.model_executor.kernels import attention_ref
from fp8engine.model_executor.kernels.attention_cpu import paged_attention_cpu, write_kv_cache_cpu
from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops
from fp8engine.model_executor.kernels.attention_ref import (FP8_DTYPE, FP8_MAX, paged_attention_ref,
                                                            write_kv_cache_ref)
from tests.conftest import cpu_kernels, ops_without, require_cpu_op
from tests import attention_batches
from tests.attention_batches import K_SCALE, Q_SCALE, V_SCALE, random_cache

BLOCK_SIZE = 16


def make_batch(seqs, num_heads, num_kv_heads, head_dim, cache_dtype, q_dtype=torch.float32):
    return attention_batches.make_batch(seqs, num_heads, num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype, q_dtype)

# (num_heads, num_kv_heads, head_dim); 72 takes the generic (non-unrolled, masked-tail) path.
HEADS = [(9, 3, 64), (8, 2, 128), (6, 2, 72)]
CACHE_DTYPES = [torch.float32, torch.bfloat16, FP8_DTYPE]
# Per sequence: (context length including the new tokens, new query tokens).
BATCHES = {
    "decode": [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1), (255, 1)],
    "chunked_prefill": [(70, 21), (48, 48), (33, 16)],
    "mixed": [(40, 40), (100, 1), (130, 23), (50, 0), (17, 1), (5, 5)],
    # Few long sequences: the keys are split into partitions and merged; the prefill chunk straddles
    # a partition boundary, so some of its rows see no key of the last partition.
    "split_kv": [(2000, 1), (1500, 1), (520, 20)],
}


@pytest.fixture(scope="module")
def ops():
    require_cpu_op("paged_attention")
    return load_cpu_ops()


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.bfloat16:
        # Both round an fp32 result to bf16; values a few fp32 ulps apart may land one bf16 step apart.
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def assert_full_fp8_matches(out: torch.Tensor, ref: torch.Tensor, args: dict) -> None:
    """A probability a few fp32 ulps from an E4M3 rounding tie may round the other way in one of the two
    (different exp and summation order); allow that for a few outputs, by at most one E4M3 step of
    P * 448 (<= 32, at the top of the range) times the largest |V|."""
    close = torch.isclose(out, ref, rtol=1e-5, atol=1e-5).all(-1)  # per (token, head) row: a flip moves a whole row
    assert close.float().mean() >= 0.99  # mixed batch, 9 heads: 1 row of 414 flipped on AVX2 (P * 448 at a tie)
    max_v = args["v_cache"].float().abs().max() * args["v_scale"]
    torch.testing.assert_close(out, ref, rtol=0, atol=float(32 / FP8_MAX * max_v))


# ------------------------------------------------------------------------------------------ reference


@pytest.mark.parametrize("q_len", [45, 10, 1])
def test_reference_matches_sdpa(q_len):
    """One contiguous sequence: the reference equals causal SDPA, and a chunk of the last q_len queries
    equals the last q_len rows of the full-sequence result."""
    gen = torch.Generator().manual_seed(1)
    seq_len, num_heads, num_kv_heads, head_dim = 45, 9, 3, 64
    q = torch.randn(seq_len, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(seq_len, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    num_blocks = math.ceil(seq_len / BLOCK_SIZE)

    def paged(x: torch.Tensor) -> torch.Tensor:
        cache = torch.zeros(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim)
        cache[:seq_len] = x
        return cache.view(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)

    scale = head_dim ** -0.5
    ref = paged_attention_ref(q[-q_len:], paged(k), paged(v), torch.arange(num_blocks, dtype=torch.int32)[None],
                              torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
                              scale)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          scale=scale, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(ref, sdpa[-q_len:], rtol=1e-5, atol=1e-5)


def test_without_the_kernel_the_kernel_set_runs_the_reference(monkeypatch):
    args = make_batch(BATCHES["mixed"], 9, 3, 64, FP8_DTYPE)
    want = paged_attention_ref(**args)
    monkeypatch.setattr(kernel_set.cpu_ops, "load_cpu_ops", ops_without("paged_attention", "write_kv_cache"))
    calls = []
    monkeypatch.setattr(attention_ref, "paged_attention_ref",
                        lambda *a, **k: calls.append("ref") or paged_attention_ref(*a, **k))
    kernels = cpu_kernels()
    assert kernels.names["attention"] == "torch"
    assert torch.equal(kernels.paged_attention(**args), want)
    assert calls == ["ref"]


# ------------------------------------------------------------------------------------------ kernel


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q_fp32", "q_bf16"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "{}q{}kv{}d".format(*h))
def test_kernel_matches_reference(ops, heads, cache_dtype, q_dtype, batch):
    args = make_batch(BATCHES[batch], *heads, cache_dtype, q_dtype)
    assert_matches(paged_attention_cpu(**args), paged_attention_ref(**args))


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q_fp32", "q_bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "{}q{}kv{}d".format(*h))
def test_full_fp8_matches_reference(ops, heads, q_dtype, batch):
    args = make_batch(BATCHES[batch], *heads, FP8_DTYPE, q_dtype)
    out = paged_attention_cpu(**args, fp8_q_scale=Q_SCALE).float()
    assert_full_fp8_matches(out, paged_attention_ref(**args, fp8_q_scale=Q_SCALE).float(), args)
    # And the mode does quantise: it differs visibly from FP8-cache attention with exact q and P.
    assert (out - paged_attention_ref(**args).float()).abs().max() > 1e-3


def test_fp8_cache_decodes_every_code(ops):
    """A one-token context returns its V row times v_scale exactly; the rows hold all 256 E4M3 codes
    (subnormals, +-0, max, NaN)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).view(2, 128)
    v_cache = torch.zeros(2, BLOCK_SIZE, 1, 128, dtype=FP8_DTYPE)
    v_cache[:, 0, 0] = codes
    out = paged_attention_cpu(torch.randn(2, 1, 128), torch.zeros_like(v_cache), v_cache,
                              torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
                              torch.ones(2, dtype=torch.int32), 0.1, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out[:, 0], codes.float() * V_SCALE, rtol=0, atol=0, equal_nan=True)


def test_independent_of_thread_count(ops):
    args = make_batch(BATCHES["split_kv"] + BATCHES["mixed"], 9, 3, 64, torch.bfloat16, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = paged_attention_cpu(**args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, paged_attention_cpu(**args))


def test_rejects_bad_inputs(ops):
    args = make_batch([(10, 4)], 9, 3, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="shorter than its 4 query tokens"):
        paged_attention_cpu(**{**args, "seq_lens": torch.tensor([3], dtype=torch.int32)})
    with pytest.raises(ValueError, match="needs an FP8 KV cache"):
        paged_attention_cpu(**args, fp8_q_scale=Q_SCALE)
    with pytest.raises(RuntimeError, match="needs an FP8 KV cache"):
        ops.paged_attention(*args.values(), Q_SCALE)


# ------------------------------------------------------------------------------------------ cache write


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["src_fp32", "src_bf16"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["fp32", "bf16", "fp8"])
def test_write_kv_cache_bit_exact(ops, cache_dtype, src_dtype):
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_kv_heads, head_dim, num_blocks = 37, 3, 40, 5  # rows of 120: a masked tail
    # Wide dynamic range: saturation beyond 448 * scale, E4M3 subnormals, bf16 rounding ties; plus specials.
    wide = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen)
    wide *= torch.exp(3 * torch.randn(wide.shape, generator=gen))
    wide[0, 0, :5] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
    k, v = (x.to(src_dtype) for x in wide.chunk(2, dim=1))  # strided views, as sliced from a qkv output
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens are skipped

    k_cache, v_cache = (random_cache(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, cache_dtype, gen) for _ in "kv")
    expected = [k_cache.clone(), v_cache.clone()]
    write_kv_cache_ref(k, v, *expected, slots, K_SCALE, V_SCALE)
    write_kv_cache_cpu(k, v, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    for got, want in zip((k_cache, v_cache), expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_write_kv_cache_rejects_slots_past_the_cache(ops):
    k_cache = torch.zeros(2, BLOCK_SIZE, 1, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="exceeds the cache"):
        write_kv_cache_cpu(k, k, k_cache, k_cache.clone(), torch.tensor([2 * BLOCK_SIZE]))


@pytest.mark.parametrize("block_size", [8, 24])
@pytest.mark.parametrize("fp8_q_scale", [None, Q_SCALE], ids=["fp8_kv", "full_fp8"])
def test_block_sizes_other_than_16(ops, block_size, fp8_q_scale):
    """Chunks end at block boundaries too (full FP8 keeps every chunk's scores between its passes)."""
    args = attention_batches.make_batch(BATCHES["mixed"] + [(300, 1)], 9, 3, 64, block_size, FP8_DTYPE,
                                        torch.bfloat16)
    out = paged_attention_cpu(**args, fp8_q_scale=fp8_q_scale)
    ref = paged_attention_ref(**args, fp8_q_scale=fp8_q_scale)
    if fp8_q_scale is None:  # an FP8 cache read exactly: as close as any other cache dtype, everywhere
        assert_matches(out, ref)
    else:
        assert_full_fp8_matches(out.float(), ref.float(), args)
