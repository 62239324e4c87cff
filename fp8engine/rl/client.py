"""RolloutClient: the trainer adapter over HTTP, against `fp8engine serve`."""

import dataclasses
import functools
import itertools
import json
import queue
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn
from transformers import AutoTokenizer

from fp8engine.engine import Prompt, check_update_options
from fp8engine.outputs import EngineStats, SleepReport
from fp8engine.rl.batch import (
    RolloutBatch,
    Sample,
    collate,
    pad_token_id,
    rollout_stats,
)
from fp8engine.rl.groups import (
    UNFINISHED,
    GroupBook,
    MinGroups,
    PartialGroup,
    Slot,
    check_min_groups,
    check_resume,
    continuation,
    enough,
    finished_at_length,
    gather,
    group_batch,
)
from fp8engine.rl.rollout import PauseMode, check_pause_mode, check_sessions, prompt_params, rollout_params
from fp8engine.rl.sync import (
    DEFAULT_BUCKET_BYTES,
    SyncDtype,
    SyncReport,
    bucket_bytes_of,
    buckets,
    check_bucket_bytes,
    check_version,
    named_tensors,
    peft_adapter,
    synced_dtype,
)
from fp8engine.sampling_params import SamplingParams
from fp8engine.weights.default_model import default_model_path
from fp8engine.weights.dist_update import (
    DEFAULT_TIMEOUT_S,
    broadcast_weights,
    dtype_name,
    free_port,
    init_process_group,
)

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
    sync_dtype: floating tensors are cast to this before a sync (pre-quantized FP8 codes and the
    scales keep theirs: rl.sync.synced_dtype); "auto" = bfloat16 (half the
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
        self.group = None  # a weight-update group with the server (use_weights_update_group)

    @functools.cached_property
    def max_model_len(self) -> int:
        """The served model's context (GET /v1/models), read once."""
        return int(self._request("GET", "/v1/models")["data"][0]["max_model_len"])

    def close(self) -> None:
        """Leave the weight-update group (when use_weights_update_group joined one) and close the connection."""
        if self.group is not None:
            group, self.group = self.group, None
            try:
                self.destroy_weights_update_group()
            finally:
                torch.distributed.destroy_process_group(group)
        self.http.close()

    def use_weights_update_group(self, master_address: str = "127.0.0.1", master_port: int | None = None, *,
                                 backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Sync over a torch.distributed group from now on: this trainer (rank 0) and the server (rank 1) join a
        group of their own (on master_port, a free one by default), and every later `sync_weights` broadcasts the
        tensors (cast to sync_dtype, a bucket at a time) instead of POSTing safetensors buckets — no
        serialization and no HTTP body, which the server reads at well under 100 MB/s (docs/async-rl.md). The
        server receives, validates and applies them as the HTTP path does, in_flight and kv_on_update included;
        a trainer that dies mid-broadcast leaves it on its old weights. close() leaves the group."""
        if self.group is not None:
            raise ValueError("this client already syncs over a weight-update group")
        port = master_port or free_port()
        with ThreadPoolExecutor(1, thread_name_prefix="fp8engine-group") as pool:
            group = pool.submit(init_process_group, master_address, port, 0, 2, backend=backend, timeout_s=timeout_s)
            self.init_weights_update_group(master_address, port, 1, 2, backend=backend, timeout_s=timeout_s)
            self.group = group.result()

    def sync_weights(self, model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
                     weight_version: int, *, in_flight: str = "wait", kv_on_update: str = "keep") -> SyncReport:
        """POST the trainer's weights as safetensors buckets (start, add per bucket, commit);
        the server validates every bucket on arrival and writes nothing before the commit.
        in_flight / kv_on_update: what the commit does to requests in flight, as in RolloutEngine.sync_weights
        (with "keep" the rollouts and streams of other threads go on under the new weights)."""
        version = check_version(weight_version)
        check_update_options(in_flight, kv_on_update)
        start = time.perf_counter()
        adapter = peft_adapter(model_or_state_dict) if self.takes_lora else None
        if adapter is not None:
            tensors, scaling = adapter
            report = self.update_lora(tensors, scaling, weight_version=version, in_flight=in_flight,
                                      kv_on_update=kv_on_update)
            return SyncReport(time.perf_counter() - start, report["num_bytes"], len(tensors), 1, version)
        if self.group is not None:
            return self._broadcast(model_or_state_dict, version, in_flight, kv_on_update, start)
        self._update("start")
        sizes, num_tensors = [], 0
        for bucket in buckets(named_tensors(model_or_state_dict), self.bucket_bytes, self.sync_dtype):
            self._update("add", safetensors_bytes(dict(bucket)))
            sizes.append(bucket_bytes_of(bucket))
            num_tensors += len(bucket)
        self._update("commit", weight_version=version, in_flight=in_flight, kv_on_update=kv_on_update)
        return SyncReport(time.perf_counter() - start, sum(sizes), num_tensors, len(sizes), version)

    @functools.cached_property
    def takes_lora(self) -> bool:
        """Whether sync_weights sends a PEFT model's adapter alone (the server's engine has LoRA buffers)."""
        return self.get_stats().max_lora_rank > 0

    def update_lora(self, adapter: Mapping[str, torch.Tensor], scaling: float | Mapping[str, float], *,
                    weight_version: int | None = None, in_flight: str = "wait", kv_on_update: str = "keep") -> dict:
        """POST /update_lora: the adapter (PEFT's names) as one safetensors body, a per-module scaling in its
        metadata; the server's LLMEngine.update_lora report as a dict."""
        params = {"in_flight": in_flight, "kv_on_update": kv_on_update}
        metadata = None
        if isinstance(scaling, Mapping):
            metadata = {"lora_scaling": json.dumps(dict(scaling))}
        else:
            params["scaling"] = scaling
        if weight_version is not None:
            params["weight_version"] = weight_version
        body = safetensors_bytes({n: t.detach().to("cpu").contiguous() for n, t in adapter.items()}, metadata)
        return self._request("POST", "/update_lora", params=params, content=body,
                             headers={"Content-Type": "application/octet-stream"})

    def _broadcast(self, source, version: int, in_flight: str, kv_on_update: str, start: float) -> SyncReport:
        """sync_weights over the group: the server is told the names, dtypes and shapes (after the cast), then
        receives the broadcast while this thread sends it, a bucket of copies at a time."""
        items = list(named_tensors(source))  # one pass: for an FSDP model each pass is a collective gather
        specs = [(name, synced_dtype(name, t, self.sync_dtype), list(t.shape)) for name, t in items]
        names, dtypes, shapes = (list(x) for x in zip(*specs)) if specs else ([], [], [])
        num_bytes = num_buckets = 0
        with ThreadPoolExecutor(1, thread_name_prefix="fp8engine-sync") as pool:
            applied = pool.submit(self.update_weights_from_distributed, names, dtypes, shapes, version,
                                  in_flight=in_flight, kv_on_update=kv_on_update)
            for bucket in buckets(items, self.bucket_bytes, self.sync_dtype):
                num_bytes += broadcast_weights(self.group, bucket)
                num_buckets += 1
            applied.result()
        return SyncReport(time.perf_counter() - start, num_bytes, len(names), num_buckets, version)

    def rollout(self, prompts: Sequence[Prompt], n: int = 1,
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                min_groups: MinGroups = None, resume: Sequence[PartialGroup] | None = None,
                sessions: Sequence[Hashable] | None = None) -> RolloutBatch:
        """Generate `n` samples per prompt via /v1/completions; the same RolloutBatch as in-process.
        min_groups / resume: as RolloutEngine.rollout; the groups then run as one streamed request each, and
        the ones still running once enough finished are disconnected (the server aborts them) and kept, with
        the tokens they streamed, in batch.partial. sampling_params per prompt (a list) run that way too.
        sessions: as RolloutEngine.rollout (one server: nothing to route)."""
        resume = check_resume(resume, n)
        params = rollout_params(prompts, n, sampling_params, allow_empty=bool(resume),
                                per_prompt=min_groups is None and not resume)
        check_min_groups(min_groups, len(resume) + len(prompts))
        check_sessions(sessions, prompts)
        if min_groups is not None or resume or isinstance(params, list):
            return self._rollout_groups(prompts, params, min_groups, resume, n)
        token_prompts = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        start = time.perf_counter()
        answer = self._request("POST", "/v1/completions", json=self._body(params) | {"prompt": token_prompts})
        seconds = time.perf_counter() - start
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * n:
            raise RuntimeError(f"the server returned {len(choices)} choices for {len(prompts)} "
                               f"prompts x n={n}")
        batch = collate([_sample(c) for c in choices], n, self.pad_token_id)
        batch.group_prompts = list(prompts)
        batch.stats = rollout_stats(batch, seconds, self.get_stats())
        return batch

    def _rollout_groups(self, prompts: Sequence[Prompt], params: SamplingParams | list[SamplingParams],
                        min_groups: MinGroups, resume: list[PartialGroup], n: int) -> RolloutBatch:
        start = time.perf_counter()
        run = _HttpGroups(self, n, max_workers=len(prompts) + sum(g.num_unfinished for g in resume))
        finished, views = [], []
        try:
            run.add(resume, prompts, params)
            while run.active and not enough(min_groups, views):
                for key, prompt, samples in run.wait():
                    finished.append((key, prompt, samples))
                    views.append(group_batch(samples, n, self.pad_token_id, prompt)
                                 if callable(min_groups) else None)
        finally:
            partial = run.abort()
        batch = gather(finished, n, self.pad_token_id, partial, max(
            (s.weight_version for _, _, samples in finished for s in samples), default=-1))
        batch.stats = rollout_stats(batch, time.perf_counter() - start, self.get_stats())
        return batch

    def stream(self, prompts: Iterable[Prompt], n: int = 1, sampling_params: SamplingParams | None = None, *,
               max_groups_in_flight: int = 16) -> Iterator[RolloutBatch]:
        """A RolloutBatch (n rows) per prompt group as it finishes, as RolloutEngine.stream: one streamed request
        per group, at most max_groups_in_flight at a time; another thread may sync_weights(in_flight="keep")
        meanwhile. Closing the iterator disconnects the groups still running (the server aborts them)."""
        params = rollout_params([None], n, sampling_params)
        if not isinstance(max_groups_in_flight, int) or max_groups_in_flight < 1:
            raise ValueError(f"max_groups_in_flight must be an integer >= 1, got {max_groups_in_flight!r}")
        source = iter(prompts)
        run = _HttpGroups(self, n, max_workers=max_groups_in_flight)
        try:
            while True:
                more = list(itertools.islice(source, max_groups_in_flight - run.book.num_running))
                if more:
                    run.add([], more, params)
                if not run.active:
                    return
                for _, prompt, samples in run.wait():
                    yield group_batch(samples, n, self.pad_token_id, prompt)
        finally:
            run.abort()

    def _body(self, params: SamplingParams) -> dict:
        return {name: getattr(params, name) for name in SAMPLING_FIELDS} | {"return_token_ids": True}

    def pause(self, mode: PauseMode = "abort") -> None:
        """Pause the server: in-flight requests are aborted ("abort"), finished ("wait"; new ones
        are refused in both) or kept, un-stepped, until resume() ("keep")."""
        self._request("POST", "/pause", json={"mode": check_pause_mode(mode)})

    def resume(self) -> None:
        self._request("POST", "/resume")

    def sleep(self, level: int = 1, tags: Sequence[str] | None = None) -> SleepReport:
        """The server hands its memory back (POST /sleep; LLMEngine.sleep): generation answers 503 until wake_up()."""
        params = {"level": level, "mode": "wait"} | ({} if tags is None else {"tags": list(tags)})
        return _sleep_report(self._request("POST", "/sleep", params=params))

    def wake_up(self, tags: Sequence[str] | None = None) -> SleepReport:
        """The server takes its memory back (POST /wake_up), all of it or the tags given."""
        return _sleep_report(self._request("POST", "/wake_up", params={} if tags is None else {"tags": list(tags)}))

    def is_sleeping(self) -> bool:
        return bool(self._request("GET", "/is_sleeping")["is_sleeping"])

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
                                        shapes: list[list[int]], weight_version: int | None = None, *,
                                        in_flight: str = "wait", kv_on_update: str = "keep") -> dict:
        """The server receives the tensors rank 0 broadcasts meanwhile (in `names` order) and applies
        them as update_weights does (in_flight / kv_on_update as there); returns its WeightUpdateReport as a dict."""
        check_update_options(in_flight, kv_on_update)
        return self._request("POST", "/update_weights_from_distributed", json={
            "names": list(names), "dtypes": [d if isinstance(d, str) else dtype_name(d) for d in dtypes],
            "shapes": [list(s) for s in shapes], "weight_version": weight_version, "in_flight": in_flight,
            "kv_on_update": kv_on_update})

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


def _sleep_report(body: dict) -> SleepReport:
    known = {f.name for f in dataclasses.fields(SleepReport)}
    return SleepReport(**{k: v for k, v in body.items() if k in known})


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
                  choice["text"], None if routed is None else torch.tensor(routed, dtype=torch.int32),
                  choice.get("token_weight_versions"))


class _Streamed:
    """One sample as its stream chunks arrive (a choice's pieces joined)."""

    def __init__(self, prompt_ids: list[int]):
        self.sample = Sample(prompt_ids, [], [], None, UNFINISHED, 0, -1, "", None, [])

    def add(self, choice: dict) -> None:
        s = self.sample
        s.token_ids += choice.get("token_ids") or []
        s.logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
        if choice.get("log_kept_mass") is not None:
            s.log_kept_mass = (s.log_kept_mass or []) + choice["log_kept_mass"]
        s.token_weight_versions += choice.get("token_weight_versions") or []
        s.text += choice.get("text") or ""
        s.num_preemptions = choice.get("num_preemptions", s.num_preemptions)
        s.weight_version = choice.get("weight_version", s.weight_version)
        if choice.get("routed_experts") is not None:
            s.routed_experts = torch.tensor(choice["routed_experts"], dtype=torch.int32)
        if choice.get("finish_reason") is not None:
            s.finish_reason = choice["finish_reason"]


class _Stopped(Exception):
    pass


class _HttpGroups:
    """Prompt groups over HTTP: a streamed /v1/completions request per new group (its n samples) and per
    resumed unfinished sample, each read by a worker thread; whole groups come out of `wait()` as they finish,
    `abort()` disconnects the rest and keeps what they streamed."""

    def __init__(self, client: "RolloutClient", n: int, max_workers: int):
        self.client = client
        self.book = GroupBook(n)
        self.ready: list[tuple[int, object, list[Sample]]] = []
        self.done: queue.Queue = queue.Queue()
        self.pool = ThreadPoolExecutor(max(1, max_workers), thread_name_prefix="fp8engine-rollout")
        self.responses: dict[str, httpx.Response] = {}
        self.stopping = threading.Event()
        self._keys = itertools.count()
        self._ids = itertools.count()

    @property
    def active(self) -> bool:
        return bool(self.book.num_running or self.ready)

    def add(self, resume: list[PartialGroup], prompts: Sequence[Prompt],
            params: SamplingParams | list[SamplingParams]) -> None:
        for group in resume:
            key = next(self._keys)
            self.book.open(key, group.prompt, [None if s.finish_reason == UNFINISHED else s for s in group.samples])
            for index, first in enumerate(group.samples):
                if first.finish_reason != UNFINISHED:
                    continue
                more = continuation(params, first, index)
                if more is None:
                    self.book.samples[key][index] = finished_at_length(first)
                else:
                    self._submit(Slot(key, [index], [first]), first.prompt_ids + first.token_ids, more)
            if (done := self.book.finished_now(key)) is not None:
                self.ready.append(done)
        for i, prompt in enumerate(prompts):
            key = next(self._keys)
            self.book.open(key, prompt)
            mine = prompt_params(params, i)
            self._submit(Slot(key, list(range(mine.n)), [None] * mine.n),
                         prompt_token_ids(self.client.tokenizer, prompt), mine)

    def _submit(self, slot: Slot, prompt_ids: list[int], params: SamplingParams) -> None:
        request_id = str(next(self._ids))
        self.book.track(request_id, slot)
        body = self.client._body(params) | {"prompt": [prompt_ids], "stream": True}
        self.pool.submit(self._read, request_id, prompt_ids, params.n, body)

    def _read(self, request_id: str, prompt_ids: list[int], n: int, body: dict) -> None:
        samples = [_Streamed(prompt_ids) for _ in range(n)]
        error = None
        try:
            if not self.stopping.is_set():
                with self.client.http.stream("POST", "/v1/completions", json=body) as response:
                    self.responses[request_id] = response
                    if self.stopping.is_set():  # abort() closed the responses before this one was known
                        raise _Stopped
                    if response.is_error:
                        response.read()
                        raise RuntimeError(f"POST /v1/completions failed with HTTP {response.status_code}: "
                                           f"{response.text[:500]}")
                    for line in response.iter_lines():
                        if self.stopping.is_set() or line == "data: [DONE]":
                            break
                        if line.startswith("data: "):
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                raise RuntimeError(f"the server's stream failed: {chunk['error']}")
                            for choice in chunk["choices"]:
                                samples[choice["index"]].add(choice)
        except Exception as exc:  # noqa: BLE001 (handed to the caller's thread)
            if not self.stopping.is_set():  # closing a response under its reader raises: expected then
                error = exc if isinstance(exc, RuntimeError) else RuntimeError(
                    f"POST /v1/completions (streamed) failed: {type(exc).__name__}: {exc}")
        finally:
            self.responses.pop(request_id, None)
        self.done.put((request_id, [s.sample for s in samples], error))

    def wait(self) -> list[tuple[int, object, list[Sample]]]:
        """Block until a request ends; the groups that finished, as (key, prompt, samples)."""
        done, self.ready = self.ready, []
        if done:
            return done
        request_id, samples, error = self.done.get()
        if error is not None:
            raise error
        group = self.book.fill(request_id, samples)
        return [group] if group is not None else []

    def abort(self) -> list[tuple[int, PartialGroup]]:
        """Disconnect every request still running; the open groups with what they streamed, by key."""
        self.stopping.set()
        for response in list(self.responses.values()):
            response.close()
        self.pool.shutdown(wait=True)
        while self.book.slots:
            request_id, samples, _ = self.done.get()
            if request_id in self.book.slots:
                self.book.fill(request_id, samples, close=False)
        return self.book.partial()
