"""RolloutClient: the trainer adapter over HTTP, against `fp8engine serve`."""

import dataclasses
import time
from collections.abc import Mapping, Sequence

import httpx
import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn
from transformers import AutoTokenizer

from fp8engine.engine import Prompt
from fp8engine.outputs import EngineStats
from fp8engine.rl.batch import RolloutBatch, Sample, collate, pad_token_id, rollout_stats
from fp8engine.rl.rollout import PauseMode, check_pause_mode, rollout_params
from fp8engine.rl.sync import (DEFAULT_BUCKET_BYTES, SyncDtype, SyncReport, bucket_bytes_of,
                               buckets, check_bucket_bytes, check_version, named_tensors)
from fp8engine.sampling_params import SamplingParams
from fp8engine.weights.default_model import default_model_path
from fp8engine.weights.dist_update import DEFAULT_TIMEOUT_S, dtype_name

SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop",
                   "stop_token_ids", "ignore_eos", "seed", "logprobs", "logprobs_mode", "return_routed_experts",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
# GET calls that change nothing: retried after a connection error or a 502/503/504, with backoff.
IDEMPOTENT = frozenset({"/health", "/stats", "/weight_version", "/version", "/kv_scales"})
RETRY_STATUSES = frozenset({502, 503, 504})


class RolloutClient:
    """Trainer-facing rollouts and weight syncs against an `fp8engine serve` server.

    Same methods as `RolloutEngine` (in-process). base_url: e.g. "http://127.0.0.1:8000".
    api_key: bearer token; the RL endpoints (/update_weights, /pause, /resume, /stats) need the
    server's admin key when it has one (the admin key is accepted everywhere).
    bucket_bytes: body size of one /update_weights bucket (bytes, default 256 MiB).
    sync_dtype: floating tensors are cast to this before a sync; "auto" = bfloat16 (half the
    bytes of float32; an FP8 server then quantizes the BF16 values), None = keep the trainer's
    dtype. tokenizer: a tokenizer or a path for AutoTokenizer, used to turn text and chat prompts
    into token ids and to pad; default: the bundled default model's. timeout: seconds per HTTP
    call. retries / backoff: the idempotent calls (get_stats, weight_version, health) are retried that
    many times after a connection error or a 502/503/504, waiting backoff * 2^attempt seconds; other
    calls (rollouts, syncs, pause) are never retried, and their error says so. A -inf logprob (a token
    outside the kept set) arrives as the server's -9999.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, sync_dtype: SyncDtype = "auto",
                 tokenizer=None, timeout: float = 600.0, retries: int = 3, backoff: float = 0.5):
        if retries < 0 or backoff < 0:
            raise ValueError(f"retries and backoff must be >= 0; got {retries}, {backoff}")
        self.retries, self.backoff = retries, backoff
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.sync_dtype = torch.bfloat16 if sync_dtype == "auto" else sync_dtype
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or default_model_path())
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id(tokenizer)

    def close(self) -> None:
        self.http.close()

    def sync_weights(self, model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
                     weight_version: int) -> SyncReport:
        """POST the trainer's weights as safetensors buckets (start, add per bucket, commit);
        the server validates every bucket on arrival and writes nothing before the commit."""
        version = check_version(weight_version)
        start = time.perf_counter()
        self._update("start")
        sizes, num_tensors = [], 0
        for bucket in buckets(named_tensors(model_or_state_dict), self.bucket_bytes, self.sync_dtype):
            self._update("add", safetensors_bytes(dict(bucket)))
            sizes.append(bucket_bytes_of(bucket))
            num_tensors += len(bucket)
        self._update("commit", weight_version=version)
        return SyncReport(time.perf_counter() - start, sum(sizes), num_tensors, len(sizes), version)

    def rollout(self, prompts: Sequence[Prompt], n: int = 1,
                sampling_params: SamplingParams | None = None) -> RolloutBatch:
        """Generate `n` samples per prompt via /v1/completions; the same RolloutBatch as in-process."""
        params = rollout_params(prompts, n, sampling_params)
        token_prompts = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        body = {name: getattr(params, name) for name in SAMPLING_FIELDS}
        start = time.perf_counter()
        answer = self._request("POST", "/v1/completions",
                               json=body | {"prompt": token_prompts, "return_token_ids": True})
        seconds = time.perf_counter() - start
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * n:
            raise RuntimeError(f"the server returned {len(choices)} choices for {len(prompts)} "
                               f"prompts x n={n}")
        batch = collate([_sample(c) for c in choices], n, self.pad_token_id)
        batch.stats = rollout_stats(batch, seconds, self.get_stats())
        return batch

    def pause(self, mode: PauseMode = "abort") -> None:
        """Pause the server: in-flight requests are aborted ("abort"), finished ("wait"; new ones
        are refused in both) or kept, un-stepped, until resume() ("keep")."""
        self._request("POST", "/pause", json={"mode": check_pause_mode(mode)})

    def resume(self) -> None:
        self._request("POST", "/resume")

    def health(self) -> bool:
        """Whether the server answers /health (after the retries)."""
        try:
            self._request("GET", "/health")
        except RuntimeError:
            return False
        return True

    def weight_version(self) -> int:
        return int(self._request("GET", "/weight_version")["weight_version"])

    def get_stats(self) -> EngineStats:
        body = self._request("GET", "/stats")
        known = {f.name for f in dataclasses.fields(EngineStats)}
        stats = {k: v for k, v in body.items() if k in known}
        stats["kv_scales"] = {layer: tuple(kv) for layer, kv in stats["kv_scales"].items()}
        return EngineStats(**stats)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weights", backend: str = "gloo",
                                  timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """The server joins the trainer's weight-update group (LLMEngine.init_weights_update_group);
        returns once every rank joined, so the trainer joins (rank 0) from another thread or process."""
        self._request("POST", "/init_weights_update_group", json={
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend, "timeout_s": timeout_s})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str | torch.dtype],
                                        shapes: list[list[int]], weight_version: int | None = None) -> dict:
        """The server receives the tensors rank 0 broadcasts meanwhile (in `names` order) and applies
        them as update_weights does; returns its WeightUpdateReport as a dict."""
        return self._request("POST", "/update_weights_from_distributed", json={
            "names": list(names), "dtypes": [d if isinstance(d, str) else dtype_name(d) for d in dtypes],
            "shapes": [list(s) for s in shapes], "weight_version": weight_version})

    def destroy_weights_update_group(self) -> None:
        self._request("POST", "/destroy_weights_update_group")

    def _update(self, bucket: str, content: bytes = b"", **params) -> None:
        self._request("POST", "/update_weights", params={"bucket": bucket, **params}, content=content,
                      headers={"Content-Type": "application/octet-stream"})

    def _request(self, method: str, path: str, **kwargs) -> dict:
        attempts = 1 + (self.retries if method == "GET" and path in IDEMPOTENT else 0)
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt + 1 < attempts:
                    continue
                again = f"after {attempts} attempts" if attempts > 1 else "(not retried: it is not idempotent)"
                raise RuntimeError(f"{method} {path} failed {again}: {type(exc).__name__}: {exc}") from exc
            if response.status_code in RETRY_STATUSES and attempt + 1 < attempts:
                continue
            if response.is_error:
                raise RuntimeError(f"{method} {path} failed with HTTP {response.status_code}: "
                                   f"{response.text[:500]}")
            return response.json()
        raise AssertionError("unreachable")


def prompt_token_ids(tokenizer, prompt: Prompt) -> list[int]:
    """What LLMEngine tokenizes a prompt to: text as is, chat messages with the template."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return prompt


def _sample(choice: dict) -> Sample:
    routed = choice.get("routed_experts")
    return Sample(choice["prompt_token_ids"], choice["token_ids"],
                  choice["logprobs"]["token_logprobs"], choice.get("log_kept_mass"),
                  choice["finish_reason"], choice["num_preemptions"], choice["weight_version"],
                  choice["text"], None if routed is None else torch.tensor(routed, dtype=torch.int32))
