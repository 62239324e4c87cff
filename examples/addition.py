"""The few-shot addition task of the GRPO examples (grpo_tiny.py, trl_grpo.py): a verifiable reward.

The prompt is a few-shot addition table ending in "a+b="; a response earns 1 when its first integer
is a+b, else 0.
"""

import random
import re

from fp8engine import EngineConfig

FEW_SHOT = "3+4=7\n12+5=17\n"


def make_problems(rng: random.Random, count: int, max_operand: int) -> tuple[list[str], list[int]]:
    pairs = [(rng.randint(1, max_operand), rng.randint(1, max_operand)) for _ in range(count)]
    return [f"{FEW_SHOT}{a}+{b}=" for a, b in pairs], [a + b for a, b in pairs]


def answer_reward(text: str, answer: int) -> float:
    """1.0 where the first integer of `text` is `answer`, else 0.0."""
    found = re.search(r"-?\d+", text)
    return float(found is not None and int(found.group()) == answer)


def engine_config(rollout: str, exact: bool = False) -> EngineConfig:
    """fp8: FP8 linear + FP8 KV (scales recomputed for each weight version); bf16: the plain engine.
    exact: batch invariant, so the engine can replay a rollout's logprobs bit for bit for the trainer."""
    fp8 = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", kv_scale_mode="recompute")
    return EngineConfig(dtype="bfloat16", kv_cache_memory_bytes=256 << 20, batch_invariant=exact,
                        **(fp8 if rollout == "fp8" else {}))
