"""Mixture-of-experts MLP (Qwen3-MoE): a softmax top-k router in the model dtype and stacked experts.

Expert weights are stacked as transformers 5 holds them: `gate_up_proj` [E, 2I, H] (gate rows first) and
`down_proj` [E, H, I], in the model dtype or E4M3 with 128 x 128 block scales per expert (gate and up keep
a grid each, stacked like a fused Linear's shards). The weight loader reaches them through `hf_target`,
under either naming: the checkpoints' per-expert `experts.{e}.{gate,up,down}_proj.weight` (+
`weight_scale_inv`), or the stacked `experts.gate_up_proj` / `experts.down_proj` of a transformers 5
state dict.

A step's tokens are grouped by expert (one sort) and each expert with tokens runs its two GEMMs on its
group: the C++ kernels on CPU (FP8: the block-FP8 linear; batch invariant, its one path for every M, so a
token's result does not depend on how many others share its expert), the fused Triton kernel on CUDA.
kernels/moe_ref.py holds the grouping and the plain-torch reference of both.
"""

import torch
from torch import nn

from fp8engine.model_executor.kernel_set import KernelSet
from fp8engine.model_executor.kernels.moe_ref import grouped_moe
from fp8engine.model_executor.layers.linear import Linear, _param
from fp8engine.weights.loader import Target, TPSlice
from fp8engine.weights.quant import BLOCK, FP8_DTYPE, cdiv

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 kernels: KernelSet, fp8: bool = False, scale_fmt: str | None = None):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.kernels, self.is_fp8, self.scale_fmt, self.dtype = kernels, fp8, scale_fmt, dtype
        self.first, self.num_local = 0, num_experts  # expert parallelism: this rank's experts (keep_experts)
        # tensor parallelism over each expert (split_experts): (this rank's first intermediate row, the full size)
        self.tp_inter: tuple[int, int] | None = None
        self._allocate()

    def _allocate(self) -> None:
        weight_dtype = FP8_DTYPE if self.is_fp8 else self.dtype
        e, h, i, fp8 = self.num_local, self.hidden_size, self.intermediate_size, self.is_fp8
        self.gate_up_proj = _param(torch.empty(e, 2 * i, h, dtype=weight_dtype))
        self.down_proj = _param(torch.empty(e, h, i, dtype=weight_dtype))
        self.scale_rows = None  # gate_up output row -> its scale row, where I is not a multiple of 128
        if fp8:
            self.gate_up_proj_scale_inv = _param(torch.ones(e, 2 * cdiv(i, BLOCK), cdiv(h, BLOCK)))
            self.down_proj_scale_inv = _param(torch.ones(e, cdiv(h, BLOCK), cdiv(i, BLOCK)))
            if i % BLOCK:
                rows = torch.arange(i, dtype=torch.int32) // BLOCK
                self.scale_rows = torch.cat([rows, rows + cdiv(i, BLOCK)])

    def keep_experts(self, first: int, count: int) -> None:
        """Expert parallelism: this rank holds experts first .. first + count (allocated anew, before the weights
        load); the others' contributions are another rank's, added by the block's all-reduce."""
        self.first, self.num_local = first, count
        self._allocate()

    def split_experts(self, start: int, full: int) -> None:
        """Tensor parallelism without expert parallelism: this rank holds intermediate rows start .. start +
        intermediate_size of every expert (gate and up column-parallel, down row-parallel: its partial sums are
        added by the block's all-reduce); start and the size are whole 128-row blocks in FP8 (check_shardable)."""
        self.tp_inter = (start, full)

    def _tp(self, proj: str, scales: bool) -> TPSlice | None:
        """Where one expert's projection (or its scale grid) sits in the full HF tensor of a split expert."""
        if self.tp_inter is None:
            return None
        (start, full), i, h = self.tp_inter, self.intermediate_size, self.hidden_size
        if scales:
            start, i, full, h = start // BLOCK, cdiv(i, BLOCK), cdiv(full, BLOCK), cdiv(h, BLOCK)
        if proj == "down_proj":
            return TPSlice((h, full), None, slice(start, start + i))
        return TPSlice((full, h), slice(start, start + i))

    def is_local(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.num_local

    @property
    def local(self) -> slice:
        """This rank's experts, as a slice of the stacked [num_experts, ...] HF tensors."""
        return slice(self.first, self.first + self.num_local)

    # ------------------------------------------------------------------ weights
    def fp8_matrix(self, expert: int, proj: str) -> tuple[torch.Tensor, int]:
        """(the [N, K] matrix of one expert that the FP8 linear reads, the projection's first row in it)."""
        expert -= self.first
        if proj == "down_proj":
            return self.down_proj[expert], 0
        return self.gate_up_proj[expert], PROJECTIONS.index(proj) * self.intermediate_size

    def shard_views(self, expert: int, proj: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, scale grid or None) of one expert's HF projection (expert: its global index): views into the
        stacked storage."""
        expert -= self.first
        if proj == "down_proj":
            return self.down_proj.data[expert], self.down_proj_scale_inv.data[expert] if self.is_fp8 else None
        shard = PROJECTIONS.index(proj)
        i, rows = self.intermediate_size, cdiv(self.intermediate_size, BLOCK)
        weight = self.gate_up_proj.data[expert, shard * i:(shard + 1) * i]
        scale = self.gate_up_proj_scale_inv.data[expert, shard * rows:(shard + 1) * rows] if self.is_fp8 else None
        return weight, scale

    def hf_names(self) -> list[str]:
        """The per-expert HF names (relative to this module) a checkpoint must hold."""
        return [f"{e}.{proj}.weight" for e in range(self.first, self.first + self.num_local) for proj in PROJECTIONS]

    def hf_target(self, name: str, rest: str) -> Target:
        """Where HF tensor `name` (`rest` relative to this module) lands; ValueError if nowhere."""
        parts = rest.split(".")
        if len(parts) == 1 and parts[0] in ("gate_up_proj", "down_proj"):
            return self._stacked_target(name, parts[0])
        if (len(parts) == 3 and parts[0].isdigit() and int(parts[0]) < self.num_experts
                and parts[1] in PROJECTIONS and parts[2] in ("weight", "weight_scale_inv")):
            if not self.is_local(int(parts[0])):
                return Target(name, "elsewhere", torch.empty(0))
            if parts[2] == "weight":
                return self._expert_target(name, int(parts[0]), parts[1])
            if self.is_fp8:
                return Target(name, "fp8_scale", self.shard_views(int(parts[0]), parts[1])[1],
                              tp=self._tp(parts[1], scales=True))
        raise ValueError(f"unknown weight name {name!r}: the MoE experts ({self.num_experts}, "
                         f"{'FP8' if self.is_fp8 else 'unquantized'}) have no {rest!r}")

    def _expert_target(self, name: str, expert: int, proj: str) -> Target:
        """One expert's projection weight (expert: its global index)."""
        weight, scale = self.shard_views(expert, proj)
        tp = self._tp(proj, scales=False)
        if self.is_fp8:
            matrix, row0 = self.fp8_matrix(expert, proj)
            return Target(name, "fp8_weight", weight, scale, self.scale_fmt, matrix=matrix, row0=row0, tp=tp)
        return Target(name, "dense", weight, tp=tp)

    def _stacked_target(self, name: str, attr: str) -> Target:
        """transformers 5's stacked [E, 2I, H] / [E, H, I] tensor: one copy, or per expert and shard (into FP8, or
        a split expert's rows or columns)."""
        stacked = getattr(self, attr)
        i = self.intermediate_size if self.tp_inter is None else self.tp_inter[1]
        full = (self.num_experts, 2 * i, self.hidden_size) if attr == "gate_up_proj" else (
            self.num_experts, self.hidden_size, i)
        if not self.is_fp8 and self.tp_inter is None:
            tp = None if full == tuple(stacked.shape) else TPSlice(full, self.local)
            return Target(name, "dense", stacked.data, tp=tp)
        prefix = name.removesuffix(attr)
        projs = ("down_proj",) if attr == "down_proj" else ("gate_proj", "up_proj")
        parts = []
        for e in range(self.first, self.first + self.num_local):
            for shard, proj in enumerate(projs):
                index = (e,) if attr == "down_proj" else (e, slice(shard * i, (shard + 1) * i))
                parts.append((index, self._expert_target(f"{prefix}{e}.{proj}.weight", e, proj)))
        return Target(name, "split", stacked.data, parts=parts, tp=TPSlice(full, self.local))

    # ------------------------------------------------------------------ compute
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids [T, k] int64; topk_weights [T, k] in x's dtype -> [T, H] = sum_j w_j expert_j(x)."""
        fused = self.kernels.fused_moe
        if fused is not None:
            return fused(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj, *self._scales(),
                         scale_fmt=self.scale_fmt)
        return grouped_moe(x, topk_ids, topk_weights, self._expert)

    def _scales(self) -> tuple:
        if not self.is_fp8:
            return None, None, None
        return self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.scale_rows

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if not self.is_local(e):  # another expert-parallel rank's
            return torch.zeros_like(x)
        e -= self.first
        k = self.kernels
        if not self.is_fp8:
            h = k.dense_linear(x, self.gate_up_proj[e], None)
            return k.dense_linear(k.silu_and_mul(h), self.down_proj[e], None)
        h = k.fp8_linear(x, self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], None, self.scale_fmt,
                         self.scale_rows)
        return k.fp8_linear(k.silu_and_mul(h), self.down_proj[e], self.down_proj_scale_inv[e], None, self.scale_fmt)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int64 by falling probability, their weights [T, k] in the logits' dtype):
    softmax in float32, top-k, optionally renormalised over the k, as transformers routes."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, model dtype) + experts. `routed`: [KV slots, top_k] int view the runner attaches; each
    forward writes every token's expert ids at its KV slot (what `return_routed_experts` reads back)."""

    def __init__(self, cfg, dtype: torch.dtype, kernels: KernelSet, fp8: bool, scale_fmt: str | None):
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, bool(cfg.norm_topk_prob)
        self.gate = Linear(cfg.hidden_size, [cfg.num_experts], dtype, kernels)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, kernels,
                                fp8, scale_fmt)
        self.routed: torch.Tensor | None = None
        self.reduce = None  # tensor parallelism: adds the ranks' partial sums (over its experts, or its slices)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        y = self.partial(x, meta)
        return y if self.reduce is None else self.reduce(y)

    def partial(self, x: torch.Tensor, meta) -> torch.Tensor:
        """This rank's share of the block's output (all of it on one rank)."""
        ids, weights = route(self.gate(x), self.top_k, self.normalize)
        if self.routed is not None:
            self.routed[meta.slot_mapping] = ids.to(self.routed.dtype)
        return self.experts(x, ids, weights)
