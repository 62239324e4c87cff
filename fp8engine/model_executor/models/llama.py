"""Llama and its close relatives (Qwen2: q/k/v bias; Qwen3: per-head q/k RMSNorm) written for paged attention.

Parameter names follow Hugging Face, with q/k/v fused into `qkv_proj` and gate/up into
`gate_up_proj`; `packed_modules` tells the weight loader where each HF tensor lands. A subclass changes
the attention biases, the q/k norm or the MLP of a layer (`make_mlp`).
"""

import torch
from torch import nn

from fp8engine.model_executor.kernel_set import KernelSet
from fp8engine.model_executor.layers.attention import Attention, AttentionMetadata
from fp8engine.model_executor.layers.embedding import FP8LMHead, LMHead, VocabEmbedding
from fp8engine.model_executor.layers.linear import Linear
from fp8engine.model_executor.layers.norm import RMSNorm
from fp8engine.model_executor.layers.rotary import RotaryEmbedding, rope_config


class LinearFactory:
    """Builds the model's linear layers: FP8 when the kernel set has a block-FP8 linear, else the model dtype, each
    with LoRA buffers of lora_rank when that is > 0. Every layer of the model is given the same kernel set.
    lm_head_fp8: the LM head is an FP8 linear too (EngineConfig.lm_head_fp8)."""

    def __init__(self, dtype: torch.dtype, kernels: KernelSet, scale_fmt: str | None = None, lora_rank: int = 0,
                 lm_head_fp8: bool = False):
        self.dtype, self.kernels, self.scale_fmt, self.lora_rank = dtype, kernels, scale_fmt, lora_rank
        self.fp8 = kernels.fp8_linear is not None
        self.lm_head_fp8 = lm_head_fp8 and self.fp8

    def __call__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> Linear:
        return Linear(in_features, shard_sizes, self.dtype, self.kernels, bias, self.fp8, self.scale_fmt,
                      self.lora_rank)


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def check_full_attention(cfg) -> None:
    """Sliding-window attention is not implemented: refuse a config whose layers use it."""
    layer_types = getattr(cfg, "layer_types", None)
    sliding = ("sliding_attention" in layer_types if layer_types is not None
               else bool(getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)))
    if sliding:
        raise ValueError(f"unsupported: {cfg.model_type!r} config with sliding-window attention layers")


class DecoderAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, make_linear: LinearFactory, rotary: RotaryEmbedding,
                 qk_norm: bool, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim(cfg)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = make_linear(cfg.hidden_size, [q_size, kv_size, kv_size], qkv_bias)
        self.o_proj = make_linear(q_size, [cfg.hidden_size], o_bias)
        self.rotary = rotary
        kernels, dtype = make_linear.kernels, make_linear.dtype
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads,
                              self.head_dim, kernels)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, kernels) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, kernels) if qk_norm else None

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

    def forward_fused(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      meta: AttentionMetadata) -> torch.Tensor:
        """forward after qkv_proj on the fused path: q/k norm, RoPE (the step's cos / sin rows) and the cache write in
        one kernel (kernels.qkv_epilogue), then attention — which quantizes its output for an FP8 o_proj itself
        (kernels.attention_quant) — and o_proj, which may return a K split's float32 partials (the fused
        post-attention norm after it adds them)."""
        attn, norms = self.attn, (None, None, 0.0)
        if self.q_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = attn.kernels.qkv_epilogue(qkv, *rope, *norms, attn.k_cache, attn.v_cache, meta.slot_mapping, attn.k_scale,
                                      attn.v_scale, self.num_heads, self.num_kv_heads, self.head_dim)
        o = self.o_proj
        if o.is_fp8 and attn.kernels.attention_quant is not None:
            x_q, x_scale = attn.attend_quantized(q, meta, o.scale_fmt)
            return o.forward_quantized(x_q, x_scale, qkv.dtype, partials=True)
        return o(attn.attend(q, meta))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, make_linear: LinearFactory, bias: bool = False):
        super().__init__()
        self.gate_up_proj = make_linear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = make_linear(intermediate_size, [hidden_size], bias)
        self.silu_and_mul = make_linear.kernels.silu_and_mul

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, attn: DecoderAttention, mlp: nn.Module, cfg, dtype: torch.dtype, kernels: KernelSet):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)

    def forward(self, positions, x, residual, meta):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, meta), residual

    def fusable(self, kernels: KernelSet) -> bool:
        """Whether forward_fused can run this layer: the kernel set has the fused kernels (CUDA), the MLP is dense, no
        linear has a LoRA adapter, and a head is a power of two of at most 128 lanes."""
        attn = self.self_attn
        if kernels.norm_quant is None or not isinstance(self.mlp, MLP):
            return False
        linears = (attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        d = attn.head_dim
        return all(lin.lora is None for lin in linears) and d <= 128 and d & (d - 1) == 0

    def forward_fused(self, positions, x, residual, meta, rope, partials: bool = False):
        """forward in the fused kernels (kernels/fused_triton.py): each norm with the residual add and the next FP8
        linear's activation quant in one launch, the qkv epilogue, silu * mul with down_proj's quant; the same
        (x, residual) in and out as forward, which runs instead while the KV scales are calibrated (its observer
        reads q, k and v). x may be the float32 K-split partials of the layer before, and with `partials` (the next
        consumer is a fused norm) this layer's down_proj may return its own."""
        attn = self.self_attn
        if attn.attn.observer is not None:
            return self.forward(positions, summed_partials(x, self.input_layernorm.weight.dtype), residual, meta)
        kernels = attn.attn.kernels
        qkv, residual = _norm_linear(kernels, self.input_layernorm, x, residual, attn.qkv_proj)
        x = attn.forward_fused(qkv, rope, meta)
        h, residual = _norm_linear(kernels, self.post_attention_layernorm, x, residual, self.mlp.gate_up_proj)
        down = self.mlp.down_proj
        a, a_scale = kernels.silu_mul_quant(h, down.is_fp8, down.scale_fmt)
        return (down.forward_quantized(a, a_scale, h.dtype, partials) if down.is_fp8 else down(a)), residual


def _norm_linear(kernels: KernelSet, norm: RMSNorm, x, residual, linear: Linear):
    """(linear(norm(x + residual)), x + residual) by the fused norm, which also quantizes for an FP8 linear."""
    x_q, x_scale, residual, normed = kernels.norm_quant(x, residual, norm.weight, norm.eps, linear.is_fp8,
                                                        not linear.is_fp8, linear.scale_fmt)
    out_dtype = norm.weight.dtype
    return (linear.forward_quantized(x_q, x_scale, out_dtype) if linear.is_fp8 else linear(normed)), residual


def summed_partials(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x itself, or float32 K-split partials [S, T, H] added in order and rounded to the model dtype once (as the
    fused norm adds them) for a layer that does not run fused."""
    if x.dim() != 3:
        return x
    total = x[0]
    for part in x[1:]:
        total = total + part
    return total.to(dtype)


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg, make_linear: LinearFactory, max_positions: int):
        super().__init__()
        check_full_attention(cfg)
        dtype, kernels = make_linear.dtype, make_linear.kernels
        theta, scaling = rope_config(cfg)
        rotary = RotaryEmbedding(head_dim(cfg), max_positions, theta, dtype, kernels, scaling)
        qkv_bias, o_bias = self.attention_biases(cfg)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.model.layers = nn.ModuleList(
            DecoderLayer(DecoderAttention(cfg, i, make_linear, rotary, self.qk_norm, qkv_bias, o_bias),
                         self.make_mlp(cfg, i, make_linear), cfg, dtype, kernels)
            for i in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        # the layers forward_fused runs (CUDA: kernels/fused_triton.py), and the step's RoPE rows they read
        self.fused_layers = [layer.fusable(kernels) for layer in self.model.layers]
        self.rotary = rotary
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        if make_linear.lm_head_fp8:  # its own E4M3 copy; a tied embedding stays in the model dtype
            self.lm_head = FP8LMHead(cfg.hidden_size, cfg.vocab_size, dtype, kernels, make_linear.scale_fmt)
        else:
            self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, kernels, tied_to=tied)
        # the decoder layers in one C++ call, with the embedding lookup and final norm unless the head is float32
        # (model_executor/fused_decoder.py), set by the runner
        self.fused = None
        # tensor parallelism: each rank's head computes its vocabulary rows' logits, which this puts side by side on
        # rank 0 (tensor_parallel.shard_model; it returns None on the other ranks)
        self.vocab_gather = None

    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        """(q/k/v projections have a bias, o_proj has one)."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    def make_mlp(self, cfg, layer_idx: int, make_linear: LinearFactory) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size, make_linear, bool(getattr(cfg, "mlp_bias", False)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        fused = self.fused if self.fused is not None and self.fused.usable() else None
        if fused is not None and not self.lm_head.fp32 and not self.model.embed_tokens.in_layout:
            return fused.from_tokens(input_ids, positions, meta)
        x = self.model.embed_tokens(input_ids)
        if fused is not None:
            x, residual = fused(x, positions, meta)
        elif any(self.fused_layers):
            return self._forward_fused(positions, x, meta)
        else:
            residual = None
            for layer in self.model.layers:
                x, residual = layer(positions, x, residual, meta)
        if self.lm_head.fp32:  # float32 from the final norm on: the head's input is not rounded to bf16
            return self.model.norm.forward_float32(x, residual)
        return self.model.norm(x, residual)[0]

    def _forward_fused(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers on the fused path (the RoPE rows gathered once a step) and the final norm, fused too
        unless the head is float32."""
        rope = (self.rotary.cos[positions], self.rotary.sin[positions])
        residual = None
        # a fused layer may hand K-split partials to the next fused norm: the next layer's, or the final one
        takes_partials = self.fused_layers[1:] + [not self.lm_head.fp32]
        for layer, fusable, partials in zip(self.model.layers, self.fused_layers, takes_partials):
            x, residual = (layer.forward_fused(positions, x, residual, meta, rope, partials) if fusable
                           else layer(positions, x, residual, meta))
        norm = self.model.norm
        if self.lm_head.fp32:
            return norm.forward_float32(x, residual)
        return norm.kernels.norm_quant(x, residual, norm.weight, norm.eps, False, True)[3]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return logits if self.vocab_gather is None else self.vocab_gather(logits)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def moe_blocks(self) -> list[nn.Module]:
        """The MoE blocks in layer order (the `num_moe_layers` axis of routed experts); none in a dense model."""
        return [layer.mlp for layer in self.model.layers if hasattr(layer.mlp, "routed")]
