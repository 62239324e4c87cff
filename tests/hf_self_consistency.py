"""How well Hugging Face transformers agrees with itself in BF16 on the fidelity prompts: the floor
under the engine-vs-HF comparison in test_fidelity.py.

    python -m tests.hf_self_consistency

Greedy continuations with and without HF's KV cache, and HF's decode-time logprobs (generate with
its cache) against its own teacher-forced logprobs of the same tokens.
"""

import torch

from fp8engine import SamplingParams
from tests.conftest import make_engine
from tests.hf_reference import hf_logprobs, load_hf
from tests.prompts import PROMPTS
from fp8engine.weights.default_model import default_model_path


@torch.inference_mode()
def main() -> None:
    hf = load_hf(str(default_model_path()), torch.bfloat16)
    engine = make_engine(dtype="bfloat16")  # renders the prompts exactly as the fidelity test does
    eos = sorted(engine.eos_token_ids)
    same, diffs = 0, []
    for prompt in PROMPTS:
        ids = engine.generate([prompt], SamplingParams(max_tokens=1))[0].prompt_token_ids
        x = torch.tensor([ids])
        kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False, eos_token_id=eos,
                      pad_token_id=eos[0])
        cached = hf.generate(x, use_cache=True, output_logits=True, return_dict_in_generate=True, **kwargs)
        uncached = hf.generate(x, use_cache=False, **kwargs)
        tokens = cached.sequences[0, len(ids):].tolist()
        same += tokens == uncached[0, len(ids):].tolist()
        decode = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(cached.logits, tokens)]
        diffs += [abs(a - b) for a, b in zip(decode, hf_logprobs(hf, ids, tokens))]
    print(f"HF bf16 generate with vs without its KV cache: {same}/{len(PROMPTS)} identical greedy continuations; "
          f"decode-time vs teacher-forced logprobs: mean |d| {sum(diffs) / len(diffs):.4f}")


if __name__ == "__main__":
    main()
