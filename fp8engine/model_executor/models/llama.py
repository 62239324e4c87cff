"""Llama (and, with per-head q/k RMSNorm, Qwen3 dense) written for paged attention.

Parameter names follow Hugging Face, with q/k/v fused into `qkv_proj` and gate/up into
`gate_up_proj`; `packed_modules` tells the weight loader where each HF tensor lands.
"""

import torch
from torch import nn

from fp8engine.model_executor.layers.activation import silu_and_mul
from fp8engine.model_executor.layers.attention import Attention, AttentionMetadata
from fp8engine.model_executor.layers.embedding import LMHead, VocabEmbedding
from fp8engine.model_executor.layers.linear import Linear
from fp8engine.model_executor.layers.norm import RMSNorm
from fp8engine.model_executor.layers.rotary import RotaryEmbedding, rope_theta


class LinearFactory:
    """Builds linear layers in the model dtype, or FP8 when a block-FP8 kernel is given."""

    def __init__(self, dtype: torch.dtype, fp8_fn=None, scale_fmt: str | None = None):
        self.dtype, self.fp8_fn, self.scale_fmt = dtype, fp8_fn, scale_fmt

    def __call__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> Linear:
        return Linear(in_features, shard_sizes, self.dtype, bias, self.fp8_fn, self.scale_fmt)


class DecoderAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, make_linear: LinearFactory, rotary: RotaryEmbedding,
                 qk_norm: bool):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = make_linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias)
        self.o_proj = make_linear(q_size, [cfg.hidden_size], bias)
        self.rotary = rotary
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads,
                              self.num_kv_heads, self.head_dim)
        dtype = make_linear.dtype
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous(), meta))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, make_linear: LinearFactory, rotary: RotaryEmbedding,
                 qk_norm: bool):
        super().__init__()
        dtype = make_linear.dtype
        self.self_attn = DecoderAttention(cfg, layer_idx, make_linear, rotary, qk_norm)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = make_linear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.mlp.down_proj = make_linear(cfg.intermediate_size, [cfg.hidden_size])
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, x, residual, meta):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp.down_proj(silu_and_mul(self.mlp.gate_up_proj(x)))
        return x, residual


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg, make_linear: LinearFactory, max_positions: int):
        super().__init__()
        dtype = make_linear.dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(head_dim, max_positions, rope_theta(cfg), dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.model.layers = nn.ModuleList(
            DecoderLayer(cfg, i, make_linear, rotary, self.qk_norm) for i in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
