"""The workloads and engine modes behind `fp8engine bench`: names and shapes only (the CLI reads them to build
its options without importing the engine)."""

import dataclasses
from dataclasses import dataclass

from fp8engine.config import SPECULATIVE

_BASE_MODES = {
    "bf16": dict(),
    "fp8-linear": dict(quantization="fp8"),
    "fp8-kv": dict(kv_cache_dtype="fp8_e4m3"),
    "full-fp8": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_attention=True),
}
# Each mode also batch invariant ("-bi"), and with the float32 or the FP8 LM head, to measure what they cost.
MODES = {**_BASE_MODES, **{f"{name}-bi": dict(options, batch_invariant=True) for name, options in _BASE_MODES.items()},
         "bf16-fp32head": dict(lm_head_fp32=True), "bf16-bi-fp32head": dict(batch_invariant=True, lm_head_fp32=True),
         # the LM head in FP8 too (lm_head_fp8: off the FP8-RL recipe, which keeps it in the model dtype)
         "full-fp8-head": dict(_BASE_MODES["full-fp8"], lm_head_fp8=True),
         "full-fp8-head-bi": dict(_BASE_MODES["full-fp8"], lm_head_fp8=True, batch_invariant=True)}


PROMPT_KINDS = ("chat", "random")
# --update-every: what each weight update does to the requests in flight (bench/in_flight.py)
IN_FLIGHT_POLICIES = ("none", "wait", "keep", "keep+recompute")
BASELINES = ("hf", "llama.cpp", "vllm")
# --speculative: each mode without speculation (off) and with these draft sources (EngineConfig.speculative)
SPECULATIVE_RUNS = ("off", *SPECULATIVE[1:])


@dataclass(frozen=True)
class Workload:
    """A throughput workload's shape. Its checks name the `fp8engine bench` flag that sets each field.

    prompts: "chat" (rl_prompts: arithmetic word problems, each its own length) or "random" (seeded
    random token ids, exactly `input_len` of them). max_tokens: output tokens per sample (ignore_eos).
    """

    name: str
    num_prompts: int
    n: int
    max_tokens: int
    temperature: float = 1.0
    kv_cache_tokens: int | None = None  # KV budget in tokens of a BF16 cache (memory pressure)
    max_num_seqs: int = 256
    model: str | None = None  # the workload's own model (MODELS) when --model is the default
    prompts: str = "chat"
    input_len: int | None = None

    def __post_init__(self):
        check_positive("--num-prompts", self.num_prompts)
        check_positive("--n", self.n)
        check_positive("--output-len (max_tokens)", self.max_tokens)
        if self.prompts not in PROMPT_KINDS:
            raise ValueError(f"--prompts must be one of {', '.join(PROMPT_KINDS)}, got {self.prompts!r}")
        if self.prompts == "chat" and self.input_len is not None:
            raise ValueError(f"--input-len {self.input_len} sets the length of random prompts; chat prompts have "
                             f"their own lengths: add --prompts random, or drop --input-len")
        if self.prompts == "random":
            if self.input_len is None:
                raise ValueError("--prompts random needs --input-len N (prompt tokens)")
            check_positive("--input-len", self.input_len)


def check_positive(flag: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
    return value


WORKLOADS = {
    "quick": Workload("quick", 8, 2, 32),
    "decode": Workload("decode", 1, 1, 256, temperature=0.0),
    "rl-short": Workload("rl-short", 32, 4, 128),
    # 128 sequences of ~430 tokens need ~55k KV slots: a BF16 cache of 30k tokens must preempt,
    # an FP8 cache of the same bytes (60k tokens) holds them all.
    "rl-long": Workload("rl-long", 16, 8, 384, kv_cache_tokens=30_000),
    # a small random Qwen3-MoE, 64 experts and top-8: the expert path (router, grouping, FP8 expert GEMMs)
    "moe": Workload("moe", 16, 4, 64, model="tiny-qwen3-moe"),
    # GRPO's shape: a few prompts, 8 samples each at T=1, long answers (the group's samples draft for each other)
    "grpo": Workload("grpo", 2, 8, 512),
}


# One line the table prints under a workload's figures: what its ratios measure.
MEANING = {
    "decode": "one sequence decodes, so each token reads every weight once and the CPU waits on memory: FP8 weights "
              "(fp8-linear, full-fp8) read half the bytes of BF16, and their ratio is what that saves here; fp8-kv "
              "halves only the KV cache, which one short sequence barely reads (its gain comes under KV pressure: "
              "--workload rl-long)",
    "rl-long": "the BF16 KV cache cannot hold every sequence and preempts (the preemption columns); an FP8 cache of the "
               "same bytes holds twice the tokens, which is what the fp8-kv and full-fp8 ratios measure",
}


def shaped(name: str, num_prompts: int | None = None, n: int | None = None, input_len: int | None = None,
           output_len: int | None = None, prompts: str | None = None) -> Workload:
    """WORKLOADS[name] with the shape flags that were given (not None) in place of its own, as vLLM's
    bench takes them: --num-prompts, --n, --input-len, --output-len, --prompts."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    changes = dict(num_prompts=num_prompts, n=n, input_len=input_len, max_tokens=output_len, prompts=prompts)
    return dataclasses.replace(WORKLOADS[name], **{k: v for k, v in changes.items() if v is not None})
