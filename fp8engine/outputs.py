"""What the engine returns: request outputs, weight-update reports and engine statistics."""

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request.

    logprobs[i]: logprob of token_ids[i] in the requested mode (None when not requested).
    top_logprobs[i]: {token_id: logprob} of the top-k alternatives plus the sampled token.
    log_kept_mass[i]: processed mode only, log of the probability mass kept by top-k/top-p/min-p
        truncation (0 when nothing is truncated); add it to a processed logprob to get the
        logprob under the temperature-only distribution.
    num_preemptions: times this sample was preempted (and recomputed).
    token_weight_versions[i]: the weight version that sampled token_ids[i] (a sample spans versions only
        when an update ran with in_flight="keep").
    num_kv_recomputes: times an update with kv_on_update="recompute" dropped this sample's KV (re-prefilled
        under the new weights; not a preemption).
    spec_draft_tokens, spec_accepted_tokens: with speculative decoding, the draft tokens verified for this
        sample and how many of them equalled the token sampled there (0 without).
    seed: the request's sampling seed (SamplingParams.seed, or the one the engine drew when it had
        none); SamplingParams(seed=seed) with the same other params (and n > index) reproduces this
        sample, whose noise at each position is a function of (seed, index, position) alone.
    routed_experts: with SamplingParams(return_routed_experts=True) on a MoE model, int32
        [prompt_len + len(token_ids) - 1, num_moe_layers, top_k]: the experts each position fed to the
        model was routed to, by falling router probability (row p: the token at position p).
    """

    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    log_kept_mass: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    seed: int | None = None
    routed_experts: torch.Tensor | None = None
    token_weight_versions: list[int] = field(default_factory=list)
    num_kv_recomputes: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(self.logprobs))


@dataclass(slots=True)
class RequestOutput:
    """All samples of one request; weight_version is the version that sampled its last token (the version at
    admission before any token); each sample's token_weight_versions gives every token's.

    prompt_logprobs[i]: raw logprob of prompt token i (None for the first), with
    SamplingParams.prompt_logprobs set; prompt_top_logprobs[i]: {token_id: logprob} of its top-k
    alternatives plus the prompt token itself (None for the first), with prompt_logprobs=k > 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    weight_version: int
    prompt: str | None = None
    prompt_logprobs: list[float | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True)
class WeightUpdateReport:
    """What update_weights did: tensors written, bytes read, seconds, how many were quantized."""

    num_tensors: int
    num_bytes: int
    seconds: float
    num_quantized: int
    weight_version: int
    num_aborted: int = 0
    num_kv_recomputed: int = 0  # in-flight samples whose KV was dropped and re-prefilled (kv_on_update="recompute")


@dataclass(slots=True)
class SleepReport:
    """What sleep or wake_up did: the tags it released or took back (those already so are left out), the bytes it
    handed back to the device or took again, and its seconds."""

    tags: list[str]
    num_bytes: int
    seconds: float
    level: int = 0  # sleep's level (0 for wake_up)
    num_aborted: int = 0  # requests sleep(in_flight="abort") aborted
    num_kv_recomputed: int = 0  # samples whose KV the sleep dropped, re-prefilled after wake (in_flight="keep")


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's counters and state.

    kv_scales: attention layer name -> (k_scale, v_scale), 1.0 with a non-FP8 KV cache.
    linear_backend, attention_backend, decoder_backend: the names of what runs, from `kernels`.
    """

    num_preemptions_total: int
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    kv_cache_capacity_tokens: int
    prefix_cache_hit_rate: float
    weight_version: int
    kv_scales: dict[str, tuple[float, float]]
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_steps_total: int = 0
    step_seconds_total: float = 0.0  # time inside steps that ran the model (busy; the rest of the wall time is idle)
    num_requests_finished: int = 0
    kv_cache_dtype: str = "auto"
    linear_backend: str = "torch"
    attention_backend: str = "torch"
    decoder_backend: str = "python"  # "cpp-plan": the decoder layers in one C++ call (fused_decoder.py);
    # "cpp-plan-decode": a hybrid model's decode steps in one
    kernels: dict[str, str] = field(default_factory=dict)  # every kernel the engine chose (kernel_set.py), by role
    device: str = "cpu"
    last_weight_update_seconds: float = 0.0
    kv_recalibration_seconds_total: float = 0.0
    num_kv_recomputes_total: int = 0  # samples re-prefilled after an update (kv_on_update="recompute")
    kv_rescale_seconds_total: float = 0.0  # FP8 KV kept across a scale change, re-quantized in place
    speculative: str | None = None  # the draft source (EngineConfig.speculative)
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # ... equal to the token sampled at their position (emitted)
    spec_verifications: int = 0  # sequence-steps that verified a draft (each emits 1 + its accepted tokens)
    max_lora_rank: int = 0  # EngineConfig.max_lora_rank: > 0, the linears take a LoRA adapter (update_lora)
    lora_active: bool = False  # an adapter is loaded (the decoder plan steps aside while it is)
    sleeping: dict[str, int] = field(default_factory=dict)  # tag -> the level it sleeps at (sleep / wake_up)
    resident_bytes: dict[str, int] = field(default_factory=dict)  # tag -> bytes it holds now (0 while asleep)
    num_state_slots_total: int = 0  # hybrid models: per-sequence state slots of the linear-attention layers
    num_state_slots_free: int = 0
    state_bytes_per_sequence: int = 0  # one slot's bytes over every linear-attention layer
    num_state_snapshots: int = 0  # states kept at block boundaries for prefix-cache hits (kvcache/state_pool.py)
    num_state_snapshots_taken_total: int = 0
    weights_missing: int = 0  # weights a level-2 sleep released that no update has committed since (steps refuse)
    num_sleeps_total: int = 0
    sleep_seconds_total: float = 0.0  # inside sleep()
    wake_seconds_total: float = 0.0  # inside wake_up()
    num_graph_recaptures_total: int = 0  # CUDA: decode graphs captured again after a sleep dropped them
    graph_recapture_seconds_total: float = 0.0
