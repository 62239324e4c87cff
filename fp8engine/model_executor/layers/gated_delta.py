"""A Gated DeltaNet layer's token mixing (Qwen3.5 `linear_attn`, Qwen3-Next) over a batch of sequences, each with
its own fixed-size state, in plain torch on the references of kernels/gated_delta_ref.py:

    in_proj_qkv -> causal depthwise conv (kernel K) + SiLU -> q, k, v;  z = in_proj_z(x)
    beta = sigmoid(in_proj_b(x)),  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   (float32)
    o = gated delta rule(q, k, v, g, beta; state) -> gated RMSNorm(o, z) -> out_proj

Computed in transformers' rounding order (projections, conv output and beta in the model dtype; g, the delta rule
and the state in float32; o rounded to the model dtype before the norm). Not yet wired into the engine.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from fp8engine.model_executor.kernels.gated_delta_ref import (
    causal_conv1d_ref,
    chunked_gated_delta_ref,
    decay_and_beta,
    gated_rms_norm_ref,
    recurrent_gated_delta_ref,
)

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
