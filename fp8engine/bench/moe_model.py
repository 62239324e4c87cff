"""The model of `fp8engine bench --workload moe`: a small random Qwen3-MoE (64 experts, top-8), built once
from a `transformers` config with a fixed seed, saved in BF16 with the default model's tokenizer under the
cache folder. Random weights make its text meaningless; its shapes (expert count, top-k, GEMM sizes per
expert) are what the MoE path is measured on."""

import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from fp8engine.envs import cache_root
from fp8engine.weights.default_model import default_model_path

NAME = "tiny-qwen3-moe-e64-k8"
CONFIG = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=64,
              num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.05)
SEED = 0
_DONE = "fp8engine_built"


def tiny_moe_path() -> str:
    """The directory of the benchmark MoE model (built on first use, under a file lock)."""
    target = cache_root() / "models" / NAME
    if (target / _DONE).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / _DONE).exists():
            _build_atomically(target)
    return str(target)


def _build_atomically(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        config = Qwen3MoeConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, **CONFIG)
        torch.manual_seed(SEED)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text(NAME)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
