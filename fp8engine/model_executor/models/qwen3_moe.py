"""Qwen3-MoE: Qwen3 attention with a sparse MoE block (softmax top-k router, `norm_topk_prob`) in every
`decoder_sparse_step`-th layer outside `mlp_only_layers`, a dense MLP in the others."""

from torch import nn

from fp8engine.model_executor.layers.moe import SparseMoeBlock
from fp8engine.model_executor.models.llama import MLP, LinearFactory
from fp8engine.model_executor.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, cfg, layer_idx: int, make_linear: LinearFactory) -> nn.Module:
        if is_sparse_layer(cfg, layer_idx):
            return SparseMoeBlock(cfg, make_linear.dtype, make_linear.kernels, make_linear.fp8,
                                  make_linear.scale_fmt)
        return MLP(cfg.hidden_size, cfg.intermediate_size, make_linear)


def is_sparse_layer(cfg, layer_idx: int) -> bool:
    """transformers' rule for which decoder layers get the MoE block."""
    return (layer_idx not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0
            and (layer_idx + 1) % cfg.decoder_sparse_step == 0)
