"""Hugging Face transformers as the reference the engine is checked against."""

import torch
from transformers import AutoModelForCausalLM


def load_hf(model_dir: str, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=sorted(eos_ids), pad_token_id=sorted(eos_ids)[0])
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_logprobs(model, prompt_ids: list[int], completion: list[int]) -> list[float]:
    """Teacher-forced raw logprobs of `completion` after `prompt_ids`."""
    ids = torch.tensor([prompt_ids + completion])
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(len(completion)), torch.tensor(completion)].tolist()
