"""Trainer-side logprobs of a RolloutBatch's responses, under the engine's sampling semantics."""

import torch
from torch import Tensor, nn

from fp8engine.rl.batch import RolloutBatch, pad_float
from fp8engine.rl.correction import trainer_logprobs_from_params
from fp8engine.sampling_params import SamplingParams


def response_logprobs(model: nn.Module, batch: RolloutBatch, sampling_params: SamplingParams,
                      exact: bool = False) -> Tensor:
    """Logprobs of `batch.response_ids` under `model`, [B, R] float32, 0 on padding, differentiable.

    `model` is a Hugging Face-style causal LM (float32 or bf16; it returns `.logits`) run on
    prompt + response with the batch's attention mask and padding-aware positions. The logprobs
    follow `sampling_params` exactly as the engine's sampler does
    (`correction.trainer_logprobs_from_params`: raw, or processed = after temperature, top-k,
    top-p, min-p), so they compare one-to-one with `batch.rollout_logprobs`. A real token
    outside the trainer's own kept set gets -inf (its ratio to the rollout is 0).

    exact=True: the values come from the engine that made the batch (its forward, its weights as it
    holds them after the sync from `model`: BF16-rounded or FP8-quantized, its KV scales and sampler), so
    with EngineConfig(batch_invariant=True) they equal `batch.rollout_logprobs` bit for bit; the
    gradient is still `model`'s own (value exact + (ref - ref.detach()), ref = the exact=False result).
    Needs a batch from an in-process RolloutEngine still on the batch's weight version.
    """
    width = batch.response_ids.shape[1]
    if width == 0:
        return torch.zeros(batch.response_ids.shape, dtype=torch.float32)
    device = next(model.parameters()).device
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                position_ids=batch.position_ids.to(device), logits_to_keep=width + 1, use_cache=False)
    response_ids = batch.response_ids.to(device)
    logprobs, _ = trainer_logprobs_from_params(out.logits[:, :-1], response_ids, sampling_params)
    ref = torch.where(batch.response_mask.to(device).bool(), logprobs, 0.0)
    if not exact:
        return ref
    if batch.scorer is None:
        raise ValueError("exact=True needs a batch from an in-process RolloutEngine (a RolloutClient batch "
                         "carries no engine to replay it)")
    scores = pad_float(batch.scorer(*batch.prompts_and_responses(), sampling_params), width).to(device)
    scores = torch.where(batch.response_mask.to(device).bool(), scores, 0.0)  # an episode's observations: 0
    # + exactly 0 with ref's gradient; -inf (outside the trainer's kept set) passes no gradient
    return scores + torch.where(torch.isfinite(ref), ref - ref.detach(), 0.0)
