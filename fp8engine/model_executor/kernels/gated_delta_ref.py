"""Plain torch for the token mixing of a Gated DeltaNet (GDN) layer (Qwen3.5, Qwen3-Next): the causal depthwise
conv, the gated delta rule in its recurrent and chunked forms, and the gated RMSNorm. The references the C++ and
Triton kernels of the decode step and of prefill are to be tested against; layers/gated_delta.py runs a layer on them.

Per value head h, with a state S [k_dim, v_dim] in float32, each token t does

    S = exp(g_t) * S                         decay, g_t <= 0
    u_t = beta_t * (v_t - S^T k_t)           the delta rule: write only what S does not already predict
    S = S + k_t u_t^T
    o_t = S^T q_t

with q and k L2-normalised and q scaled by k_dim ** -0.5. Query/key heads are shared GQA-style: key head j serves
value heads j * r .. j * r + r - 1 (r = num_v_heads / num_k_heads), as transformers' repeat_interleave does.

The recurrent form runs that loop; every token takes the same ops on the same shapes, so its bits do not depend on
how the tokens are split into calls nor on which other sequences share a step. The chunked form computes a chunk of
C tokens with matrix products (the WY/UT transform below); its bits depend on where the chunks fall, so they are
anchored at absolute positions: chunk c covers positions [c * C, (c + 1) * C) of the sequence, whatever the call.
A call starting at position p0 runs its tokens up to the first multiple of C with the recurrent form (as decode
steps would), then each grid chunk it starts with the chunked form, a last partial chunk padded to C with tokens
that change nothing. The state after position p therefore has the same bits for every split of positions <= p
into calls that start and end on the grid (and at p); a call that ends off the grid leaves its partial chunk
computed in chunked form, which a later call cannot extend, so such splits change the low bits.

On CPU torch's sigmoid, silu and softplus give an element other bits in the vectorised body of a tensor than in its
scalar tail (measured, torch 2.13), so a token's result would depend on its row in the batch; exp and log do not,
and the functions here are built from them and IEEE-exact arithmetic (tests/test_gated_delta.py holds them to it).
"""

import torch
from torch.nn import functional as F

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as FLA and transformers compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x itself above 20 as torch's threshold; log1p from log as Kahan computes it."""
    e = torch.exp(x.clamp(max=20))
    u = 1 + e
    log1p = torch.where(u == 1, e, torch.log(u) * e / (u - 1))
    return torch.where(x > 20, x, log1p)


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g = -exp(A_log) * softplus(a + dt_bias) in float32, beta = sigmoid(b) in b's dtype) from the outputs of
    in_proj_a and in_proj_b [T, Hv]."""
    return -A_log.float().exp() * softplus(a.float() + dt_bias), sigmoid(b)


def causal_conv1d_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """Depthwise causal conv then SiLU over one sequence's new tokens. x [T, C], conv_state [C, K-1] (the K-1
    inputs before x, oldest first), weight [C, K] -> (silu(conv) [T, C] in x's dtype, new conv_state [C, K-1]).
    Each output is its K taps summed in tap order in float32 and rounded once, whatever T."""
    k = weight.shape[1]
    xs = torch.cat([conv_state.t().to(x.dtype), x], dim=0)
    wf = weight.float()
    acc = xs[:x.shape[0]].float() * wf[:, 0]
    for j in range(1, k):
        acc = acc + xs[j:j + x.shape[0]].float() * wf[:, j]
    new_state = xs[xs.shape[0] - (k - 1):].t().to(conv_state.dtype)
    return silu(acc.to(x.dtype)), new_state


def causal_conv1d_batch(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """causal_conv1d_ref for B sequences of one new token each (a decode step): x [B, C], conv_states [B, C, K-1]
    -> (silu(conv) [B, C], new states [B, C, K-1]); the same ops per element, so the same bits."""
    k = weight.shape[1]
    xs = torch.cat([conv_states.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    wf = weight.float()
    acc = xs[:, :, 0].float() * wf[:, 0]
    for j in range(1, k):
        acc = acc + xs[:, :, j].float() * wf[:, j]
    return silu(acc.to(x.dtype)), xs[:, :, 1:].to(conv_states.dtype)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * norm(x) * silu(z) over the last dim (head_v_dim), in transformers' rounding order: the norm in
    float32 rounded to x's dtype, times weight, times silu(z) in float32, rounded once more."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * silu(z.float())).to(x.dtype)


def prepare_qkvgb(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inputs of the delta rule in float32: q, k [T, Hk, dk] L2-normalised (q also scaled by dk ** -0.5) and
    repeated to the Hv value heads; v [T, Hv, dv]; g, beta [T, Hv]."""
    rep = v.shape[1] // k.shape[1]
    q, k, v, g, beta = kernel_inputs(q, k, v, g, beta)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q, k, v, g, beta


def kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The delta rule's inputs in float32, contiguous: q, k L2-normalised, q scaled by dk ** -0.5, the key heads
    not repeated (what the kernels take: they read key head h // r for value head h; prepare_qkvgb repeats them)."""
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    return tuple(x.float().contiguous() for x in (q, k, v, g, beta))


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of n sequences, prepared (float32): q, k [n, H, dk], v [n, H, dv], g, beta [n, H],
    state [n, H, dk, dv] -> (o [n, H, dv], new state). Elementwise products and sums over dk only, so a
    sequence's bits do not depend on n."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def recurrent_gated_delta_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, states: torch.Tensor,
                              seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form over a batch of sequences packed one after another: q, k [T, Hk, dk], v [T, Hv, dv],
    g, beta [T, Hv] (raw: normalised here), states [B, Hv, dk, dv] float32, seq_lens summing to T -> (o [T, Hv, dv]
    float32, new states). Step i advances every sequence that has an i-th token, all in one recurrent_step."""
    q, k, v, g, beta = prepare_qkvgb(q, k, v, g, beta)
    starts = torch.tensor([0] + seq_lens[:-1]).cumsum(0)
    lens = torch.tensor(seq_lens)
    states = states.clone()
    out = torch.empty_like(v)
    for i in range(max(seq_lens, default=0)):
        active = (lens > i).nonzero().flatten()
        rows = starts[active] + i
        o, states[active] = recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], states[active])
        out[rows] = o
    return out, states


def chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of C tokens, prepared and head-major: q, k [H, C, dk], v [H, C, dv], g, beta [H, C], state
    [H, dk, dv] -> (o [H, C, dv], state after the chunk). Positions past the sequence's end are padding with
    g = beta = k = v = 0: they neither decay nor write the state.

    With G the within-chunk cumulative sum of g and D[i, j] = exp(G_i - G_j) for j <= i (0 above), unrolling the
    recurrence gives the writes U = L^-1 (beta V) - L^-1 (beta exp(G) K) S, L = I + strictly_lower(beta K K^T * D);
    then O = (exp(G) Q) S + (Q K^T * D) U and S' = exp(G_C) S + (exp(G_C - G) K)^T U."""
    c = q.shape[1]
    cum = g.cumsum(dim=-1)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.mT) * decay
    writes = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    u = writes - reads @ state
    o = (q * cum.exp()[..., None]) @ state + ((q @ k.mT) * decay) @ u
    last = cum[..., -1:]
    state = state * last.exp()[..., None] + (k * (last - cum).exp()[..., None]).mT @ u
    return o, state


def chunked_gated_delta_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, start: int, chunk_size: int = 64) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    """The chunked form on the absolute grid for one sequence whose first new token is at position `start`:
    q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv] (raw), state [Hv, dk, dv] float32 -> (o [T, Hv, dv] float32,
    new state). Tokens before the first multiple of chunk_size take the recurrent step; each grid chunk after,
    the last padded, takes chunk_step (see the module docstring for what the bits depend on)."""
    q, k, v, g, beta = prepare_qkvgb(q, k, v, g, beta)
    t = q.shape[0]
    head = min(-start % chunk_size, t)
    out = torch.empty_like(v)
    for i in range(head):
        o, s = recurrent_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], state[None])
        out[i], state = o[0], s[0]
    for lo in range(head, t, chunk_size):
        n = min(chunk_size, t - lo)
        pad = chunk_size - n
        qc, kc, vc = (F.pad(x[lo:lo + n], (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))
        gc, bc = (F.pad(x[lo:lo + n], (0, 0, 0, pad)).t() for x in (g, beta))
        o, state = chunk_step(qc, kc, vc, gc, bc, state)
        out[lo:lo + n] = o.transpose(0, 1)[:n]
    return out, state
