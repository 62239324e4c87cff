"""Qwen3 dense: Llama with per-head RMSNorm on q and k before RoPE."""

from fp8engine.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
