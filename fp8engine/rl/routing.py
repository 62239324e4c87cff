"""Routing replay: a transformers MoE policy routed through the experts the rollout engine chose.

    batch = rollouts.rollout(prompts, n=8, sampling_params=SamplingParams(..., return_routed_experts=True))
    with replay_routing(policy, batch.routed_experts):
        train_lp = response_logprobs(policy, batch, params)

Inside the block each MoE router of `policy` (transformers' Qwen3-MoE `mlp.gate`, in layer order, one per
`num_moe_layers` column) keeps its own logits and softmax but takes the top-k expert ids from
`routed_experts` ([B, S, num_moe_layers, top_k], aligned with the forward's input_ids) instead of its own
top-k; the expert weights are the policy's probabilities of those experts (renormalised when the model's
`norm_topk_prob` says so), so gradients reach the router as usual. The forward must see exactly
[B, S] tokens (a RolloutBatch's input_ids).
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of a transformers causal LM, in layer order (modules with `top_k` and `weight`
    under a layer's `mlp.gate`)."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    return [layer.mlp.gate for layer in layers if hasattr(getattr(layer.mlp, "gate", None), "top_k")]


@contextlib.contextmanager
def replay_routing(model: nn.Module, routed_experts: torch.Tensor) -> Iterator[None]:
    """Within the block, every MoE router of `model` routes to `routed_experts` [B, S, L, top_k]."""
    routers = moe_routers(model)
    if routed_experts.dim() != 4 or routed_experts.shape[2:] != (len(routers), routers[0].top_k if routers else 0):
        raise ValueError(f"routed_experts must be [batch, seq, {len(routers)} MoE layers, top_k], "
                         f"got {tuple(routed_experts.shape)}")
    try:
        for i, router in enumerate(routers):
            router.forward = _replaying(router, routed_experts[:, :, i])
        yield
    finally:
        for router in routers:
            del router.forward  # back to the class's forward


def _replaying(router: nn.Module, ids: torch.Tensor):
    def forward(hidden: torch.Tensor):
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        index = ids.reshape(-1, router.top_k).to(device=logits.device, dtype=torch.long)
        if index.shape[0] != hidden.shape[0]:
            raise ValueError(f"the forward routes {hidden.shape[0]} tokens but routed_experts holds "
                             f"{index.shape[0]}")
        weights = probs.gather(-1, index)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), index
    return forward
