"""Server request limits, shared by the CLI flags and the server (no web imports here)."""

MAX_BODY_BYTES = 1 << 20  # OpenAI endpoints
MAX_UPDATE_BYTES = 2 << 30  # /update_weights bodies (safetensors)
LOGPROBS_MODES = ("raw", "processed", "raw_logprobs", "processed_logprobs")  # --logprobs-mode: ours, then vLLM's
