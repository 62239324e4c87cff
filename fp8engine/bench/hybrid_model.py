"""`--model qwen3.5-2b-shape` for the bench: a Qwen3.5-2B-shaped hybrid model with seeded random weights
(load_format="dummy": nothing is downloaded or written but its config and the default model's tokenizer).

The sizes are the 2B's published ones (24 layers: 18 Gated DeltaNet + 6 gated attention, hidden 2048, MLP 6144,
8 query / 2 KV heads of 256, 16 / 16 linear heads of 128, tied embeddings); the vocabulary is the default model's
tokenizer's 49,152 rather than 248,320, so the LM head is a smaller share of a step than in the released model."""

from filelock import FileLock

from fp8engine.envs import cache_root
from fp8engine.weights.default_model import default_model_path

SHAPES = {
    "qwen3.5-2b-shape": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                             max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
                             rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0,
                                                  partial_rotary_factor=0.25)),
}


def is_shape(model: str) -> bool:
    return model in SHAPES


def shape_path(name: str) -> str:
    """The directory of a named shape: config.json (Qwen3_5TextConfig) and the tokenizer, written once."""
    from transformers import AutoTokenizer, Qwen3_5TextConfig
    path = cache_root() / "models" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not (path / "config.json").exists():
            path.mkdir(exist_ok=True)
            tokenizer = AutoTokenizer.from_pretrained(default_model_path())
            tokenizer.save_pretrained(path)
            Qwen3_5TextConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, architectures=["Qwen3_5ForCausalLM"],
                              **SHAPES[name]).save_pretrained(path)
    return str(path)
