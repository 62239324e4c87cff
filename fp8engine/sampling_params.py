"""SamplingParams: how one request is sampled and what it returns."""

import json
import math
from dataclasses import dataclass, field

MAX_LOGIT_BIAS = 100.0
STRUCTURED = ("json_schema", "regex", "grammar")


@dataclass(slots=True)
class SamplingParams:
    """Sampling options of one request.

    n: samples per prompt (they share the prompt's KV blocks).
    temperature: 0 means greedy. top_k: -1 = off (0 too, as vLLM takes it: read as -1). top_p in (0, 1].
    min_p in [0, 1].
    max_tokens / min_tokens: bounds on generated tokens (min_tokens suppresses EOS and stops).
        max_tokens=0 generates nothing: the prompt is only computed (scored, with prompt_logprobs).
    stop / stop_token_ids / ignore_eos: extra stop conditions; a stop string is cut from the text.
    seed: per-request seed; the noise of sample i at position p is a stateless hash of (seed, i, p),
        so a seeded sample reproduces whatever it is batched with. None: the engine draws one and
        reports it (CompletionOutput.seed).
    logprobs: None = none; k >= 0 = the sampled token's logprob plus the top-k alternatives.
    logprobs_mode: "raw" = log-softmax of the logits; "processed" = log-probability under the
        distribution actually sampled from (after temperature, top-k, top-p, min-p). Greedy
        sampling is a point mass, so processed logprobs are 0 there.
    prompt_logprobs: None or k >= 0: raw logprobs of the prompt tokens (first is None), and with
        k > 0 the top-k alternatives of each (RequestOutput.prompt_top_logprobs).
    return_routed_experts: MoE models only; CompletionOutput.routed_experts gets the experts every fed
        position was routed to (for routing replay in the trainer).
    presence_penalty / frequency_penalty (OpenAI, in [-2, 2]): subtracted from the logit of every
        token already generated, once / once per occurrence. repetition_penalty (> 0, 1 = off; the
        CTRL rule): logits of tokens in the prompt or output are divided by it when positive,
        multiplied when negative. logit_bias: {token_id: bias in [-100, 100]} added to the logits.
        All four change the distribution sampled from (and so processed logprobs), never raw ones.
    json_schema / regex / grammar (at most one; structured.py): only tokens that keep the output inside a JSON
        schema (a dict or its JSON text; {"type": "object"} for any object), a regular expression or an EBNF
        grammar (xgrammar's dialect) are drawn, and the sample ends at a stop token once the grammar is complete.
        Processed logprobs are under that masked distribution and log_kept_mass includes the mask's share; raw
        logprobs are unchanged. Not with ignore_eos or min_tokens (the grammar decides where a stop may come).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    logprobs_mode: str = "processed"
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    return_routed_experts: bool = False
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        _require(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _require(self.temperature >= 0.0, "temperature", self.temperature, ">= 0")
        _require(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _require(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
                 "top_k", self.top_k, "-1 or 0 (off) or >= 1")
        if self.top_k == 0:  # vLLM's "off" too (TRL's server mode sends it): kept as ours
            self.top_k = -1
        _require(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 0,
                 "max_tokens", self.max_tokens, "an integer >= 0")
        _require(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                 "min_tokens", self.min_tokens, "an integer in [0, max_tokens]")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
                 "logprobs", self.logprobs, "None or an integer >= 0")
        _require(self.prompt_logprobs is None
                 or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
                 "prompt_logprobs", self.prompt_logprobs, "None or an integer >= 0")
        _require(self.logprobs_mode in ("raw", "processed"), "logprobs_mode", self.logprobs_mode,
                 "'raw' or 'processed'")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                 "non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids", self.stop_token_ids, "non-negative token ids")
        _require(isinstance(self.return_routed_experts, bool), "return_routed_experts", self.return_routed_experts,
                 "a bool")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(math.isfinite(value) and -2.0 <= value <= 2.0, name, value, "in [-2, 2]")
        _require(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
                 "repetition_penalty", self.repetition_penalty, "> 0 (1 = off)")
        _require(self.logit_bias is None or all(
            isinstance(t, int) and t >= 0 and math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS
            for t, b in self.logit_bias.items()),
            "logit_bias", self.logit_bias, f"{{token_id >= 0: bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]}}")
        self._validate_structured()

    def _validate_structured(self) -> None:
        given = [name for name in STRUCTURED if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"SamplingParams.{given[1]}: at most one of {', '.join(STRUCTURED)} may be given, got "
                             f"{' and '.join(given)}")
        if not given:
            return
        name = given[0]
        _require(not self.ignore_eos and self.min_tokens == 0, name, getattr(self, name),
                 "used without ignore_eos and min_tokens (the grammar decides where the output may end)")
        if name == "json_schema":
            _require(isinstance(self.json_schema, (dict, str)), name, self.json_schema, "a dict or its JSON text")
            try:
                schema = json.loads(self.json_schema) if isinstance(self.json_schema, str) else self.json_schema
                json.dumps(schema)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"SamplingParams.json_schema must be a JSON schema (a dict or its JSON text): "
                                 f"{exc}") from None
            _require(isinstance(schema, dict), name, self.json_schema, "a JSON object (a schema)")
        else:
            _require(isinstance(getattr(self, name), str) and getattr(self, name), name, getattr(self, name),
                     "a non-empty string")

    @property
    def structured(self) -> tuple[str | None, str | None]:
        """(the structured-output option given, its value as text: a schema as JSON), or (None, None)."""
        for name in STRUCTURED:
            value = getattr(self, name)
            if value is not None:
                return name, json.dumps(value) if isinstance(value, dict) else value
        return None, None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or logit_bias change the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


def _require(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
