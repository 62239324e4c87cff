"""Tiny random Hugging Face checkpoints for the model tests (a `transformers` config, a fixed seed, BF16
safetensors and the default model's tokenizer, in a directory the engine and transformers both load), and
random weights for a lone MoE layer."""

import pytest
import torch
import transformers

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1)
ROPE = {  # small original contexts, so the scalings change frequencies the short prompts exercise
    "llama3": dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128),
}
MOE = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, norm_topk_prob=True,
           num_hidden_layers=3, head_dim=32)

# Hybrid (issue 63): 3 GDN layers to 1 gated-attention layer, set explicitly; partial RoPE (a quarter of each head)
HYBRID = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                   mrope_section=[2, 1, 1]))
HYBRID_MOE = dict(HYBRID, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                  shared_expert_intermediate_size=64)
HYBRID_CONFIGS = {"Qwen3_5": "Qwen3_5TextConfig", "Qwen3_5Moe": "Qwen3_5MoeTextConfig"}

ARCHS = {
    "qwen2-tied": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=False)),
    "llama-llama3": ("Llama", dict(rope_parameters=ROPE["llama3"])),
    "llama-linear": ("Llama", dict(rope_parameters=ROPE["linear"])),
    "llama-yarn": ("Llama", dict(rope_parameters=ROPE["yarn"], attention_bias=True, mlp_bias=True)),
    "qwen3_moe": ("Qwen3Moe", dict(MOE)),
    # MoE blocks in layers 3 and 5 only (every 2nd layer, minus layer 1): dense MLPs between them
    "qwen3_moe-sparse": ("Qwen3Moe", dict(MOE, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[1],
                                          num_hidden_layers=6)),
    "qwen3_5": ("Qwen3_5", dict(HYBRID)),
    "qwen3_5_moe": ("Qwen3_5Moe", dict(HYBRID_MOE)),
    # a dense MLP in layer 1 (mlp_only_layers), the MoE block with its shared expert in the others
    "qwen3_next": ("Qwen3Next", dict(HYBRID_MOE, norm_topk_prob=True, mlp_only_layers=[1], rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))),
}


def hf_config(arch: str, tokenizer, **overrides):
    family, options = ARCHS[arch]
    cls = getattr(transformers, HYBRID_CONFIGS.get(family, f"{family}Config"))
    return cls(**(dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id) | SHAPE | options | overrides))


def save_tiny(arch: str, out_dir, tokenizer, seed: int = 1234, **overrides) -> str:
    """A random model of `arch` (ARCHS) saved in BF16 under out_dir; returns the directory. Biases and norm
    weights, which transformers initialises to 0 and 1, get noise too, so a misplaced one shows."""
    cfg = hf_config(arch, tokenizer, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer):
    """arch -> the directory of its tiny model, saved once per session."""
    dirs = {}

    def get(arch: str) -> str:
        if arch not in dirs:
            dirs[arch] = save_tiny(arch, tmp_path_factory.mktemp(arch), tokenizer)
        return dirs[arch]
    return get


def load_random_experts(layer, seed: int = 0) -> None:
    """Random weights for a FusedMoE, shard by shard through its views (quantized when the layer is FP8)."""
    from fp8engine.model_executor.layers.moe import PROJECTIONS
    from fp8engine.weights.quant import quantize_weight_into
    gen = torch.Generator().manual_seed(seed)
    for e in range(layer.num_experts):
        for proj in PROJECTIONS:
            weight, scale = layer.shard_views(e, proj)
            src = torch.randn(weight.shape, generator=gen) * 0.05
            if scale is None:
                weight.copy_(src)
            else:
                quantize_weight_into(src, weight, scale)
