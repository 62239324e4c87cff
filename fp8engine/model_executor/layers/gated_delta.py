"""A Gated DeltaNet layer's token mixing (Qwen3.5 `linear_attn`, Qwen3-Next) over a batch of sequences, each with
its own fixed-size state, in plain torch on the references of kernels/gated_delta_ref.py:

    in_proj_qkv -> causal depthwise conv (kernel K) + SiLU -> q, k, v;  z = in_proj_z(x)
    beta = sigmoid(in_proj_b(x)),  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   (float32)
    o = gated delta rule(q, k, v, g, beta; state) -> gated RMSNorm(o, z) -> out_proj

Computed in transformers' rounding order (projections, conv output and beta in the model dtype; g, the delta rule
and the state in float32; o rounded to the model dtype before the norm). `GatedDeltaNet` is the engine's module:
its projections are the engine's linear layers and its states live in the runner's state pool (one slot per
sequence, `AttentionMetadata.state_slots`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from fp8engine.model_executor.kernels.gated_delta_ref import (
    causal_conv1d_batch,
    causal_conv1d_ref,
    chunked_gated_delta_ref,
    decay_and_beta,
    gated_rms_norm_ref,
    kernel_inputs,
    recurrent_gated_delta_ref,
)
from fp8engine.model_executor.layers.linear import Linear
from fp8engine.weights.quant import BLOCK

Projection = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
Mode = Literal["recurrent", "chunked"]


@dataclass(slots=True)
class GatedDeltaState:
    """One sequence's state in one GDN layer: conv [conv_dim, K-1] in the model dtype (the last K-1 conv inputs),
    recurrent [num_v_heads, head_k_dim, head_v_dim] float32, and how many tokens it has absorbed (the absolute
    position of the next one, which anchors the chunk grid)."""
    conv: torch.Tensor
    recurrent: torch.Tensor
    num_tokens: int = 0

    def clone(self) -> "GatedDeltaState":
        return GatedDeltaState(self.conv.clone(), self.recurrent.clone(), self.num_tokens)

    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


@dataclass(slots=True)
class GatedDeltaWeights:
    """A GDN layer's parameters in Qwen3.5's split layout. Projections are weights [out, in] or callables (an
    nn.Linear, an FP8 linear); conv_weight [conv_dim, K] with conv_dim = 2 * Hk * dk + Hv * dv, channels q | k | v."""
    in_proj_qkv: Projection
    in_proj_z: Projection
    in_proj_b: Projection
    in_proj_a: Projection
    out_proj: Projection
    conv_weight: torch.Tensor
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    norm_weight: torch.Tensor
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    eps: float

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} is not a multiple of num_k_heads={self.num_k_heads}")

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def new_state(self) -> GatedDeltaState:
        """The zero state of a sequence with no tokens yet."""
        k = self.conv_weight.shape[1]
        conv = torch.zeros(self.conv_dim, k - 1, dtype=self.conv_weight.dtype, device=self.conv_weight.device)
        recurrent = torch.zeros(self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32,
                                device=self.conv_weight.device)
        return GatedDeltaState(conv, recurrent)


def weights_from_hf(module: nn.Module) -> GatedDeltaWeights:
    """The weights of transformers' Qwen3_5GatedDeltaNet / Qwen3_5MoeGatedDeltaNet (split projections, used as
    they are) or Qwen3NextGatedDeltaNet (in_proj_qkvz / in_proj_ba, regrouped into the split layout)."""
    hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    if hasattr(module, "in_proj_qkvz"):
        qkv, z, b, a = split_qwen3_next(module.in_proj_qkvz.weight, module.in_proj_ba.weight, hk, hv, dk, dv)
    else:
        qkv, z, b, a = module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a
    return GatedDeltaWeights(qkv, z, b, a, module.out_proj, module.conv1d.weight.squeeze(1), module.dt_bias,
                             module.A_log, module.norm.weight, hk, hv, dk, dv, module.layer_norm_epsilon)


def split_qwen3_next(qkvz: torch.Tensor, ba: torch.Tensor, hk: int, hv: int, dk: int,
                     dv: int) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next's fused rows, grouped per key head as [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)]
    with r = hv / hk, regrouped to Qwen3.5's in_proj_qkv [q all | k all | v all], in_proj_z, in_proj_b, in_proj_a."""
    r = hv // hk
    groups = qkvz.reshape(hk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = groups.split([dk, dk, r * dv, r * dv], dim=1)
    qkv = torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])
    b, a = ba.reshape(hk, 2 * r, -1).split([r, r], dim=1)
    return qkv, z.flatten(0, 1), b.flatten(0, 1), a.flatten(0, 1)


def project(x: torch.Tensor, proj: Projection) -> torch.Tensor:
    return F.linear(x, proj) if isinstance(proj, torch.Tensor) else proj(x)


def gated_delta_layer(x: torch.Tensor, w: GatedDeltaWeights, states: list[GatedDeltaState], seq_lens: list[int],
                      mode: Mode = "chunked", chunk_size: int = 64) -> tuple[torch.Tensor, list[GatedDeltaState]]:
    """x [T, hidden]: the new tokens of len(states) sequences packed one after another (seq_lens, summing to T),
    each continuing from its state -> (output [T, hidden], the new states; the given ones are left as they were).
    mode "recurrent" runs every token through the recurrent step, "chunked" the grid-anchored chunked form."""
    if mode not in ("recurrent", "chunked"):
        raise ValueError(f"mode={mode!r}: expected 'recurrent' or 'chunked'")
    if len(states) != len(seq_lens) or sum(seq_lens) != x.shape[0]:
        raise ValueError(f"seq_lens={seq_lens} does not match {len(states)} states and {x.shape[0]} tokens")
    t, kd = x.shape[0], w.num_k_heads * w.head_k_dim
    mixed = project(x, w.in_proj_qkv)
    z = project(x, w.in_proj_z).view(t, w.num_v_heads, w.head_v_dim)
    g, beta = decay_and_beta(project(x, w.in_proj_a), project(x, w.in_proj_b), w.A_log, w.dt_bias)
    conv_out, convs = [], []
    for state, part in zip(states, mixed.split(seq_lens)):
        out, conv = causal_conv1d_ref(part, state.conv, w.conv_weight)
        conv_out.append(out)
        convs.append(conv)
    q, k, v = torch.cat(conv_out).split([kd, kd, w.num_v_heads * w.head_v_dim], dim=-1)
    q, k = q.view(t, w.num_k_heads, w.head_k_dim), k.view(t, w.num_k_heads, w.head_k_dim)
    v = v.reshape(t, w.num_v_heads, w.head_v_dim)
    core, recurrents = delta_rule(q, k, v, g, beta, states, seq_lens, mode, chunk_size)
    normed = gated_rms_norm_ref(core.to(x.dtype), z, w.norm_weight, w.eps)
    new_states = [GatedDeltaState(c, r, s.num_tokens + n) for c, r, s, n in zip(convs, recurrents, states, seq_lens)]
    return project(normed.flatten(1), w.out_proj), new_states


def delta_rule(q, k, v, g, beta, states: list[GatedDeltaState], seq_lens: list[int], mode: Mode,
               chunk_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gated delta rule over the batch: the recurrent form steps all sequences together, the chunked form
    runs each sequence on its own grid."""
    if mode == "recurrent":
        out, recurrents = recurrent_gated_delta_ref(q, k, v, g, beta, torch.stack([s.recurrent for s in states]),
                                                    seq_lens)
        return out, list(recurrents.unbind(0))
    outs, recurrents = [], []
    for state, qs, ks, vs, gs, bs in zip(states, *(x.split(seq_lens) for x in (q, k, v, g, beta))):
        out, recurrent = chunked_gated_delta_ref(qs, ks, vs, gs, bs, state.recurrent, state.num_tokens, chunk_size)
        outs.append(out)
        recurrents.append(recurrent)
    return torch.cat(outs), recurrents


class _Holder(nn.Module):
    """A submodule that only holds a weight (HF's `conv1d`, the gated `norm`), so the names match."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class GatedDeltaNet(nn.Module):
    """A GDN layer of the engine (HF's `linear_attn`). in_proj_qkv, in_proj_z and out_proj are the model's linear
    layers (FP8 when the model is); in_proj_a and in_proj_b stay in the model dtype (their outputs feed softplus and
    sigmoid, and their [num_v_heads, hidden] blocks would be mostly padding). conv_state [slots, conv_dim, K-1] and
    rec_state [slots, Hv, dk, dv] are this layer's views of the runner's state pool; a step reads and writes the
    rows its sequences' slots name (AttentionMetadata.state_slots), a slot the scheduler hands out zeroed.

    Where the kernel set has gdn_recurrent (C++ on CPU, Triton on CUDA) every token takes it. Without one the torch
    references run: recurrent=True (the batch-invariant engine: a state's bits do not depend on how its positions
    were split into steps) steps every token too, otherwise prefill takes the chunked form on its absolute grid.

    fused_names: Qwen3-Next's checkpoint layout (`in_proj_qkvz`, `in_proj_ba`, grouped per key head): the loader
    reaches this module through `hf_target` and regroups them into the split projections.

    Tensor parallelism (cfg.tp_size > 1, this rank's heads in cfg; shard_for_tp): whole key and value heads a rank.
    in_proj_qkv then holds q, k and v as three shards (each rank's q, k and v rows are three slices of HF's
    tensor), in_proj_z, in_proj_a, in_proj_b, the conv's channels, dt_bias and A_log this rank's heads' rows,
    out_proj their columns (row-parallel); the gated norm's weight is per head dim, so every rank holds it."""

    def __init__(self, cfg, make_linear, recurrent: bool, fused_names: bool = False, chunk_size: int = 64):
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.recurrent, self.chunk_size, self.fused_names = recurrent, chunk_size, fused_names
        dtype, kernels = make_linear.dtype, make_linear.kernels
        self.gdn_kernel = kernels.gdn_recurrent  # every token of prefill and decode through it, exact or not
        hidden = cfg.hidden_size
        self.tp_size = getattr(cfg, "tp_size", 1)
        self.tp_rank = 0
        self.in_proj_qkv = make_linear(hidden, [self.conv_dim] if self.tp_size == 1 else
                                       [self.key_dim, self.key_dim, self.value_dim])
        self.in_proj_z = make_linear(hidden, [self.value_dim])
        self.in_proj_b = Linear(hidden, [self.num_v_heads], dtype, kernels)
        self.in_proj_a = Linear(hidden, [self.num_v_heads], dtype, kernels)
        self.out_proj = make_linear(self.value_dim, [hidden])
        self.conv1d = _Holder(torch.zeros(self.conv_dim, 1, self.kernel_size, dtype=dtype))
        self.norm = _Holder(torch.ones(self.head_v_dim, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.conv_state: torch.Tensor | None = None
        self.rec_state: torch.Tensor | None = None
        if fused_names:
            self.hf_names = self._fused_hf_names
            self.hf_target = self._fused_hf_target
        elif self.tp_size > 1:
            self.hf_target = self._tp_hf_target

    # ------------------------------------------------------------------ tensor parallelism
    def shard_for_tp(self, rank: int, size: int, reduce) -> None:
        """This rank's heads' rows of the projections (before the weights load); out_proj's partial sums added over
        the ranks by `reduce`."""
        self.tp_rank = rank
        k0, v0, h0 = rank * self.key_dim, rank * self.value_dim, rank * self.num_v_heads
        k_full, v_full, h_full = self.key_dim * size, self.value_dim * size, self.num_v_heads * size
        self.in_proj_qkv.shard_for_tp(rows=[(k0, k_full), (k0, k_full), (v0, v_full)])
        if self.in_proj_qkv.lora is not None:  # one HF module's adapter: its B's q, k and v rows a shard each
            self.in_proj_qkv.lora.module_starts = [0, k_full, 2 * k_full]
        self.in_proj_z.shard_for_tp(rows=[(v0, v_full)])
        self.in_proj_a.shard_for_tp(rows=[(h0, h_full)])
        self.in_proj_b.shard_for_tp(rows=[(h0, h_full)])
        self.out_proj.shard_for_tp(cols=(v0, v_full), reduce=reduce)

    def _tp_hf_target(self, name: str, rest: str):
        """A tensor-parallel rank's targets: in_proj_qkv and the conv weight split into their q, k and v slices,
        the per-head vectors sliced, the norm whole."""
        from fp8engine.weights import loader
        size, rank = self.tp_size, self.tp_rank
        sizes = [self.key_dim, self.key_dim, self.value_dim]  # this rank's rows of q, k, v
        fulls = [n * size for n in sizes]
        starts = [sum(fulls[:i]) for i in range(3)]  # where q, k and v start in HF's rows
        if rest in ("in_proj_qkv.weight", "in_proj_qkv.weight_scale_inv"):
            attr = rest.split(".", 1)[1]
            if attr == "weight_scale_inv":
                if any(n % BLOCK for n in fulls):
                    raise ValueError(f"weight {name!r}: q, k and v of {fulls} rows are not whole {BLOCK}-row "
                                     f"blocks, so a tensor-parallel rank cannot take their scales apart")
                fulls, starts = [n // BLOCK for n in fulls], [n // BLOCK for n in starts]
            parts = [((slice(start, start + full),), loader._linear_target(name, self.in_proj_qkv, shard, attr))
                     for shard, (start, full) in enumerate(zip(starts, fulls))]
            cols = self.in_proj_qkv.in_features if attr == "weight" else -(-self.in_proj_qkv.in_features // BLOCK)
            dtype = self.dt_bias.dtype if attr == "weight" else torch.float32
            view = torch.empty((), dtype=dtype).expand(sum(fulls), cols)  # the shape a check compares, no storage
            return loader.Target(name, "split", view, parts=parts)
        if rest == "conv1d.weight":
            weight, parts, local = self.conv1d.weight.data, [], 0
            for n, full, start in zip(sizes, fulls, starts):
                tp = loader.TPSlice((full, *weight.shape[1:]), slice(rank * n, (rank + 1) * n))
                parts.append(((slice(start, start + full),),
                              loader.Target(name, "dense", weight[local:local + n], tp=tp)))
                local += n
            view = torch.empty((), dtype=weight.dtype).expand(sum(fulls), *weight.shape[1:])
            return loader.Target(name, "split", view, parts=parts)
        if rest in ("dt_bias", "A_log"):
            tensor = getattr(self, rest).data
            n = tensor.shape[0]
            return loader.Target(name, "dense", tensor, tp=loader.TPSlice((n * size,), slice(rank * n, (rank + 1) * n)))
        if rest == "norm.weight":
            return loader.Target(name, "dense", self.norm.weight.data)
        module, _, attr = rest.partition(".")
        if module in ("in_proj_z", "in_proj_a", "in_proj_b", "out_proj") and attr:
            return loader._linear_target(name, getattr(self, module), 0, attr)
        raise ValueError(f"unknown weight name {name!r}: a GDN layer has no {rest!r}")

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of one sequence's state in this layer: the conv inputs and the recurrent state."""
        return [((self.conv_dim, self.kernel_size - 1), dtype),
                ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)]

    # ------------------------------------------------------------------ Qwen3-Next's names
    def _plain_tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors a Qwen3-Next checkpoint names as they are (none of them a 2-D matrix)."""
        return {"conv1d.weight": self.conv1d.weight, "norm.weight": self.norm.weight, "dt_bias": self.dt_bias,
                "A_log": self.A_log}

    def _fused_hf_names(self) -> list[str]:
        return ["in_proj_qkvz.weight", "in_proj_ba.weight", "out_proj.weight", *self._plain_tensors()]

    def _fused_hf_target(self, name: str, rest: str):
        """Qwen3-Next's fused projections split into the engine's (a tensor-parallel rank's q, k, v and z rows each
        a slice of those of every key head: its own heads are contiguous key-head groups); its other tensors as
        Qwen3.5's."""
        from fp8engine.weights import loader
        if rest in ("in_proj_qkvz.weight", "in_proj_ba.weight"):
            rows = self._fused_rows()
            if rest == "in_proj_ba.weight":
                dests = [(rows["b"], self.in_proj_b, 0), (rows["a"], self.in_proj_a, 0)]
            elif len(self.in_proj_qkv.shard_sizes) == 3:  # tensor parallel: q, k and v are shards
                dests = [(rows["q"], self.in_proj_qkv, 0), (rows["k"], self.in_proj_qkv, 1),
                         (rows["v"], self.in_proj_qkv, 2), (rows["z"], self.in_proj_z, 0)]
            else:
                dests = [(torch.cat([rows["q"], rows["k"], rows["v"]]), self.in_proj_qkv, 0),
                         (rows["z"], self.in_proj_z, 0)]
            parts = [((index,), loader._linear_target(name, linear, shard, "weight")) for index, linear, shard in dests]
            total = sum(len(index) for index, _, _ in dests)
            dtype = self.dt_bias.dtype  # the shape a check compares, no storage
            view = torch.empty((), dtype=dtype).expand(total, self.in_proj_qkv.in_features)
            return loader.Target(name, "split", view, parts=parts)
        if self.tp_size > 1 and rest in self._plain_tensors():
            return self._tp_hf_target(name, rest)
        if rest == "out_proj.weight":
            return loader._linear_target(name, self.out_proj, 0, "weight")
        tensor = self._plain_tensors().get(rest)
        if tensor is None:
            raise ValueError(f"unknown weight name {name!r}: a Qwen3-Next GDN layer has no {rest!r}")
        return loader.Target(name, "dense", tensor.data)

    def _fused_rows(self) -> dict[str, torch.Tensor]:
        """Which rows of Qwen3-Next's in_proj_qkvz / in_proj_ba hold q, k, v, z, b and a, each in the split
        projection's row order, over every key head of the model (a tensor-parallel rank's are a slice of each):
        per key head j the fused rows are [q_j (dk) | k_j (dk) | v of its r value heads | z of them] and
        [b of its r value heads | a of them] (layers/gated_delta.split_qwen3_next does the same on tensors)."""
        hk, dk, dv = self.num_k_heads * self.tp_size, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // self.num_k_heads
        group = 2 * dk + 2 * r * dv
        base = torch.arange(hk)[:, None] * group
        ba = torch.arange(hk)[:, None] * 2 * r
        return {"q": (base + torch.arange(dk)).flatten(), "k": (base + dk + torch.arange(dk)).flatten(),
                "v": (base + 2 * dk + torch.arange(r * dv)).flatten(),
                "z": (base + 2 * dk + r * dv + torch.arange(r * dv)).flatten(),
                "b": (ba + torch.arange(r)).flatten(), "a": (ba + r + torch.arange(r)).flatten()}

    # ------------------------------------------------------------------ compute
    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        """x [T, hidden] of the step's sequences packed in order -> [T, hidden]; their states advanced in place, and
        the snapshots meta asks for written (a sequence's state after so many of its new tokens)."""
        t, slots = x.shape[0], meta.state_slots
        # a graph's decode step: one token a sequence, the bounds on the device (nothing read back inside a capture)
        starts, lens = (None, [1] * t) if meta.decode else self._spans(meta)
        bounds = meta.query_start_loc if meta.decode else None
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x).view(t, self.num_v_heads, self.head_v_dim)
        g, beta = decay_and_beta(self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias)
        if slots is None:  # a detached forward (calibration, profile): one sequence from the zero state
            conv_states = torch.zeros(1, self.conv_dim, self.kernel_size - 1, dtype=x.dtype, device=x.device)
            pool = torch.zeros(1, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=x.device)
            index = torch.zeros(1, dtype=torch.int64, device=x.device)
        else:
            conv_states, pool, index = self.conv_state[slots], self.rec_state, slots
        snapshots = meta.state_snapshots
        inside: dict[int, dict[int, list[int]]] = {}  # sequence -> offset inside its tokens -> snapshot slots
        for i, n, slot in snapshots:
            if n < lens[i]:
                inside.setdefault(i, {}).setdefault(n, []).append(slot)
        if inside:
            core, new_conv = self._by_piece(mixed, g, beta, conv_states, pool, index, starts, lens, inside)
        else:
            if all(n == 1 for n in lens):
                conv_out, new_conv = causal_conv1d_batch(mixed, conv_states, self.conv1d.weight[:, 0])
            else:
                conv_out, new_conv = self._conv_each(mixed, conv_states, lens)
            core = self._delta(conv_out, g, beta, pool, index, starts, lens, bounds)
        if slots is not None:
            self.conv_state[slots] = new_conv
            for i, n, slot in snapshots:
                if n == lens[i]:
                    self.conv_state[slot], self.rec_state[slot] = new_conv[i], self.rec_state[slots[i]]
        normed = gated_rms_norm_ref(core.to(x.dtype), z, self.norm.weight, self.eps)
        return self.out_proj(normed.flatten(1))

    def _split_qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = conv_out.shape[0]
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(t, self.num_k_heads, self.head_k_dim), k.reshape(t, self.num_k_heads, self.head_k_dim),
                v.reshape(t, self.num_v_heads, self.head_v_dim))

    def _conv_each(self, mixed: torch.Tensor, conv_states: torch.Tensor,
                   lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        outs, convs = [], []
        for i, part in enumerate(mixed.split(lens)):
            out, conv = causal_conv1d_ref(part, conv_states[i], self.conv1d.weight[:, 0])
            outs.append(out)
            convs.append(conv)
        return torch.cat(outs), torch.stack(convs)

    def _delta(self, conv_out, g, beta, pool: torch.Tensor, index: torch.Tensor, starts: list[int] | None,
               lens: list[int], bounds: torch.Tensor | None = None) -> torch.Tensor:
        """The delta rule over the packed sequences whose recurrent states are pool[index], advanced in place:
        the kernel set's recurrent form where there is one, else the references (recurrent when exact or decoding, the
        chunked form on each sequence's grid otherwise) -> o [T, Hv, dv] float32. bounds: the sequences' first rows
        and the end (the lengths' running sum) where the device has them already."""
        q, k, v = self._split_qkv(conv_out)
        if self.gdn_kernel is not None:
            bounds = torch.tensor([0, *lens]).cumsum(0) if bounds is None else bounds
            return self.gdn_kernel(*kernel_inputs(q, k, v, g, beta), pool, index, bounds)
        states = pool[index]
        if self.recurrent or all(n == 1 for n in lens):
            core, new = recurrent_gated_delta_ref(q, k, v, g, beta, states, lens)
        else:
            outs, recs = [], []
            for i, (qs, ks, vs, gs, bs) in enumerate(zip(*(y.split(lens) for y in (q, k, v, g, beta)))):
                out, rec = chunked_gated_delta_ref(qs, ks, vs, gs, bs, states[i], starts[i], self.chunk_size)
                outs.append(out)
                recs.append(rec)
            core, new = torch.cat(outs), torch.stack(recs)
        pool[index] = new
        return core

    def _by_piece(self, mixed, g, beta, conv_states, pool, index, starts, lens, inside):
        """Sequence by sequence, each in pieces cut where a snapshot falls inside its tokens (the snapshot written
        between them): what a prefix hit restoring that snapshot computes from there on."""
        outs, convs = [], []
        for i, (part, gs, bs) in enumerate(zip(mixed.split(lens), g.split(lens), beta.split(lens))):
            conv, cuts = conv_states[i], inside.get(i, {})
            bounds = [0, *sorted(cuts), lens[i]]
            for lo, hi in zip(bounds, bounds[1:]):
                out, conv = causal_conv1d_ref(part[lo:hi], conv, self.conv1d.weight[:, 0])
                outs.append(self._delta(out, gs[lo:hi], bs[lo:hi], pool, index[i:i + 1], [starts[i] + lo],
                                        [hi - lo]))
                for slot in cuts.get(hi, ()):
                    self.conv_state[slot], self.rec_state[slot] = conv, pool[index[i]]
            convs.append(conv)
        return torch.cat(outs), torch.stack(convs)

    @staticmethod
    def _spans(meta) -> tuple[list[int], list[int]]:
        """(each sequence's first new position, its number of new tokens)."""
        bounds = meta.query_start_loc.tolist()
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
        return [c - n for c, n in zip(meta.seq_lens.tolist(), lens)], lens
