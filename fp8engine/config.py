"""EngineConfig: every engine option in one validated dataclass."""

import os
from dataclasses import dataclass, field, fields

import torch

DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_KV_FRACTION = 0.85
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Allowed values, checked by EngineConfig and offered as the CLI's choices.
DTYPES = tuple(_DTYPES)
QUANTIZATIONS = (None, "fp8")
FP8_SCALE_FMTS = (None, "ue8m0")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
KV_SCALE_MODES = ("recompute", "external", "static")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
SPECULATIVE = (None, "ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 16
MAX_LORA_RANK = 256
MAX_STATE_FRACTION = 0.75  # of the KV budget, for running sequences' GDN states; snapshots up to 1/8 more


def _option(default, help: str, choices: tuple | None = None, unit: str | None = None):
    """A field with its one-line help, its allowed values and its unit ("bytes") as metadata."""
    return field(default=default, metadata={"help": help, "choices": choices, "unit": unit})


@dataclass(slots=True)
class EngineConfig:
    """Engine options, validated on construction (a ValueError names the option and the value).

    Each field's metadata holds its one-line help and, where the values are fixed, the allowed ones;
    the CLI flags are derived from them, and so is the list below.
    """

    model: str = _option("default", "'default' (the bundled SmolLM2-135M-Instruct) or a Hugging Face "
                                    "model directory")
    dtype: str = _option("bfloat16", "model dtype of weights, activations and (with kv_cache_dtype auto) "
                                     "the KV cache", DTYPES)
    quantization: str | None = _option(None, "linear layers: none (model dtype) or fp8 (W8A8: 128x128 "
                                             "weight blocks, 1x128 activation groups)", QUANTIZATIONS)
    fp8_scale_fmt: str | None = _option(None, "FP8 block scales: none (float32, amax / 448) or ue8m0 "
                                              "(rounded up to a power of two)", FP8_SCALE_FMTS)
    kv_cache_dtype: str = _option("auto", "KV cache: auto (the model dtype) or fp8_e4m3 (half the bytes "
                                          "per token of bfloat16)", KV_CACHE_DTYPES)
    kv_scale_mode: str = _option("recompute", "FP8 KV scales: recompute (the first forward after each "
                                              "weight version sets them), external (sent with each weight "
                                              "update) or static (from the checkpoint, else 1.0)",
                                 KV_SCALE_MODES)
    kv_scale_margin: float = _option(1.2, "recompute mode multiplies the measured k/v amax by this "
                                          "(>= 1.0) before dividing by 448")
    fp8_attention: bool = _option(False, "full FP8: attention math on FP8 Q/K/V too (needs kv_cache_dtype "
                                         "fp8_e4m3)")
    device: str = _option("auto", "auto (cuda when available, else cpu), cpu or cuda", DEVICES)
    block_size: int = _option(16, "tokens per KV block")
    kv_cache_memory_bytes: int | None = _option(
        None, f"KV cache budget in bytes; none = {DEFAULT_CPU_KV_BYTES >> 30} GiB on CPU, "
              f"{DEFAULT_GPU_KV_FRACTION:.0%} of the free memory on CUDA left by the weights and a profiled "
              f"max_num_batched_tokens step (or set num_kv_blocks)", unit="bytes")
    num_kv_blocks: int | None = _option(None, "KV cache size in blocks, instead of a budget in bytes")
    state_memory_fraction: float = _option(0.5, "hybrid models (Qwen3.5, Qwen3-Next): the share of "
                                                "kv_cache_memory_bytes that running sequences' fixed-size GDN "
                                                "states may take (more sequences wait for a slot; prefix-cache "
                                                "snapshots take up to an eighth more, the KV blocks the rest), "
                                                f"in (0, {MAX_STATE_FRACTION}]")
    max_num_seqs: int = _option(256, "most sequences running in one step")
    max_num_batched_tokens: int = _option(8192, "token budget of one step (prefill chunks and decodes "
                                                "together)")
    max_model_len: int | None = _option(None, "longest prompt + completion in tokens; none = the model's "
                                              "limit")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of prompt prefixes already computed")
    batch_invariant: bool = _option(False, "a request's tokens and logprobs do not depend on what else is "
                                           "batched, on prefill chunking, prefix-cache hits or preemption "
                                           "(bfloat16 on CPU)")
    lm_head_fp32: bool = _option(False, "LM head matmul and logits in float32 (the weight stays in the model "
                                        "dtype)")
    lm_head_fp8: bool = _option(False, "LM head weight in FP8 too (128x128 blocks, 1x128 activation groups, as the "
                                       "linears; needs quantization fp8): half the head's bytes, the largest read of a "
                                       "small model's decode step, at a logprob mismatch the FP8-RL recipe avoids by "
                                       "keeping the head in the model dtype (docs/benchmarks.md measures it)")
    speculative: str | None = _option(None, "speculative decoding, exact (each emitted token is the model's own "
                                            "sample): none, ngram (drafts from the sequence's prompt and tokens) or "
                                            "suffix (also from its prompt group and earlier rollouts of its prompt)",
                                      SPECULATIVE)
    num_speculative_tokens: int = _option(4, f"most draft tokens a sequence verifies in one step (1-"
                                             f"{MAX_SPECULATIVE_TOKENS}; adapted per sequence to its acceptance)")
    speculative_forget_on_update: bool = _option(False, "suffix drafting forgets earlier rollouts at every weight "
                                                        "update")
    max_lora_rank: int = _option(0, f"> 0: every q/k/v/o and gate/up/down linear carries a LoRA adapter of rank up to "
                                    f"this (<= {MAX_LORA_RANK}), unmerged in the model dtype beside the base "
                                    f"(update_lora)")
    enforce_eager: bool = _option(False, "CUDA: run every step eagerly (no CUDA graphs for decode steps)")
    async_scheduling: bool = _option(False, "CUDA: schedule and launch each decode step while the device still runs "
                                            "the one before (its tokens fed to the next on the device, read by the "
                                            "host a step later); needs decode graphs; same outputs "
                                            "(docs/gpu.md)")
    sleep_spill_dir: str | None = _option(None, "CPU: where sleep(level=1) keeps the weights' bytes while their "
                                                "memory is released (an unlinked file, read back by wake_up); a "
                                                "directory on disk, not tmpfs; none = FP8ENGINE_CACHE/spill")
    tensor_parallel_size: int = _option(1, "ranks one replica's model is split over (torch.distributed: gloo on "
                                           "CPU, NCCL on CUDA with a device per rank): > 1 starts that many - 1 "
                                           "worker processes beside the engine's, each holding a shard of the weights "
                                           "and of the KV cache (docs/scale-out.md)")
    expert_parallel: bool = _option(False, "MoE with tensor_parallel_size > 1: whole experts per rank (num_experts / "
                                           "T each), the router on every rank; without it every expert's "
                                           "intermediate rows are split over the ranks, as a dense MLP's")
    seed: int = _option(0, "seeds the per-request seeds of requests that give none")
    load_format: str = _option("auto", "auto (the model directory's safetensors) or dummy (seeded random weights "
                                       "from its config.json alone: for benchmarks of a model's shape)", LOAD_FORMATS)

    def __post_init__(self):
        for f in fields(self):
            if f.metadata["choices"] is not None:
                _check_choice(f.name, getattr(self, f.name), f.metadata["choices"])
        if self.lm_head_fp8 and self.quantization != "fp8":
            raise ValueError(f"lm_head_fp8=True needs quantization='fp8', got quantization={self.quantization!r}")
        if self.lm_head_fp8 and self.lm_head_fp32:
            raise ValueError("lm_head_fp8=True and lm_head_fp32=True exclude each other: choose one LM head")
        if self.fp8_attention and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError("fp8_attention=True needs kv_cache_dtype='fp8_e4m3'")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens"):
            _check_positive(name, getattr(self, name))
        for name in ("kv_cache_memory_bytes", "num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if not (type(self.max_lora_rank) is int and 0 <= self.max_lora_rank <= MAX_LORA_RANK):
            raise ValueError(f"max_lora_rank must be an integer in [0, {MAX_LORA_RANK}], got {self.max_lora_rank!r}")
        if self.kv_cache_memory_bytes is not None and self.num_kv_blocks is not None:
            raise ValueError("set at most one of kv_cache_memory_bytes and num_kv_blocks")
        share = self.state_memory_fraction
        if not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= MAX_STATE_FRACTION):
            raise ValueError(f"state_memory_fraction must be a number in (0, {MAX_STATE_FRACTION}] (snapshots take "
                             f"up to 1/8 more and the KV cache needs the rest), got {self.state_memory_fraction!r}")
        if not self.kv_scale_margin >= 1.0:
            raise ValueError(f"kv_scale_margin must be >= 1.0, got {self.kv_scale_margin}")
        if self.model != "default" and not os.path.isdir(self.model):
            raise ValueError(f"model must be 'default' or a Hugging Face model directory; "
                             f"{self.model!r} is not a directory")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        self._check_tensor_parallel()
        if self.batch_invariant and (self.device not in ("cpu", "cuda") or self.dtype != "bfloat16"):
            raise ValueError(f"batch_invariant=True needs device 'cpu' (the C++ kernels) or 'cuda' (the Triton "
                             f"ones) and dtype='bfloat16'; got device={self.device!r}, dtype={self.dtype!r}")

    def _check_tensor_parallel(self) -> None:
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8_e4m3"


EngineConfig.__doc__ = EngineConfig.__doc__.rstrip() + "\n\n" + "".join(
    f"    {f.name}: {f.metadata['help']}.\n" for f in fields(EngineConfig))


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
