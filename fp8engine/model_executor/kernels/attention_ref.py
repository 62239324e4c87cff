"""Plain-torch paged attention and KV-cache write: the definitions the C++ CPU kernels are tested against.

KV cache (per layer): k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim] in bfloat16,
float32 or float8_e4m3fn. For FP8 caches the real value is stored * k_scale (resp. v_scale); the scales
are ignored for the other dtypes. Slot s of the flat cache is block s // block_size, offset s % block_size.
"""

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """E4M3(clamp(x / scale, -448, 448)); the clamp matters because torch's cast turns overflow into NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return quantize_fp8(x, scale) if dtype == FP8_DTYPE else x.to(dtype)


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes k, v [T, num_kv_heads, head_dim] into their slots in place; slot -1 marks a token to skip."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        cache[blocks, offsets] = _to_cache(src[keep], cache.dtype, scale)


def check_full_fp8(k_cache: torch.Tensor, fp8_q_scale: float | None) -> None:
    if fp8_q_scale is not None and (k_cache.dtype != FP8_DTYPE or fp8_q_scale <= 0):
        raise ValueError("full-FP8 attention needs an FP8 KV cache and a positive fp8_q_scale")


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cache rows of one sequence as float32 [seq_len, num_kv_heads, head_dim]."""
    num_blocks = math.ceil(seq_len / cache.shape[1])
    return cache[block_ids[:num_blocks].long()].flatten(0, 1)[:seq_len].float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, k_scale: float, v_scale: float,
            q_scale: float | None) -> torch.Tensor:
    """Causal attention of the last n positions: q [n, H, D]; k, v [L, H, D] as stored; float32 result."""
    n, seq_len = q.shape[0], k.shape[0]
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))
    if q_scale is None:
        scores = q @ (k * k_scale).mT * scale
    else:
        scores = quantize_fp8(q, q_scale).float() @ k.mT * (q_scale * k_scale * scale)
    positions = torch.arange(seq_len - n, seq_len, device=scores.device)
    scores.masked_fill_(torch.arange(seq_len, device=scores.device) > positions[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if q_scale is None:
        out = probs @ (v * v_scale)
    else:
        # Probabilities lie in [0, 1]: a fixed scale of 1/448 maps them onto the whole E4M3 range.
        out = quantize_fp8(probs * FP8_MAX, 1.0).float() @ v * (v_scale / FP8_MAX)
    return out.transpose(0, 1)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
                        v_scale: float = 1.0, fp8_q_scale: float | None = None) -> torch.Tensor:
    """Varlen causal attention over a paged KV cache, computed in float32.

    q [T, num_heads, head_dim]; sequence s owns query tokens query_start_loc[s]:query_start_loc[s + 1],
    the last ones of its seq_lens[s] positions (their K/V are already in the cache), and reads its cache
    rows through block_tables[s]. Query head h uses kv head h // (num_heads // num_kv_heads).

    fp8_q_scale enables full-FP8 emulation (FP8 cache only): q is quantised to E4M3 with that scale,
    QK^T runs on the FP8 values, and the softmax probabilities are quantised as E4M3(P * 448) before PV,
    all with float32 accumulation. Returns [T, num_heads, head_dim] in q's dtype; tokens outside every
    sequence are zero.
    """
    check_full_fp8(k_cache, fp8_q_scale)
    if k_cache.dtype != FP8_DTYPE:
        k_scale = v_scale = 1.0
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        if begin == end:
            continue
        k, v = (_gather(cache, block_tables[s], seq_len).repeat_interleave(group, dim=1)
                for cache in (k_cache, v_cache))
        out[begin:end] = _attend(q[begin:end], k, v, scale, k_scale, v_scale, fp8_q_scale).to(q.dtype)
    return out
