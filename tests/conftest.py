import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_dir() -> str:
    from fp8engine import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_dir)


def make_engine(model: str = "default", **kwargs):
    from fp8engine import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(model=model, **kwargs))


@pytest.fixture(scope="session")
def engine_bf16():
    return make_engine(dtype="bfloat16")


@pytest.fixture(scope="session")
def engine_fp32():
    return make_engine(dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, default_dir, tokenizer) -> str:
    """A tiny random-initialised Qwen3 (fixed seed) with the default model's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(1234)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
