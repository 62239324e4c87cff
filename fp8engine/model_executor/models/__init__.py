"""Model registry: Hugging Face `model_type` -> engine model class."""

from fp8engine.model_executor.models.llama import LlamaForCausalLM
from fp8engine.model_executor.models.qwen2 import Qwen2ForCausalLM
from fp8engine.model_executor.models.qwen3 import Qwen3ForCausalLM
from fp8engine.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from fp8engine.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
                  "qwen3_moe": Qwen3MoeForCausalLM,
                  "qwen3_5_text": Qwen3_5ForCausalLM, "qwen3_5": Qwen3_5ForCausalLM,
                  "qwen3_5_moe_text": Qwen3_5MoeForCausalLM, "qwen3_5_moe": Qwen3_5MoeForCausalLM,
                  "qwen3_next": Qwen3NextForCausalLM}


def model_class(hf_config):
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[model_type]
