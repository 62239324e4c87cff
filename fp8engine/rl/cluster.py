"""RolloutCluster: engine replicas as Ray actors, behind RolloutEngine's methods.

Ray places the replicas (a share of a node's CPU threads, or one GPU, each), runs them and says
which died; the weights travel through Ray's object store (each bucket put once, read in place by
every replica on a node) or over one torch.distributed broadcast from the trainer. Ray is imported
when a cluster is built, never by `import fp8engine.rl`.

    cluster = RolloutCluster(EngineConfig(), num_replicas=4)         # a local Ray, or address="auto"
    cluster.sync_weights(policy, weight_version=step)                # all replicas or none
    batch = cluster.rollout(prompts, n=8, sampling_params=params)    # prompt order kept
"""

import collections
import contextlib
import dataclasses
import functools
import itertools
import threading
import time
import warnings
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from transformers import AutoTokenizer

from fp8engine.config import EngineConfig
from fp8engine.engine import Prompt, check_update_options
from fp8engine.outputs import EngineStats, SleepReport, WeightUpdateReport
from fp8engine.rl.batch import (
    RolloutBatch,
    Sample,
    pad_token_id,
    rollout_stats,
)
from fp8engine.rl.client import prompt_token_ids
from fp8engine.rl.groups import (
    UNFINISHED,
    MinGroups,
    PartialGroup,
    check_min_groups,
    check_resume,
    enough,
    gather,
    group_batch,
)
from fp8engine.rl.rollout import (
    GroupRun,
    PauseMode,
    RolloutEngine,
    check_pause_mode,
    check_sessions,
    prompt_params,
    rollout_params,
)
from fp8engine.rl.sync import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
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
from fp8engine.weights import dist_update
from fp8engine.weights.default_model import default_model_path

MAX_SESSIONS = 1 << 16  # sessions whose replica the cluster remembers (the least recently used are forgotten)
REPLICA_THREADS = 4  # a replica's actor threads: generate streams while a commit, stop or get_stats lands
SyncMethod = Literal["object_store", "distributed"]
SYNC_METHODS = ("object_store", "distributed")
Packed = list[tuple[str, str, tuple[int, ...], object]]  # (name, dtype name, shape, numpy bytes)


@dataclass(slots=True)
class PromptGroup:
    """One prompt's n samples, which run on one replica (they share the prompt's KV blocks); a resumed
    group carries its PartialGroup, whose unfinished samples it continues."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt: object = None
    partial: PartialGroup | None = None
    session: Hashable | None = None  # the conversation it continues (rollout(..., sessions=...))

    @property
    def cost(self) -> int:
        """Tokens it keeps its replica busy with: the prompt once, then up to max_tokens per sample."""
        if self.partial is None:
            return len(self.prompt_ids) + self.params.n * self.params.max_tokens
        return len(self.prompt_ids) + sum(self.params.max_tokens - len(s.token_ids) for s in self.partial.samples
                                          if s.finish_reason == UNFINISHED)

    def unstarted(self) -> PartialGroup:
        """The group as a PartialGroup that has generated nothing (or its own partial)."""
        if self.partial is not None:
            return self.partial
        empty = Sample(self.prompt_ids, [], [], None, UNFINISHED, 0, -1, "", None, [])
        return PartialGroup(self.prompt, [dataclasses.replace(empty) for _ in range(self.params.n)])


@dataclass(slots=True)
class ClusterStats(EngineStats):
    """EngineStats of the whole cluster: counters summed over the live replicas (`*_total` floats
    summed, prefix_cache_hit_rate averaged, other floats the largest, weight_version the cluster's,
    the rest replica 0's), plus

    replicas: each live replica's own EngineStats; replica_ids: their ids (as errors and
        RolloutBatch.stats["replica_of_prompt"] name them). num_replicas: how many are live.
    replicas_lost: one line per replica that died ("replica 1 (ActorDiedError)").
    num_prompt_groups_rerun: prompt groups rerun on survivors because their replica died.
    """

    replicas: list[EngineStats] = field(default_factory=list)
    replica_ids: list[int] = field(default_factory=list)
    num_replicas: int = 0
    replicas_lost: list[str] = field(default_factory=list)
    num_prompt_groups_rerun: int = 0


class Replica:
    """One engine in its own Ray actor process (RolloutCluster builds it with ray.remote, with threads enough
    that a commit or a stop lands while `generate` streams: the engine is stepped in turns, see
    RolloutEngine.turns).

    It streams each prompt group's samples as the group finishes (`generate`), and takes a weight
    sync in two phases: `stage` (receive and validate, nothing written), then `commit` or `discard`.
    """

    def __init__(self, config: EngineConfig, num_threads: int | None = None):
        if num_threads is not None:  # shared by the replica's tensor-parallel ranks (they take rank 0's count)
            torch.set_num_threads(max(1, num_threads // config.tensor_parallel_size))
        self.rollouts = RolloutEngine(config)
        self.engine = self.rollouts.engine
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.staged_lora: tuple[list[tuple[str, torch.Tensor]], object] | None = None  # (adapter, scaling)
        self.stops: dict[int, threading.Event] = {}

    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, run_id: int, groups: list[PromptGroup]) -> Iterator[tuple[str, int, object]]:
        """("done", group index, its samples) for each group as it finishes; once `stop(run_id)` was called,
        ("partial", group index, PartialGroup) for each group still running (aborted, kept), then the end."""
        if self.rollouts.paused:
            raise RuntimeError(f"the replica is paused (mode {self.rollouts.paused!r})")
        stop = self.stops.setdefault(run_id, threading.Event())
        run = GroupRun(self.rollouts, groups[0].params.n if groups else 1)
        try:
            for group in groups:  # GroupRun numbers them 0, 1, ... in this order
                if group.partial is not None:
                    run.add([group.partial], [], group.params)
                else:
                    run.add([], [group.prompt_ids], group.params)
            while run.active and not stop.is_set():
                for key, _, samples in run.step():
                    yield "done", groups[key].index, samples
        finally:
            self.stops.pop(run_id, None)
            kept = run.abort()
        for key, partial in kept:
            yield "partial", groups[key].index, PartialGroup(groups[key].prompt, partial.samples)

    def stop(self, run_id: int) -> None:
        """Have generate(run_id) abort and return its unfinished groups (before it started, too)."""
        self.stops.setdefault(run_id, threading.Event()).set()

    def stage(self, packed: Packed) -> int:
        """Validate one bucket (read in place from the object store) and keep it for `commit`."""
        tensors = unpack(packed)
        self.engine.check_weights(tensors)
        self.staged += tensors
        return len(tensors)

    def stage_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        """Receive one broadcast update over the weight-update group, validate it, keep it for `commit`."""
        tensors = self.engine.receive_weights(names, dtypes, shapes, self.engine.prequantizer())
        self.engine.check_weights(tensors)
        self.staged += tensors
        return len(names)

    def stage_lora(self, packed: Packed, scaling) -> int:
        """Validate a LoRA adapter (PEFT's names) and keep it for `commit`, which loads it after any staged weights."""
        tensors = unpack(packed)
        self.engine.check_lora(tensors, scaling)
        self.staged_lora = tensors, scaling
        return len(tensors)

    def commit(self, weight_version: int, in_flight: str = "wait", kv_on_update: str = "keep") -> WeightUpdateReport:
        (staged, self.staged), (adapter, self.staged_lora) = (self.staged, []), (self.staged_lora, None)
        options = dict(weight_version=weight_version, in_flight=in_flight, kv_on_update=kv_on_update)
        with self.rollouts.turns.sync():
            if staged or adapter is None:
                report = self.engine.update_weights(staged, **options)
            if adapter is not None:
                report = self.engine.update_lora(*adapter, **options)
            return report

    def discard(self) -> None:
        self.staged, self.staged_lora = [], None

    def init_weights_update_group(self, *args) -> None:
        self.engine.init_weights_update_group(*args)

    def destroy_weights_update_group(self) -> None:
        self.engine.destroy_weights_update_group()

    def pause(self, mode: PauseMode) -> None:
        self.rollouts.pause(mode)

    def sleep(self, level: int, tags: list[str] | None) -> SleepReport:
        return self.rollouts.sleep(level, tags)

    def wake_up(self, tags: list[str] | None) -> SleepReport:
        return self.rollouts.wake_up(tags)

    def resume(self) -> None:
        self.rollouts.resume()

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def call(self, fn):
        """fn(engine) in the replica's process, for inspection (e.g. a weight checksum)."""
        return fn(self.engine)


@dataclass(eq=False, slots=True)
class _Run:
    """One cluster rollout's results so far, and whether it has enough (min_groups) to stop."""

    id: int
    min_groups: MinGroups
    n: int
    pad_token_id: int
    done: dict[int, list[Sample]] = field(default_factory=dict)
    partial: dict[int, PartialGroup] = field(default_factory=dict)
    placement: dict[int, int] = field(default_factory=dict)
    views: list = field(default_factory=list)
    stopped: bool = False

    def finish(self, group: PromptGroup, samples: list[Sample], replica_id: int) -> None:
        self.done[group.index], self.placement[group.index] = samples, replica_id
        self.views.append(group_batch(samples, self.n, self.pad_token_id, group.prompt)
                          if callable(self.min_groups) else None)

    def enough(self) -> bool:
        return enough(self.min_groups, self.views)


@dataclass(eq=False, slots=True)
class _Member:
    id: int
    actor: object


def replica_resources(config: EngineConfig, cpus: int) -> dict[str, int]:
    """What a replica's actor asks Ray for: on CUDA a GPU for each tensor-parallel rank (Ray gives one actor's GPUs on
    one node and makes them its visible devices; the ranks take them in order) and one CPU; on CPU `cpus` (its ranks'
    threads come out of them)."""
    if config.device == "cuda":
        return {"num_cpus": 1, "num_gpus": config.tensor_parallel_size}
    return {"num_cpus": cpus, "num_gpus": 0}


class RolloutCluster:
    """`num_replicas` engines as Ray actors, with RolloutEngine's methods and RolloutBatch.

    address: None starts a local Ray (or uses the one this process already joined); "auto" or
        "host:port" joins a running cluster (`ray start --head` on one node, `--address` on the rest).
    num_cpus_per_replica: CPU threads (and Ray CPUs) of one replica on the CPU, shared by its tensor-parallel ranks
        (config.tensor_parallel_size, each rank a process of its own beside the replica's actor); default: the Ray
        cluster's CPUs / num_replicas, at least 1. On CUDA each replica takes one GPU.
    sync_method: "object_store" (each bucket put into Ray's object store once; the replicas on a
        node read it in place; the last sync's buckets stay there for add_replica) or
        "distributed" (one torch.distributed broadcast from this process, rank 0, to every
        replica: gloo on the CPU, NCCL on CUDA; master_address: this process's address as the
        replicas reach it, default Ray's node IP).
    bucket_bytes / sync_dtype: as RolloutEngine's ("auto" = bfloat16 here: the bytes travel).
    timeout_s: how long a weight broadcast may stall before the replicas drop it.

    Dispatch: a prompt's n samples run on one replica; prompt groups go, in prompt order, to the
    replica with the fewest outstanding tokens (prompt + n * max_tokens). Requests without a seed
    get one per prompt here, so that a group rerun after its replica died samples the same tokens.
    sticky_sessions: a prompt given a session key (rollout(..., sessions=...), as rl.episodes does for each
    turn of an episode) goes to the replica that ran that session before, where its history is in the prefix
    cache; new sessions, and those whose replica died (their history travels in the prompt), go least-loaded.
    False: every prompt goes least-loaded (to compare).
    """

    def __init__(self, config: EngineConfig, num_replicas: int = 1, *, address: str | None = None,
                 num_cpus_per_replica: int | None = None, sync_method: SyncMethod = "object_store",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, sync_dtype: SyncDtype = "auto",
                 master_address: str | None = None, timeout_s: float = dist_update.DEFAULT_TIMEOUT_S,
                 sticky_sessions: bool = True):
        ray = _ray()
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        if sync_method not in SYNC_METHODS:
            raise ValueError(f"sync_method must be one of {list(SYNC_METHODS)}, got {sync_method!r}")
        if not ray.is_initialized():
            ray.init(address=address)
        self.config = config
        self.sync_method = sync_method
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.sync_dtype = torch.bfloat16 if sync_dtype == "auto" else sync_dtype
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.sticky_sessions = sticky_sessions
        self._session_replicas: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self.tokenizer = AutoTokenizer.from_pretrained(default_model_path() if config.model == "default"
                                                       else config.model)
        self.pad_token_id = pad_token_id(self.tokenizer)
        self.weight_version = 0
        self.paused: PauseMode | None = None
        self.replicas_lost: list[str] = []
        self.num_prompt_groups_rerun = 0
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        self._group_ids = itertools.count()
        self._run_ids = itertools.count()
        self._current_run: _Run | None = None
        self._group = None
        self._dead: set[int] = set()
        self._weights: list = []  # object refs of the last object-store sync's buckets
        self._lora: tuple | None = None  # (object ref, scaling) of the last LoRA adapter synced
        self._synced = False  # a sync of whole weights happened (not only of LoRA adapters)
        self._levels: dict[int, int] = {}  # replica id -> the level of its last sleep (wake_up's undo)
        self._asleep: set[str] = set()  # the tags the replicas released (sleep / wake_up)
        gpu = config.device == "cuda"
        cpus = num_cpus_per_replica or max(1, int(ray.cluster_resources().get("CPU", 1)) // num_replicas)
        self._threads = None if gpu else cpus
        self._actor_class = ray.remote(Replica).options(**replica_resources(config, cpus),
                                                        max_concurrency=REPLICA_THREADS)
        self._members = self._start(num_replicas)

    @functools.cached_property
    def max_model_len(self) -> int:
        """The replicas' context (they share one config), read once."""
        self._check_live()
        return _ray().get(self._members[0].actor.call.remote(_max_model_len))

    @property
    def replicas(self) -> list:
        """The live replicas' Ray actor handles."""
        return [m.actor for m in self._members]

    # ------------------------------------------------------------------ rollouts
    def rollout(self, prompts: Sequence[Prompt], n: int = 1,
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                min_groups: MinGroups = None, resume: Sequence[PartialGroup] | None = None,
                sessions: Sequence[Hashable] | None = None) -> RolloutBatch:
        """RolloutEngine.rollout over the replicas. A replica that dies meanwhile has its unfinished
        prompt groups rerun on the others (same seeds): the batch still comes back complete.
        min_groups / resume: as RolloutEngine.rollout, over the cluster's groups: once enough finished, every
        replica stops and returns its unfinished ones for batch.partial (the groups of a replica that died
        after that come back unstarted). batch.stats adds replica_of_prompt (the replica id that made each
        group's samples, in row order) and num_prompt_groups_rerun. sampling_params (one per prompt) and sessions:
        as RolloutEngine.rollout; see the class for how sessions are routed."""
        if self.paused:
            raise RuntimeError(f"the cluster is paused (mode {self.paused!r}); call resume() first")
        if self._asleep:
            raise RuntimeError(f"the cluster is asleep ({', '.join(sorted(self._asleep))} released); call wake_up() "
                               f"first")
        resume = check_resume(resume, n)
        params = rollout_params(prompts, n, sampling_params, allow_empty=bool(resume),
                                per_prompt=min_groups is None and not resume)
        check_min_groups(min_groups, len(resume) + len(prompts))
        keys = check_sessions(sessions, prompts) or [None] * len(prompts)
        groups = [PromptGroup(i, g.samples[0].prompt_ids, self._seeded(params), g.prompt, g)
                  for i, g in enumerate(resume)]
        groups += [PromptGroup(len(groups) + i, prompt_token_ids(self.tokenizer, p),
                               self._seeded(prompt_params(params, i)), p, session=keys[i])
                   for i, p in enumerate(prompts)]
        start = time.perf_counter()
        samples, partial, placement, num_rerun = self._run(groups, min_groups)
        seconds = time.perf_counter() - start
        batch = gather([(i, groups[i].prompt, s) for i, s in samples.items()], n, self.pad_token_id,
                       sorted(partial.items()), self.weight_version)
        batch.stats = rollout_stats(batch, seconds, self.get_stats()) | {
            "replica_of_prompt": [placement[i] for i in sorted(samples)], "num_prompt_groups_rerun": num_rerun}
        return batch

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        if params.seed is not None:
            return params
        return dataclasses.replace(params, seed=int(torch.randint(0, 2**62, (1,), generator=self._seeds)))

    def _run(self, groups: list[PromptGroup], min_groups: MinGroups = None
             ) -> tuple[dict[int, list[Sample]], dict[int, PartialGroup], dict[int, int], int]:
        run = _Run(next(self._run_ids), min_groups, groups[0].params.n if groups else 1, self.pad_token_id)
        self._current_run = run
        todo, num_rerun = groups, 0
        while todo:
            self._check_live()
            lost = self._collect(self._dispatch(todo), run)
            if run.stopped:
                run.partial |= {g.index: g.unstarted() for g in lost}
                break
            todo = lost
            num_rerun += len(todo)
        self.num_prompt_groups_rerun += num_rerun
        return run.done, run.partial, run.placement, num_rerun

    def _dispatch(self, groups: list[PromptGroup]) -> dict:
        """One streaming `generate` call per replica that gets groups: {stream: (member, its groups)}."""
        plan = self._plan(groups)
        streams = {}
        for i, member in enumerate(self._members):
            mine = [g for g, r in zip(groups, plan) if r == i]
            if mine:
                stream = member.actor.generate.options(num_returns="streaming").remote(self._current_run.id, mine)
                streams[stream] = (member, {g.index: g for g in mine})
        return streams

    def _collect(self, streams: dict, run: "_Run") -> list[PromptGroup]:
        """Gather every stream's groups (stopping them all once the run has enough); returns the unfinished
        groups of replicas that died."""
        ray = _ray()
        lost: list[PromptGroup] = []
        while streams:
            [stream], _ = ray.wait(list(streams), num_returns=1)
            member, unfinished = streams[stream]
            try:
                kind, index, value = ray.get(next(stream))
            except ray.exceptions.RayActorError as exc:
                self._lose(member, exc)
                lost += unfinished.values()
                unfinished.clear()
            else:
                group = unfinished.pop(index)
                if kind == "done":
                    run.finish(group, value, member.id)
                else:
                    run.partial[index] = value
                if not run.stopped and run.enough():
                    run.stopped = True
                    for m, _ in streams.values():
                        m.actor.stop.remote(run.id)
            if not unfinished:
                del streams[stream]
        return sorted(lost, key=lambda g: g.index)

    def _plan(self, groups: list[PromptGroup]) -> list[int]:
        """The live member (index) of each group: a known session's replica, else the least loaded."""
        ids = [m.id for m in self._members]
        known = self._session_replicas if self.sticky_sessions else {}
        pinned = [ids.index(known[g.session]) if g.session is not None and known.get(g.session) in ids else None
                  for g in groups]
        plan = assign([g.cost for g in groups], len(ids), pinned)
        for group, replica in zip(groups, plan):
            if group.session is not None:
                self._session_replicas[group.session] = ids[replica]
                self._session_replicas.move_to_end(group.session)
        while len(self._session_replicas) > MAX_SESSIONS:
            self._session_replicas.popitem(last=False)
        return plan

    # ------------------------------------------------------------------ weights
    @property
    def takes_lora(self) -> bool:
        """Whether sync_weights sends a PEFT model's adapter alone (the replicas have LoRA buffers)."""
        return self.config.max_lora_rank > 0

    def sync_weights(self, model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
                     weight_version: int, *, in_flight: str = "wait", kv_on_update: str = "keep") -> SyncReport:
        """All replicas or none: every replica stages (receives and validates) the whole update, and
        commits only once all have staged it. A bad tensor raises ValueError naming the replica and
        the tensor, every replica keeping its weights and version. A replica that dies meanwhile is
        dropped (get_stats reports it) and the others go on. in_flight / kv_on_update: as
        RolloutEngine.sync_weights, on every replica. A PEFT model on replicas with LoRA buffers sends its
        adapter alone (put once in the object store; a replica added later loads it too)."""
        version = check_version(weight_version)
        check_update_options(in_flight, kv_on_update)
        self._check_live()
        start = time.perf_counter()
        adapter = peft_adapter(model_or_state_dict) if self.takes_lora else None
        if adapter is not None:
            tensors, scaling = adapter
            ref = _ray().put(pack(list(tensors.items())))
            members = list(self._members)
            self._settle([(m, m.actor.stage_lora.remote(ref, scaling)) for m in members], members)
            self._commit(version, members, in_flight, kv_on_update)
            self.weight_version, self._lora = version, (ref, scaling)
            return SyncReport(time.perf_counter() - start, bucket_bytes_of(list(tensors.items())), len(tensors), 1,
                              version)
        stage = self._stage_distributed if self.sync_method == "distributed" else self._stage_object_store
        refs, num_bytes, num_tensors, num_buckets = stage(named_tensors(model_or_state_dict), list(self._members))
        self._commit(version, list(self._members), in_flight, kv_on_update)
        self.weight_version, self._weights, self._synced = version, refs, True
        return SyncReport(time.perf_counter() - start, num_bytes, num_tensors, num_buckets, version)

    def _stage_object_store(self, items: Iterable[tuple[str, torch.Tensor]], members: list[_Member]
                            ) -> tuple[list, int, int, int]:
        ray = _ray()
        refs, calls, num_bytes, num_tensors = [], [], 0, 0
        try:
            for bucket in buckets(items, self.bucket_bytes, self.sync_dtype):
                refs.append(ray.put(pack(bucket)))
                calls += [(m, m.actor.stage.remote(refs[-1])) for m in members]
                num_bytes += bucket_bytes_of(bucket)
                num_tensors += len(bucket)
        except BaseException:
            self._discard(calls, members)
            raise
        self._settle(calls, members)
        return refs, num_bytes, num_tensors, len(refs)

    def _stage_distributed(self, items: Iterable[tuple[str, torch.Tensor]], members: list[_Member]
                           ) -> tuple[list, int, int, int]:
        items = list(items)
        names, dtypes, shapes = dist_update.tensor_specs((name, self._sync_spec(name, t)) for name, t in items)
        group = self._open_group(members)
        calls = [(m, m.actor.stage_distributed.remote(names, dtypes, shapes)) for m in members]
        num_bytes, num_buckets = 0, 0
        try:
            for bucket in buckets(items, self.bucket_bytes, self.sync_dtype):
                num_bytes += dist_update.broadcast_weights(group, bucket, self.config.device)
                num_buckets += 1
        except BaseException:
            self._close_group()  # closing our end unblocks the replicas still waiting on it
            self._discard(calls, members)
            raise
        self._settle(calls, members)
        return [], num_bytes, len(items), num_buckets

    def _sync_spec(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A meta tensor with the dtype and shape `tensor` travels with."""
        return torch.empty(tensor.shape, dtype=synced_dtype(name, tensor, self.sync_dtype), device="meta")

    def _settle(self, calls: list, members: list[_Member]) -> None:
        """Wait for staging calls. A replica that died is dropped; any refusal discards what every
        replica staged and raises, naming the first replica that refused and its reason."""
        refusals = [(m, r) for m, r in self._wait(calls) if isinstance(r, BaseException)]
        live = self._live(members)
        if refusals:
            self._discard([], live)
            member, error = refusals[0]
            cause = getattr(error, "cause", error)
            kind = ValueError if isinstance(cause, ValueError) else RuntimeError
            raise kind(f"replica {member.id} refused the weight update ({len({m.id for m, _ in refusals})} of "
                       f"{len(live)} did): {cause}; no replica changed, all hold weight version "
                       f"{self.weight_version}") from None
        if not live:
            raise RuntimeError(f"every replica died during the weight sync ({'; '.join(self.replicas_lost)})")

    def _discard(self, calls: list, members: list[_Member]) -> None:
        """Let `calls` end, then drop what the live ones of `members` staged."""
        self._wait(calls)
        self._wait([(m, m.actor.discard.remote()) for m in self._live(members)])

    def _commit(self, version: int, members: list[_Member], in_flight: str = "wait",
                kv_on_update: str = "keep") -> None:
        for member, result in self._wait([(m, m.actor.commit.remote(version, in_flight, kv_on_update))
                                          for m in members]):
            if isinstance(result, BaseException):
                raise RuntimeError(f"replica {member.id} failed to commit a staged update: {result}")

    def _wait(self, calls: list) -> list[tuple[_Member, object]]:
        """(member, result or the task's exception) per call of a live member; a member whose actor
        died is dropped."""
        ray = _ray()
        results = []
        for member, ref in calls:
            try:
                results.append((member, ray.get(ref)))
            except ray.exceptions.RayActorError as exc:
                self._lose(member, exc)
            except ray.exceptions.RayTaskError as exc:
                results.append((member, exc))
        return [(m, r) for m, r in results if m.id not in self._dead]

    def _live(self, members: list[_Member]) -> list[_Member]:
        return [m for m in members if m.id not in self._dead]

    # ------------------------------------------------------------------ the weight-update group
    def _open_group(self, members: list[_Member]):
        if self._group is not None:
            return self._group
        ray = _ray()
        address = self.master_address or ray.util.get_node_ip_address()
        ranks = self.config.tensor_parallel_size  # each replica's ranks join at its rank_offset + their rank
        port, world_size = dist_update.free_port(), len(members) * ranks + 1
        name = f"fp8engine-cluster-{id(self):x}-{next(self._group_ids)}"
        backend = "nccl" if self.config.device == "cuda" else "gloo"
        calls = [(m, m.actor.init_weights_update_group.remote(address, port, 1 + i * ranks, world_size, name, backend,
                                                              self.timeout_s))
                 for i, m in enumerate(members)]
        self._group = dist_update.init_process_group(address, port, 0, world_size, name, backend, self.timeout_s)
        for member, result in self._wait(calls):
            if isinstance(result, BaseException):
                self._close_group()
                raise RuntimeError(f"replica {member.id} could not join the weight-update group: {result}")
        return self._group

    def _close_group(self) -> None:
        """Leave the group, and have the replicas leave theirs: a group's members are fixed, so it
        is formed again at the next distributed sync after any replica came or went."""
        group, self._group = self._group, None
        if group is None:
            return
        for member in self._members:
            member.actor.destroy_weights_update_group.remote()
        with contextlib.suppress(RuntimeError):
            torch.distributed.destroy_process_group(group)

    # ------------------------------------------------------------------ membership
    def add_replica(self, model_or_state_dict: nn.Module | Mapping[str, torch.Tensor] | None = None):
        """Start one more replica; it takes work only once it holds the cluster's weights and
        version: the last sync's buckets, kept in the object store, or `model_or_state_dict` when
        given (needed after a distributed sync). A PEFT model on replicas with LoRA buffers gives its
        adapter (the base as the other replicas hold it). While the cluster sleeps, the new replica sleeps too (the
        same level and tags) once it holds them, and wakes with the others. Returns its actor handle."""
        adapter = peft_adapter(model_or_state_dict) if self.takes_lora else None
        whole = model_or_state_dict is not None and adapter is None
        if self._synced and not self._weights and not whole:
            raise ValueError("the last sync of whole weights was distributed (nothing kept in the object store): "
                             "pass add_replica(model_or_state_dict) with whole weights to bring the new replica "
                             "to the current weights")
        lora = self._lora
        if adapter is not None:
            tensors, scaling = adapter
            lora = (_ray().put(pack(list(tensors.items()))), scaling)
        [member] = self._start(1)
        try:
            if whole:
                self._stage_object_store(named_tensors(model_or_state_dict), [member])
            else:
                self._settle([(member, member.actor.stage.remote(ref)) for ref in self._weights], [member])
            if lora is not None:
                self._settle([(member, member.actor.stage_lora.remote(*lora))], [member])
            if self._synced or lora is not None or whole:
                self._commit(self.weight_version, [member])
            if self.paused:
                _ray().get(member.actor.pause.remote(self.paused))
            if self._asleep:  # the cluster sleeps: the new replica hands its memory back as the others did
                level = max((self._levels.get(m.id, 1) for m in self._members), default=1)
                report = _ray().get(member.actor.sleep.remote(level, sorted(self._asleep)))
                self._levels[member.id] = report.level
        except BaseException:
            _ray().kill(member.actor)
            raise
        self._close_group()
        self._members.append(member)
        return member.actor

    def remove_replica(self, index: int) -> None:
        """Stop replica `index` (of `replicas`)."""
        member = self._members.pop(index)
        self._close_group()
        _ray().kill(member.actor)

    def shutdown(self) -> None:
        """Stop every replica (Ray itself keeps running)."""
        self._close_group()
        for member in self._members:
            _ray().kill(member.actor)
        self._members = []

    def _start(self, count: int) -> list[_Member]:
        members = [_Member(next(self._ids), self._actor_class.remote(self.config, self._threads))
                   for _ in range(count)]
        _ray().get([m.actor.weight_version.remote() for m in members])  # the engines are up
        return members

    def _check_live(self) -> None:
        if not self._members:
            raise RuntimeError(f"no replica is live ({'; '.join(self.replicas_lost) or 'all removed'}); "
                               f"add_replica() to go on")

    def _lose(self, member: _Member, exc: BaseException) -> None:
        if member.id in self._dead:
            return
        self._dead.add(member.id)
        if member in self._members:
            self._members.remove(member)
            self._close_group()
        self.replicas_lost.append(f"replica {member.id} ({type(exc).__name__})")
        _ray().kill(member.actor)  # an unreachable replica must not come back on old weights

    # ------------------------------------------------------------------ control
    def pause(self, mode: PauseMode = "abort") -> None:
        """Pause every replica (see RolloutEngine.pause); rollout() raises until resume()."""
        check_pause_mode(mode)
        self._wait([(m, m.actor.pause.remote(mode)) for m in self._members])
        self.paused = mode

    def resume(self) -> None:
        self._wait([(m, m.actor.resume.remote()) for m in self._members])
        self.paused = None

    def sleep(self, level: int = 1, tags: Sequence[str] | None = None) -> list[SleepReport]:
        """Every replica hands its memory back (RolloutEngine.sleep), or none does: a replica that refuses wakes
        the ones that slept and the refusal is raised, naming it. Returns each replica's report."""
        tags = None if tags is None else list(tags)
        return self._all_or_none([(m, m.actor.sleep.remote(level, tags)) for m in self._members], "sleep",
                                 lambda m, r: m.actor.wake_up.remote(r.tags))

    def wake_up(self, tags: Sequence[str] | None = None) -> list[SleepReport]:
        """Every replica takes its memory back (RolloutEngine.wake_up), or none does (as sleep)."""
        tags = None if tags is None else list(tags)
        return self._all_or_none([(m, m.actor.wake_up.remote(tags)) for m in self._members], "wake_up",
                                 lambda m, r: m.actor.sleep.remote(self._levels.get(m.id, 1), r.tags))

    def _all_or_none(self, calls: list, what: str, undo) -> list[SleepReport]:
        results = self._wait(calls)
        self._check_live()
        refusals = [(m, r) for m, r in results if isinstance(r, BaseException)]
        if refusals:
            self._wait([(m, undo(m, r)) for m, r in results if not isinstance(r, BaseException)])
            member, error = refusals[0]
            raise RuntimeError(f"replica {member.id} refused {what}: {getattr(error, 'cause', error)}; the other "
                               f"replicas were put back as they were") from None
        if what == "sleep":
            self._levels.update({m.id: r.level for m, r in results if r.tags})
            self._asleep |= {tag for _, r in results for tag in r.tags}
        else:
            self._asleep -= {tag for _, r in results for tag in r.tags}
        return [r for _, r in results]

    def get_stats(self) -> ClusterStats:
        results = self._wait([(m, m.actor.get_stats.remote()) for m in self._members])
        self._check_live()
        return _cluster_stats(results, self.weight_version, self.replicas_lost, self.num_prompt_groups_rerun)


def _max_model_len(engine) -> int:
    return engine.max_model_len


def assign(costs: Sequence[int], num_replicas: int, pinned: Sequence[int | None] | None = None) -> list[int]:
    """The replica of each prompt group: a pinned group goes to its replica; the others, in order, each to the
    replica with the fewest outstanding tokens (pinned ones counted; the lowest index among equals)."""
    pinned = list(pinned or [None] * len(costs))
    load = [0] * num_replicas
    for cost, replica in zip(costs, pinned):
        if replica is not None:
            load[replica] += cost
    plan = []
    for cost, replica in zip(costs, pinned):
        if replica is None:
            replica = min(range(num_replicas), key=load.__getitem__)
            load[replica] += cost
        plan.append(replica)
    return plan


def _cluster_stats(results: list[tuple[_Member, EngineStats]], weight_version: int, lost: list[str],
                  num_rerun: int) -> ClusterStats:
    """Totals of live replicas' stats (at least one), as ClusterStats describes them."""
    per_replica = [s for _, s in results]
    totals = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in per_replica]
        if f.name == "weight_version":
            totals[f.name] = weight_version
        elif f.name == "prefix_cache_hit_rate":
            totals[f.name] = sum(values) / len(values)
        elif isinstance(values[0], int) and not isinstance(values[0], bool) or f.name.endswith("_total"):
            totals[f.name] = sum(values)
        elif isinstance(values[0], float):
            totals[f.name] = max(values)
        else:
            totals[f.name] = values[0]
    return ClusterStats(**totals, replicas=per_replica, replica_ids=[m.id for m, _ in results],
                        num_replicas=len(per_replica),
                        replicas_lost=list(lost), num_prompt_groups_rerun=num_rerun)


def pack(bucket: Bucket) -> Packed:
    """A bucket as numpy byte arrays: Ray's object store shares those with every reader on a node
    (a torch tensor it would copy into each)."""
    return [(name, dist_update.dtype_name(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())
            for name, t in bucket]


def unpack(packed: Packed) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors, as views of the object store's read-only memory (nothing writes them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [(name, torch.from_numpy(data).view(dist_update.parse_dtype(dtype)).reshape(shape))
                for name, dtype, shape, data in packed]


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("RolloutCluster needs Ray: pip install 'fp8engine[ray]'") from exc
    return ray
