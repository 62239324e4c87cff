"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections (none on o_proj)."""

from fp8engine.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        return True, False
