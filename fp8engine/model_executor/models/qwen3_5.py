"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: hybrid models whose decoder layers alternate Gated DeltaNet
(GDN, linear attention with a fixed-size state per sequence, layers/gated_delta.py) with gated full attention,
as transformers' `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` and `Qwen3NextForCausalLM` compute them:

- `layer_types` says which layer is which ("linear_attention" / "full_attention");
- gated attention: q_proj yields per head [q | gate]; q and k take a per-head RMSNorm, then RoPE on the first
  `partial_rotary_factor` of each head (the multimodal RoPE sections coincide on text); the output is
  o_proj(attn * sigmoid(gate));
- every RMSNorm but the GDN's gated one is zero-centred: norm(x) * (1 + w) in float32, rounded once;
- MoE (Qwen3.5-MoE in every layer, Qwen3-Next by `decoder_sparse_step` / `mlp_only_layers`): the Qwen3-MoE
  router and experts plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

The released Qwen3.5 checkpoints are vision-language: their text weights are under `model.language_model.`,
beside `model.visual.*` and `mtp.*`, which a text engine does not use; both prefixes of the text weights load
and update (`hf_alias`), and the others are skipped (`ignored_prefixes`, said once at load).
"""

import torch
from torch import nn

from fp8engine.model_executor.kernels.gated_delta_ref import sigmoid
from fp8engine.model_executor.layers.attention import Attention, AttentionMetadata
from fp8engine.model_executor.layers.embedding import FP8LMHead, LMHead, VocabEmbedding
from fp8engine.model_executor.layers.gated_delta import GatedDeltaNet
from fp8engine.model_executor.layers.linear import Linear
from fp8engine.model_executor.layers.moe import SparseMoeBlock
from fp8engine.model_executor.layers.rotary import rope_frequencies
from fp8engine.model_executor.models.llama import MLP, LinearFactory, head_dim
from fp8engine.model_executor.models.qwen3_moe import is_sparse_layer

LANGUAGE_MODEL_PREFIX = "model.language_model."
LAYER_TYPES = ("linear_attention", "full_attention")


def text_config(hf_config):
    """The text part of a released vision-language config (`qwen3_5`, `qwen3_5_moe`), the config itself
    otherwise. The wrapper's tie_word_embeddings decides, as transformers' ForConditionalGeneration ties by it."""
    if getattr(hf_config, "model_type", None) not in ("qwen3_5", "qwen3_5_moe"):
        return hf_config
    text = hf_config.get_text_config()
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    return text


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm with weight w stored zero-centred: norm(x) * (1 + w), statistics and product in float32, rounded once
    (transformers' Qwen3_5RMSNorm). The residual add, when fused in, runs in the model dtype as the decoder's."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward_float32(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        xf = (x if residual is None else x + residual).float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(normed, new residual), as RMSNorm.forward."""
        x = x if residual is None else x + residual
        return self.forward_float32(x).to(x.dtype), x


class PartialRotary(nn.Module):
    """RoPE on the first `rotary_dim` features of each head (the rest pass), in the model dtype as transformers
    applies it: x * cos + rotate_half(x) * sin with cos/sin rounded to the model dtype."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, dtype: torch.dtype):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq, _ = rope_frequencies(rotary_dim, theta)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r, half = self.rotary_dim, self.rotary_dim // 2
        rot = x[..., :r]
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, x[..., r:]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


def rope_of(cfg) -> tuple[float, float]:
    """(theta, partial rotary factor) of a Qwen3.5 / Qwen3-Next config; ValueError for a scaled RoPE."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    params |= getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} for {cfg.model_type!r} (only 'default')")
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
    return theta, factor


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj gives [q | gate] per head (fused here with k and v as qkv_proj,
    HF's row order kept), per-head zero-centred q/k norms, partial RoPE, paged attention, then
    o_proj(attn * sigmoid(gate))."""

    def __init__(self, cfg, layer_idx: int, make_linear: LinearFactory, rotary: PartialRotary):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim(cfg)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = make_linear(cfg.hidden_size, [2 * q_size, kv_size, kv_size], bias)
        self.o_proj = make_linear(q_size, [cfg.hidden_size], bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps, make_linear.dtype)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps, make_linear.dtype)
        self.rotary = rotary
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads,
                              self.head_dim, make_linear.kernels)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qg, k, v = self.qkv_proj(x).split([2 * q_size, kv_size, kv_size], dim=-1)
        qg = qg.reshape(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, q_size)
        q = self.q_norm(q)[0]
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))[0]
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.contiguous(), k.contiguous(), v.reshape(t, self.num_kv_heads, d).contiguous(), meta)
        return self.o_proj(out * sigmoid(gate.float()).to(out.dtype))


class SharedExpertMoeBlock(SparseMoeBlock):
    """The Qwen3-MoE block (router + routed experts) plus a shared expert, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg, make_linear: LinearFactory):
        super().__init__(cfg, make_linear.dtype, make_linear.kernels, make_linear.fp8, make_linear.scale_fmt)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, make_linear)
        self.shared_expert_gate = Linear(cfg.hidden_size, [1], make_linear.dtype, make_linear.kernels)

    def partial(self, x: torch.Tensor, meta) -> torch.Tensor:
        """The routed experts' share and the shared expert's, scaled (under tensor parallelism each rank's slice of
        both, added over the ranks by the block's reduce)."""
        routed = super().partial(x, meta)
        shared = self.shared_expert(x, meta)
        gate = sigmoid(self.shared_expert_gate(x).float()).to(x.dtype)
        return routed + gate * shared


class HybridDecoderLayer(nn.Module):
    """A decoder layer whose token mixer is a GDN layer (`linear_attn`) or gated attention (`self_attn`)."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, cfg, dtype: torch.dtype):
        super().__init__()
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, x, residual, meta):
        x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, meta) if self.is_linear else self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, meta), residual


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 dense (`qwen3_5_text`, and the text part of `qwen3_5`)."""

    hybrid = True
    fused_gdn_names = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    ignored_prefixes = ("model.visual.", "mtp.")

    def __init__(self, cfg, make_linear: LinearFactory, max_positions: int, recurrent: bool = False):
        super().__init__()
        layer_types = list(cfg.layer_types)
        if len(layer_types) != cfg.num_hidden_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"unsupported layer_types {layer_types!r} for {cfg.model_type!r}: expected "
                             f"{cfg.num_hidden_layers} of {list(LAYER_TYPES)}")
        if "full_attention" not in layer_types:
            raise ValueError(f"unsupported: a {cfg.model_type!r} config without a full-attention layer")
        dtype = make_linear.dtype
        theta, factor = rope_of(cfg)
        rotary_dim = int(head_dim(cfg) * factor)
        rotary = PartialRotary(rotary_dim, max_positions, theta, dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        layers = []
        for i, kind in enumerate(layer_types):
            mixer = (GatedDeltaNet(cfg, make_linear, recurrent, self.fused_gdn_names) if kind == "linear_attention"
                     else GatedAttention(cfg, i, make_linear, rotary))
            layers.append(HybridDecoderLayer(mixer, self.make_mlp(cfg, i, make_linear), cfg, dtype))
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        if make_linear.lm_head_fp8:
            self.lm_head = FP8LMHead(cfg.hidden_size, cfg.vocab_size, dtype, make_linear.kernels,
                                     make_linear.scale_fmt)
        else:
            self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, make_linear.kernels, tied_to=tied)
        self.fused = None  # decode steps' layers in one C++ call (fused_decoder.HybridDecoder), set by the runner
        self.vocab_gather = None  # tensor parallelism: as LlamaForCausalLM's (tensor_parallel.shard_model)

    def make_mlp(self, cfg, layer_idx: int, make_linear: LinearFactory) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size, make_linear)

    @staticmethod
    def hf_alias(name: str) -> str:
        """A text weight's name as the engine keys it: the vision-language prefix taken to the causal LM's."""
        return "model." + name[len(LANGUAGE_MODEL_PREFIX):] if name.startswith(LANGUAGE_MODEL_PREFIX) else name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        if self.fused is not None and self.fused.usable(x.shape[0], meta):  # a decode step in one C++ call
            x, residual = self.fused(x, positions, meta)
        else:
            for layer in self.model.layers:
                x, residual = layer(positions, x, residual, meta)
        if self.lm_head.fp32:
            return self.model.norm.forward_float32(x, residual)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return logits if self.vocab_gather is None else self.vocab_gather(logits)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def moe_blocks(self) -> list[nn.Module]:
        return [layer.mlp for layer in self.model.layers if hasattr(layer.mlp, "routed")]


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE (`qwen3_5_moe_text`, and the text part of `qwen3_5_moe`): the MoE block in every layer, its
    router's top-k always renormalised."""

    def make_mlp(self, cfg, layer_idx: int, make_linear: LinearFactory) -> nn.Module:
        if not hasattr(cfg, "norm_topk_prob"):
            cfg.norm_topk_prob = True
        return SharedExpertMoeBlock(cfg, make_linear)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next (`qwen3_next`): GDN projections fused per key head in its checkpoints, the MoE block in the
    layers Qwen3-MoE's rule picks and a dense MLP in the others."""

    fused_gdn_names = True

    def make_mlp(self, cfg, layer_idx: int, make_linear: LinearFactory) -> nn.Module:
        if is_sparse_layer(cfg, layer_idx):
            return SharedExpertMoeBlock(cfg, make_linear)
        return MLP(cfg.hidden_size, cfg.intermediate_size, make_linear)
