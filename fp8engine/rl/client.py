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

SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop",
                   "stop_token_ids", "ignore_eos", "seed", "logprobs", "logprobs_mode")


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
    call. A -inf logprob (a token outside the kept set) arrives as the server's -9999.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, sync_dtype: SyncDtype = "auto",
                 tokenizer=None, timeout: float = 600.0):
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
        token_prompts = [self._token_ids(p) for p in prompts]
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

    def get_stats(self) -> EngineStats:
        body = self._request("GET", "/stats")
        known = {f.name for f in dataclasses.fields(EngineStats)}
        stats = {k: v for k, v in body.items() if k in known}
        stats["kv_scales"] = {layer: tuple(kv) for layer, kv in stats["kv_scales"].items()}
        return EngineStats(**stats)

    def _update(self, bucket: str, content: bytes = b"", **params) -> None:
        self._request("POST", "/update_weights", params={"bucket": bucket, **params}, content=content,
                      headers={"Content-Type": "application/octet-stream"})

    def _request(self, method: str, path: str, **kwargs) -> dict:
        response = self.http.request(method, path, **kwargs)
        if response.is_error:
            raise RuntimeError(f"{method} {path} failed with HTTP {response.status_code}: "
                               f"{response.text[:500]}")
        return response.json()

    def _token_ids(self, prompt: Prompt) -> list[int]:
        """What LLMEngine tokenizes a prompt to: text as is, chat messages with the template."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return prompt


def _sample(choice: dict) -> Sample:
    return Sample(choice["prompt_token_ids"], choice["token_ids"],
                  choice["logprobs"]["token_logprobs"], choice.get("log_kept_mass"),
                  choice["finish_reason"], choice["num_preemptions"], choice["weight_version"],
                  choice["text"])
