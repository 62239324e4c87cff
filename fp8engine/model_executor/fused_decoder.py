"""The decoder layers of a dense Llama-family model in one C++ call (csrc/decoder.cpp, DecoderPlan).

The plan calls the same ops as the Python layers (models/llama.py), with the same arguments, so the output is
the Python path's bit for bit; it only drops the Python around them, which at batch 1 on a small CPU is a large
share of a decode step (module calls, attribute lookups, op-call overhead). The engine uses it on the CPU
whenever the step's ops would all be the C++ kernels: a dense model (no MoE), the C++ attention, FP8 linears or
BF16 ones at a row count the BF16 kernel takes, and no KV-scale calibration running (its observer needs the
Python layer). FP8ENGINE_FUSED_DECODER=0 turns it off.
"""

import os

import torch

from fp8engine.config import EngineConfig
from fp8engine.model_executor import backends
from fp8engine.model_executor.kernels import bf16_linear_cpu
from fp8engine.model_executor.kernels.cpu_ops import cpu_kernel
from fp8engine.model_executor.layers.attention import AttentionMetadata
from fp8engine.model_executor.layers.linear import Linear

FUSED_ENV = "FP8ENGINE_FUSED_DECODER"


def enabled() -> bool:
    choice = os.environ.get(FUSED_ENV, "1")
    if choice not in ("0", "1"):
        raise ValueError(f"{FUSED_ENV} must be 0 or 1, got {choice!r}")
    return choice == "1"


def _proj(linear: Linear) -> list:
    if linear.is_fp8:
        return [linear.weight, linear.weight_scale_inv, linear.bias, linear.scale_rows]
    return [linear.weight, None, linear.bias, None]


class FusedDecoder:
    """Runs a model's decoder layers through one DecoderPlan; `usable` says when a step may take it."""

    def __init__(self, model, config: EngineConfig):
        layers = model.model.layers
        first = layers[0].self_attn
        tensors = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        None if attn.q_norm is None else attn.q_norm.weight,
                        None if attn.k_norm is None else attn.k_norm.weight]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                tensors += _proj(linear)
        partition = backends.BATCH_INVARIANT_KV_PARTITION if config.batch_invariant else 0
        self.plan = torch.classes.fp8engine.DecoderPlan(
            tensors, first.rotary.cos, first.rotary.sin,
            [first.num_heads, first.num_kv_heads, first.head_dim, partition],
            layers[0].input_layernorm.eps, first.attn.scale,
            config.fp8_scale_fmt == "ue8m0", config.batch_invariant)
        self.attn = [layer.self_attn.attn for layer in layers]
        self.dtype = layers[0].input_layernorm.weight.dtype
        self.batch_invariant = config.batch_invariant
        self.bf16_linears = not first.qkv_proj.is_fp8

    def usable(self, x: torch.Tensor) -> bool:
        if x.dtype != self.dtype or any(a.observer is not None for a in self.attn):
            return False
        return not self.bf16_linears or bf16_linear_cpu.kernel_takes(x.shape[0], self.batch_invariant)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        caches = [c for a in self.attn for c in (a.k_cache, a.v_cache)]
        scales = [float(s) for a in self.attn for s in (a.k_scale, a.v_scale, a.q_scale)]
        return self.plan.forward(x, positions, caches, scales, meta.slot_mapping, meta.query_start_loc,
                                 meta.seq_lens, meta.block_tables)


def build(model, config: EngineConfig, attention_name: str) -> FusedDecoder | None:
    """A FusedDecoder for this model and engine, or None where the plan does not apply: not the CPU, turned
    off, a model whose layers are not the dense Llama ones, kernels other than the C++ ones."""
    from fp8engine.model_executor.models.llama import MLP, DecoderAttention
    if config.device != "cpu" or not enabled() or attention_name != "cpp":
        return None
    supported = cpu_kernel("decoder_plan_supported")
    if supported is None or not supported():
        return None
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not all(isinstance(layer.self_attn, DecoderAttention) and type(layer.mlp) is MLP
                             for layer in layers):
        return None
    linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if linears[0].is_fp8:
        if not all(m.is_fp8 for m in linears) or cpu_kernel("fp8_block_linear") is None:
            return None
    elif any(m.is_fp8 for m in linears) or config.torch_dtype != torch.bfloat16 or cpu_kernel("bf16_linear") is None:
        return None
    # One eps and one RoPE table for all layers, as the plan takes them (models/llama.py builds them so)
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                             layer.self_attn.q_norm, layer.self_attn.k_norm) if n is not None]
    if len({n.eps for n in norms}) != 1 or len({id(layer.self_attn.rotary) for layer in layers}) != 1:
        return None
    return FusedDecoder(model, config)
