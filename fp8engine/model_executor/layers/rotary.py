"""Rotary position embedding, cos/sin computed in float32 as in Hugging Face, with its static scalings:
`linear`, `llama3` and `yarn` (transformers' modeling_rope_utils, formula for formula, so the tables match
bit for bit). A scaling changes the inverse frequencies and, for yarn, multiplies cos and sin by an
attention factor; the kernels see only the tables (the kernel set's rotary applies them)."""

import math

import torch
from torch import nn

from fp8engine.model_executor.kernel_set import KernelSet

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    """scaling: the HF rope parameters of a scaled RoPE (with `rope_type`), None for the default."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, dtype: torch.dtype, kernels: KernelSet,
                 scaling: dict | None = None):
        super().__init__()
        self.kernels = kernels
        inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention_factor).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_factor).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] -> rotated (in place on CPU, where the C++ kernel runs)."""
        return self.kernels.rotary(q, k, self.cos, self.sin, positions)


def rope_config(hf_config) -> tuple[float, dict | None]:
    """(rope theta, the scaling parameters or None for default RoPE) of an HF config, old or new style
    (`rope_scaling` + `rope_theta`, or transformers 5's `rope_parameters`); ValueError if unsupported."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params |= getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {params['partial_rotary_factor']!r} (only 1.0)")
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None)
                          or hf_config.max_position_embeddings)
        params.setdefault("max_position_embeddings", hf_config.max_position_embeddings)
    return theta, params


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, float32 [head_dim / 2]; factor on cos and sin) as transformers computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, theta: float, p: dict) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    original = p["original_max_position_embeddings"]
    if factor is None:
        factor = p["max_position_embeddings"] / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    low = _correction_dim(beta_fast, dim, theta, original)
    high = _correction_dim(beta_slow, dim, theta, original)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_positions: int) -> float:
    return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))
