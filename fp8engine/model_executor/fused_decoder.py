"""The decoder layers of a dense Llama-family model in one C++ call (csrc/decoder.cpp, DecoderPlan), and a hybrid
model's decode steps (csrc/hybrid_decoder.cpp, HybridPlan: HybridDecoder below).

The plan calls the same ops as the Python layers (models/llama.py), with the same arguments, so the output is
the Python path's bit for bit; it only drops the Python around them, which at batch 1 on a small CPU is a large
share of a decode step (module calls, attribute lookups, op-call overhead, each of them run on caches the weights
have just streamed through). The embedding lookup and the final norm run inside the call too (`from_tokens`),
except before a float32 LM head, whose final norm is Python's float32 one. The engine uses it on the CPU
whenever the layers' ops are the C++ kernels: a dense model (no MoE), the C++ attention and layer ops, FP8 linears
or BF16 ones (which take the C++ kernel or torch's GEMM by the step's row count, as the Python layer does), and
no KV-scale calibration running (its observer needs the Python layer); a loaded LoRA adapter runs inside it.
Whether the plan may be built at all is the kernel set's `decoder_plan` (FP8ENGINE_FUSED_DECODER=0 turns it off).
Under tensor parallelism every rank runs its shard's plan, which adds the row-parallel projections' partial sums
(o_proj, down_proj, a GDN layer's out_proj) over the ranks itself (the group's all-reduce or its fixed-order sum, as
the Python layers' `reduce`).
"""

import torch

from fp8engine import envs
from fp8engine.model_executor.kernel_set import KernelSet
from fp8engine.model_executor.kernels import bf16_linear_cpu
from fp8engine.model_executor.layers.attention import AttentionMetadata
from fp8engine.model_executor.layers.linear import Linear
from fp8engine.weights import layout


def _kv_args(attn: list) -> tuple[list, list]:
    """The attention layers' KV caches (k, v each) and scales (k, v, q each) as a plan takes them with each call."""
    return ([c for a in attn for c in (a.k_cache, a.v_cache)],
            [float(s) for a in attn for s in (a.k_scale, a.v_scale, a.q_scale)])


def _proj(linear: Linear) -> list:
    lora = [None] * 3 if linear.lora is None else [linear.lora.lora_a, linear.lora.lora_b, linear.lora.segments]
    if linear.is_fp8:
        return [linear.weight, linear.weight_scale_inv, linear.bias, linear.scale_rows, *lora]
    return [linear.weight, None, linear.bias, None, *lora]


def _tp_args(tp) -> tuple[str, int, bool]:
    """A plan's tensor-parallel arguments: the group's name, its size (1: none), whether partial sums are added in
    rank order."""
    return ("", 1, False) if tp is None else (tp.group.group_name, tp.size, tp.fixed_order)


class _Counted:
    """A plan that may add partial sums over tensor-parallel ranks: its collective seconds go to the group's."""

    tp = None
    collective_seconds = 0.0

    def _count(self) -> None:
        if self.tp is not None:
            total = self.plan.collective_seconds()
            self.tp.seconds += total - self.collective_seconds
            self.collective_seconds = total


class FusedDecoder(_Counted):
    """Runs a model's decoder layers through one DecoderPlan; `usable` says when a step may take it."""

    name = "cpp-plan"  # get_stats().decoder_backend

    def __init__(self, model, kernels: KernelSet, scale_fmt: str | None, tp=None):
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
        nt16 = kernels.fp8_nt16 if first.qkv_proj.is_fp8 else kernels.dense_nt16 is not None  # (weights/layout.py)
        self.plan = torch.classes.fp8engine.DecoderPlan(
            tensors, first.rotary.cos, first.rotary.sin,
            [first.num_heads, first.num_kv_heads, first.head_dim, kernels.attention_partition],
            layers[0].input_layernorm.eps, first.attn.scale, scale_fmt == "ue8m0", kernels.batch_invariant, nt16,
            list(kernels.gemms), envs.flag("FP8ENGINE_PREFETCH_NEXT"), *_tp_args(tp))
        self.tp = tp
        self.attn = [layer.self_attn.attn for layer in layers]
        norm = model.model.norm  # its tensors and the embedding's, held like the layers' (updated in place)
        self.embed, self.norm_weight, self.norm_eps = model.model.embed_tokens.weight, norm.weight, norm.eps
        self.loras = [linear.lora for layer in layers for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                      layer.mlp.gate_up_proj, layer.mlp.down_proj) if linear.lora is not None]
        self.batch_invariant = kernels.batch_invariant
        self.bf16_gemm = kernels.gemms[1]
        self.dense_nt16 = nt16 and not first.qkv_proj.is_fp8  # BF16 projections in the layout

    def usable(self) -> bool:
        """Not while KV scales calibrate (the observer is Python's): the Python layers run those steps."""
        return all(a.observer is None for a in self.attn)

    def _args(self, rows: int, positions: torch.Tensor, meta: AttentionMetadata) -> tuple:
        caches, scales = _kv_args(self.attn)
        bf16_kernel = bf16_linear_cpu.kernel_takes(rows, self.batch_invariant, self.bf16_gemm, self.dense_nt16)
        lora = any(lora.active for lora in self.loras)
        return (positions, caches, scales, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                bf16_kernel, lora)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers on the embeddings x -> (last layer's output, its residual)."""
        out = self.plan.forward(x, *self._args(x.shape[0], positions, meta))
        self._count()
        return out

    def from_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Embedding lookup, the decoder layers and the final norm in the one call: the normed hidden states, as
        the Python model computes them around __call__."""
        out = self.plan.forward_tokens(input_ids, self.embed, self.norm_weight, self.norm_eps,
                                       *self._args(input_ids.shape[0], positions, meta))
        self._count()
        return out


def _layout(linear: Linear, kernels: KernelSet) -> int:
    """Where a hybrid plan's projection reads its weight (csrc/decoder_ops.h Proj::nt16): 1 the nt16 layout, 0 rows, as
    Linear._base picks its kernel."""
    if linear.is_fp8:
        return int(kernels.fp8_nt16)
    return int(kernels.dense_nt16 is not None and layout.is_marked(linear.weight))


# csrc/hybrid_decoder.cpp's tensors per layer (kPerLayer) and where its 7 projections start (kProjSlots)
PER_LAYER, PROJ_SLOTS = 55, (2, 9, 16, 23, 30, 41, 48)


class HybridDecoder(_Counted):
    """Runs a hybrid model's decoder layers (Qwen3.5 dense, models/qwen3_5.py) through one HybridPlan
    (csrc/hybrid_decoder.cpp) on decode steps; `usable` says which steps: every sequence one new token, its state
    slot given, a snapshot only of the state after it, no KV-scale calibration running. Prefill, chunked and
    speculative steps run the Python layers, which give the same bits (the plan calls their ops), so where a step
    runs changes nothing."""

    name = "cpp-plan-decode"

    def __init__(self, model, kernels: KernelSet, scale_fmt: str | None, tp=None):
        layers = model.model.layers
        attn = next(layer.self_attn for layer in layers if not layer.is_linear)
        gdn = next((layer.linear_attn for layer in layers if layer.is_linear), None)
        tensors, kinds, nt16 = [], [], []
        for layer in layers:  # each layer's PER_LAYER slots, as csrc/hybrid_decoder.cpp reads them
            slots = [None] * PER_LAYER
            slots[0:2] = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if layer.is_linear:
                m = layer.linear_attn
                projs = [m.in_proj_qkv, m.in_proj_z, m.in_proj_a, m.in_proj_b, m.out_proj]
                slots[37:41] = [m.conv1d.weight[:, 0], m.A_log, m.dt_bias, m.norm.weight]
            else:
                m = layer.self_attn
                projs = [m.qkv_proj, m.o_proj, None, None, None]
                slots[16:18] = [m.q_norm.weight, m.k_norm.weight]
            projs += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
            for start, linear in zip(PROJ_SLOTS, projs):
                if linear is not None:
                    slots[start:start + 7] = _proj(linear)
            tensors += slots
            kinds.append(0 if layer.is_linear else 1)
            nt16 += [-1 if linear is None else _layout(linear, kernels) for linear in projs]
        dims = [attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rotary.rotary_dim, kernels.attention_partition]
        dims += [0] * 5 if gdn is None else [gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim,
                                             gdn.kernel_size]
        self.plan = torch.classes.fp8engine.HybridPlan(
            tensors, kinds, nt16, attn.rotary.cos, attn.rotary.sin, dims, layers[0].input_layernorm.eps,
            attn.attn.scale, scale_fmt == "ue8m0", kernels.batch_invariant, list(kernels.gemms),
            envs.flag("FP8ENGINE_PREFETCH_NEXT"), *_tp_args(tp))
        self.tp = tp
        self.attn = model.attention_layers()
        self.gdn = model.gdn_layers()
        self.loras = [m.lora for m in model.modules() if isinstance(m, Linear) and m.lora is not None]
        self.batch_invariant = kernels.batch_invariant
        self.bf16_gemm = kernels.gemms[1]

    def usable(self, rows: int, meta: AttentionMetadata) -> bool:
        """A decode step (rows: its tokens, one a sequence) with state slots, snapshots of the states after it alone, no
        observer."""
        return (meta.state_slots is not None and rows == meta.query_start_loc.numel() - 1
                and all(n == 1 for _, n, _ in meta.state_snapshots) and all(a.observer is None for a in self.attn))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers on the embeddings x -> (last layer's output, its residual)."""
        caches, scales = _kv_args(self.attn)
        bf16_kernel = bf16_linear_cpu.kernel_takes(x.shape[0], self.batch_invariant, self.bf16_gemm)
        lora = any(lora.active for lora in self.loras)
        snapshots = meta.state_snapshots
        out = self.plan.forward(x, positions, caches, scales, [g.conv_state for g in self.gdn],
                                [g.rec_state for g in self.gdn], meta.slot_mapping, meta.query_start_loc,
                                meta.seq_lens, meta.block_tables, meta.state_slots, [i for i, _, _ in snapshots],
                                [slot for _, _, slot in snapshots], bf16_kernel, lora)
        self._count()
        return out


def _build_hybrid(model, kernels: KernelSet, scale_fmt: str | None, tp=None) -> HybridDecoder | None:
    """A HybridDecoder where its ops are the layers': dense MLPs (no MoE block), the C++ linears (the GDN's a and b
    projections in the model dtype included), the C++ gated delta rule, one eps for every norm."""
    from fp8engine.model_executor.models.llama import MLP
    layers = model.model.layers
    if (not all(type(layer.mlp) is MLP for layer in layers) or kernels.gdn_recurrent is None
            or not kernels.names["dense_linear"].startswith("cpp") or not kernels.linear_name.startswith("cpp")):
        return None
    gdns = [layer.linear_attn for layer in layers if layer.is_linear]
    attns = [layer.self_attn for layer in layers if not layer.is_linear]
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms += [n for a in attns for n in (a.q_norm, a.k_norm)]
    eps = {n.eps for n in norms} | {g.eps for g in gdns}
    if len(eps) != 1 or len({id(a.rotary) for a in attns}) != 1 or len({g.kernel_size for g in gdns}) > 1:
        return None
    row_parallel = [g.out_proj for g in gdns] + [a.o_proj for a in attns] + [layer.mlp.down_proj for layer in layers]
    if tp is not None and any(m.bias is not None for m in row_parallel):
        return None  # a row-parallel bias goes after the sum (Linear.forward); the plan adds it in the projection
    return HybridDecoder(model, kernels, scale_fmt, tp)


def build(model, kernels: KernelSet, scale_fmt: str | None, tp=None) -> FusedDecoder | HybridDecoder | None:
    """A FusedDecoder (dense Llama-family layers) or HybridDecoder (Qwen3.5 dense) for this model and kernel set, or
    None where no plan applies: the kernel set has no plan (not the CPU, turned off, kernels other than the C++
    ones), or a model whose layers are neither. tp: this rank's TPGroup under tensor parallelism (the plan adds its
    row-parallel projections' partial sums over the ranks itself)."""
    from fp8engine.model_executor.models.llama import MLP, DecoderAttention
    if not kernels.decoder_plan:
        return None
    if getattr(model, "hybrid", False):
        return _build_hybrid(model, kernels, scale_fmt, tp)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not all(isinstance(getattr(layer, "self_attn", None), DecoderAttention)
                             and type(layer.mlp) is MLP for layer in layers):
        return None
    linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    # The plan calls the C++ linear kernels: the ones the layers run, all FP8 or all in the model dtype
    if not kernels.linear_name.startswith("cpp") or any(m.is_fp8 != linears[0].is_fp8 for m in linears):
        return None
    # One eps and one RoPE table for all layers, as the plan takes them (models/llama.py builds them so)
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                             layer.self_attn.q_norm, layer.self_attn.k_norm) if n is not None]
    if len({n.eps for n in norms}) != 1 or len({id(layer.self_attn.rotary) for layer in layers}) != 1:
        return None
    if tp is not None and any(m.bias is not None for layer in layers for m in (layer.self_attn.o_proj,
                                                                               layer.mlp.down_proj)):
        return None  # a row-parallel bias goes after the sum (Linear.forward); the plan adds it in the projection
    return FusedDecoder(model, kernels, scale_fmt, tp)
