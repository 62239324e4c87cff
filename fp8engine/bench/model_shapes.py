"""Named model shapes for the bench (`--model NAME`): a released model's sizes with seeded random weights
(load_format="dummy": nothing is downloaded or written but its config and the default model's tokenizer). Their
vocabulary is that tokenizer's 49,152, so the LM head is a smaller share of a step than in the released models.

qwen3.5-2b-shape: Qwen3.5-2B's published sizes (24 layers: 18 Gated DeltaNet + 6 gated attention, hidden 2048, MLP
6144, 8 query / 2 KV heads of 256, 16 / 16 linear heads of 128, tied embeddings; 248,320 tokens released).
qwen3.5-35b-a3b-4l-shape: one block of Qwen3.5-35B-A3B (Qwen3.6-35B-A3B's too): its per-layer sizes (hidden 2048;
256 experts of 512, top-8 + a shared expert of 512; 16 / 32 linear heads of 128; 16 query / 2 KV heads of 256) with 4
layers (3 Gated DeltaNet + 1 gated attention) of its 40, so a CPU holds it (3.6 B parameters: 7.1 GB BF16); untied,
as released (248,320 tokens there).
qwen3-0.6b-shape: Qwen3-0.6B's (28 layers, hidden 1024, MLP 3072, 16 query / 8 KV heads of 128, q/k norms, tied
embeddings; 151,936 tokens released), a dense model two or four tensor-parallel ranks split (docs/scale-out.md)."""

from filelock import FileLock

from fp8engine.envs import cache_root
from fp8engine.weights.default_model import default_model_path

SHAPES = {  # name -> (transformers config class, its sizes)
    "qwen3.5-2b-shape": ("Qwen3_5TextConfig", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
        architectures=["Qwen3_5ForCausalLM"])),
    "qwen3.5-35b-a3b-4l-shape": ("Qwen3_5MoeTextConfig", dict(
        hidden_size=2048, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
        architectures=["Qwen3_5MoeForCausalLM"])),
    "qwen3-0.6b-shape": ("Qwen3Config", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0), architectures=["Qwen3ForCausalLM"])),
}


def is_shape(model: str) -> bool:
    return model in SHAPES


def shape_path(name: str) -> str:
    """The directory of a named shape: config.json and the tokenizer, written once."""
    import transformers
    from transformers import AutoTokenizer
    path = cache_root() / "models" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not (path / "config.json").exists():
            path.mkdir(exist_ok=True)
            tokenizer = AutoTokenizer.from_pretrained(default_model_path())
            tokenizer.save_pretrained(path)
            config_class, sizes = SHAPES[name]
            getattr(transformers, config_class)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id, **sizes).save_pretrained(path)
    return str(path)
