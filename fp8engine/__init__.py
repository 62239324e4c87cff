"""fp8engine: a paged-attention LLM inference engine for RL rollouts.

In-place FP8 weight updates, per-step FP8 KV-scale recalibration, per-token sampling logprobs
(raw and processed) and preemption counts. Start with:

    from fp8engine import LLMEngine, EngineConfig, SamplingParams
    engine = LLMEngine(EngineConfig(model="default"))
    outs = engine.generate(["What is 2+2?"], SamplingParams(n=4, max_tokens=64, logprobs=0))
"""

from fp8engine.config import EngineConfig
from fp8engine.engine import LLMEngine
from fp8engine.outputs import CompletionOutput, EngineStats, RequestOutput, SleepReport, WeightUpdateReport
from fp8engine.sampling_params import SamplingParams
from fp8engine.weights.default_model import default_model_path

__all__ = ["EngineConfig", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "SleepReport",
           "EngineStats", "WeightUpdateReport", "default_model_path"]
__version__ = "0.1.0"
