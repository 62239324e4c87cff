"""Tensor parallelism inside a replica (EngineConfig.tensor_parallel_size = T > 1) on torch.distributed.

The engine's process is rank 0: it keeps the one scheduler, output processor and sampler, and starts T - 1 worker
processes itself (model_executor/tp_worker.py), each running the same ModelRunner on its shard and following rank 0
call by call: rank 0 sends each step's flat inputs to every worker as one message over a socket pair of their own,
and the ranks meet inside the forward in the all-reduces of a gloo process group with its own TCP store and name
("tp"), never the default group (a trainer's FSDP group in the same process stays its own).

Sharding (Megatron's): q/k/v and gate/up are column-parallel (heads, KV heads, intermediate split), o_proj and
down_proj row-parallel with their partial sums all-reduced, so the KV cache is sharded by KV head (a KV head is
replicated on T / KV ranks where T exceeds them). A MoE block's experts are split the same way (each expert's
intermediate rows), or with expert_parallel go whole to the ranks; the router runs on every rank. A hybrid's GDN
layers split whole key and value heads (layers/gated_delta.py), and with them the state pool. The embedding and the
norms are replicated: a lookup has no arithmetic to share and stays exact (a vocabulary-parallel embedding would add
an all-reduce a step; a tied head reads its rows from this copy). The LM head is column-parallel over the vocabulary:
each rank computes the logits of its rows (whole 128-row blocks, vocab_rows; an untied head holds only them, a tied
one reads them from the embedding) from the final hidden rows every rank holds alike, and rank 0 gathers them for the
sampler, prompt logprobs and scoring; every logit is the same dot product as at T = 1. In FP8 a row-parallel layer's
ranks must split its input at 128-column block boundaries (each 1 x 128 activation group lives on one rank); a column
shard may start inside a 128-row block and then keeps that block's scale (layers/linear.py), so every rank's codes and
scales are a slice of the T = 1 engine's.

With batch_invariant the partial sums are gathered and added in rank order (fixed_order_sum): gloo's ring starts each
segment of a message at another rank and places the segment boundaries by the message size, i.e. by the batch, so
its sums change with the batch (library_sum).
"""

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from fp8engine import envs
from fp8engine.config import EngineConfig
from fp8engine.model_executor.models.llama import head_dim
from fp8engine.weights.dist_update import DEFAULT_TIMEOUT_S, free_port, init_process_group
from fp8engine.weights.loader import SKIPPED_KINDS, Target, TPSlice, read
from fp8engine.weights.quant import BLOCK, FP8_DTYPE

# the model types sharded: full attention, and the hybrids (Qwen3.5 dense and MoE, whose vision-language wrappers
# load as these text configs; Qwen3-Next)
MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
WORKER_MODULE = "fp8engine.model_executor.tp_worker"  # what each worker process runs (`python -m`)
READY_TIMEOUT_S = 120.0  # a worker's start (interpreter, torch, fp8engine) before it joins the group
DEATH_WAIT_S = 5.0  # after a failed collective, how long rank 0 waits for a worker's exit status
WATCH_INTERVAL_S = 0.1  # how often rank 0's watcher looks for a worker that exited
logger = logging.getLogger(__name__)


def group_name(port: int) -> str:
    """The group's name, unique in a process that runs several tensor-parallel engines (by its store's port)."""
    return f"tp-{port}"


# ------------------------------------------------------------------------------------------------ sharding
def check_shardable(cfg, size: int, fp8: bool, expert_parallel: bool) -> None:
    """ValueError naming the layer and the constraint when `size` ranks cannot split this model."""
    if cfg.model_type not in MODEL_TYPES:
        raise ValueError(f"tensor_parallel_size={size}: model_type {cfg.model_type!r} is not sharded yet (tensor "
                         f"parallelism covers {list(MODEL_TYPES)})")
    experts = getattr(cfg, "num_experts", 0) or 0
    if experts and expert_parallel and experts % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide num_experts={experts}: "
                         f"model.layers.*.mlp.experts go whole to the ranks (expert_parallel=True)")
    if experts and not expert_parallel:
        moe = cfg.moe_intermediate_size  # every model type above with experts has it
        if moe % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide moe_intermediate_size={moe}: "
                             f"model.layers.*.mlp.experts split each expert's intermediate rows over the ranks "
                             f"(or take expert_parallel=True: whole experts a rank)")
        if fp8 and (moe // size) % BLOCK:
            raise ValueError(f"tensor_parallel_size={size} with quantization='fp8': "
                             f"model.layers.*.mlp.experts.*.down_proj has {moe} inputs, {moe // size} per rank, not "
                             f"whole {BLOCK}-wide FP8 blocks (a row-parallel layer's ranks split its input at block "
                             f"boundaries); take expert_parallel=True (whole experts a rank), or another size")
    heads, kv, inter, d = cfg.num_attention_heads, cfg.num_key_value_heads, _dense_inter(cfg), head_dim(cfg)
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide num_attention_heads={heads}: "
                         f"model.layers.*.self_attn.qkv_proj and o_proj split whole heads over the ranks")
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv}: model.layers.*.self_attn.qkv_proj "
                         f"splits whole KV heads over the ranks, or replicates each on T / {kv} ranks; one must "
                         f"divide the other")
    if inter % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide intermediate_size={inter}: "
                         f"model.layers.*.mlp.gate_up_proj and down_proj split it over the ranks")
    row_parallel = [("self_attn.o_proj", heads * d), ("mlp.down_proj", inter)]
    if getattr(cfg, "linear_num_key_heads", None):  # a hybrid's GDN layers: whole key and value heads a rank
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if hk % size or hv % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide linear_num_key_heads={hk} and "
                             f"linear_num_value_heads={hv}: model.layers.*.linear_attn splits whole heads over "
                             f"the ranks")
        row_parallel.append(("linear_attn.out_proj", hv * cfg.linear_value_head_dim))
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    if shared:
        if shared % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide shared_expert_intermediate_size="
                             f"{shared}: model.layers.*.mlp.shared_expert splits it over the ranks")
        row_parallel.append(("mlp.shared_expert.down_proj", shared))
    vocab = cfg.vocab_size
    if vocab_rows(vocab, size, size - 1)[0] >= vocab:
        raise ValueError(f"tensor_parallel_size={size} with vocab_size={vocab}: lm_head splits the vocabulary in "
                         f"whole {BLOCK}-row blocks, {per_rank_vocab(vocab, size)} a rank, and rank {size - 1} "
                         f"would hold none")
    for name, k in row_parallel:
        if fp8 and (k // size) % BLOCK:
            raise ValueError(f"tensor_parallel_size={size} with quantization='fp8': model.layers.*.{name} has {k} "
                             f"inputs, {k // size} per rank, not whole {BLOCK}-wide FP8 blocks (a row-parallel "
                             f"layer's ranks split its input at block boundaries, where its 1 x {BLOCK} activation "
                             f"groups end); choose a size that makes {k} / size a multiple of {BLOCK}, or run BF16")


def vocab_rows(vocab: int, size: int, rank: int) -> tuple[int, int]:
    """The vocabulary rows (start, stop) of rank's LM head shard: whole 128-row blocks (an FP8 head's scales and
    an nt16 head's 16-row groups stay whole), the last rank the rest."""
    per = per_rank_vocab(vocab, size)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def per_rank_vocab(vocab: int, size: int) -> int:
    """Vocabulary rows a rank's LM head shard holds (the last rank's may be fewer): V / T rounded up to a block."""
    return -(-vocab // size // BLOCK) * BLOCK


def local_config(cfg, size: int, expert_parallel: bool):
    """A copy of the model config with one rank's share of the heads, KV heads and intermediate sizes (a MoE
    model's experts': split unless expert parallel)."""
    local = copy.copy(cfg)
    local.head_dim = head_dim(cfg)
    local.num_attention_heads = cfg.num_attention_heads // size
    local.num_key_value_heads = max(1, cfg.num_key_value_heads // size)
    if _dense_inter(cfg):
        local.intermediate_size = cfg.intermediate_size // size
    if getattr(cfg, "num_experts", 0) and not expert_parallel:
        local.moe_intermediate_size = cfg.moe_intermediate_size // size
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        local.shared_expert_intermediate_size = cfg.shared_expert_intermediate_size // size
    if getattr(cfg, "linear_num_key_heads", None):  # GDN: its q, k and v rows a slice each (GatedDeltaNet.tp_size)
        local.linear_num_key_heads = cfg.linear_num_key_heads // size
        local.linear_num_value_heads = cfg.linear_num_value_heads // size
        local.tp_size = size
    return local


def _dense_inter(cfg) -> int:
    """A dense MLP's intermediate size (0 where every layer is MoE and the config has none)."""
    return getattr(cfg, "intermediate_size", 0) or 0


def shard_model(model, cfg, group: "TPGroup", expert_parallel: bool) -> None:
    """Tells each decoder layer's linears where this rank's rows or columns sit in the full weights (before they
    load); the row-parallel ones reduce their partial sums over the group."""
    size, rank = group.size, group.rank
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    kv_head = rank * (kv // size) if kv >= size else rank // (size // kv)
    q0 = rank * (heads // size) * d
    for layer in model.model.layers:
        if getattr(layer, "is_linear", False):
            layer.linear_attn.shard_for_tp(rank, size, group.all_reduce)
        else:
            attn = layer.self_attn
            q_rows = attn.qkv_proj.shard_sizes[0]  # this rank's q rows ([q | gate] per head in gated attention)
            attn.qkv_proj.shard_for_tp(rows=[(rank * q_rows, size * q_rows), (kv_head * d, kv * d),
                                             (kv_head * d, kv * d)])
            attn.o_proj.shard_for_tp(cols=(q0, heads * d), reduce=group.all_reduce)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):  # the router on every rank; whole experts, or a slice of every expert
            if expert_parallel:
                per_rank = cfg.num_experts // size
                mlp.experts.keep_experts(rank * per_rank, per_rank)
            else:
                mlp.experts.split_experts(rank * (cfg.moe_intermediate_size // size), cfg.moe_intermediate_size)
            if hasattr(mlp, "shared_expert"):  # split as a dense MLP; its partial sums join the block's
                _shard_mlp(mlp.shared_expert, rank, size, cfg.shared_expert_intermediate_size, None)
            mlp.reduce = group.all_reduce
            continue
        _shard_mlp(mlp, rank, size, cfg.intermediate_size, group.all_reduce)
    model.lm_head.shard_vocab(*vocab_rows(cfg.vocab_size, size, rank))
    model.vocab_gather = functools.partial(group.gather_vocab, per_rank=per_rank_vocab(cfg.vocab_size, size),
                                           vocab=cfg.vocab_size)


def _shard_mlp(mlp, rank: int, size: int, inter: int, reduce) -> None:
    """A dense MLP's gate/up column-parallel and down row-parallel (reduce: None where the caller adds)."""
    i0 = rank * (inter // size)
    mlp.gate_up_proj.shard_for_tp(rows=[(i0, inter), (i0, inter)])
    mlp.down_proj.shard_for_tp(cols=(i0, inter), reduce=reduce)


# ------------------------------------------------------------------------------------------------ collectives
def fixed_order_sum(group: dist.ProcessGroup, size: int, y: torch.Tensor) -> torch.Tensor:
    """Every rank's y, added in rank order in float32 (the same on every rank, whatever y's shape)."""
    parts = [torch.empty_like(y) for _ in range(size)]
    dist.all_gather(parts, y.contiguous(), group=group)
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    return total.to(y.dtype)


def library_sum(group: dist.ProcessGroup, y: torch.Tensor) -> torch.Tensor:
    """Every rank's y added by the backend's all-reduce, in float32 (its order is the backend's choice)."""
    total = y.float()
    dist.all_reduce(total, group=group)
    return total.to(y.dtype)


def fixed_order(config: EngineConfig) -> bool:
    """Whether the ranks add partial sums in rank order (FP8ENGINE_TP_ALL_REDUCE; by default when batch invariant)."""
    choice = envs.get("FP8ENGINE_TP_ALL_REDUCE")
    return config.batch_invariant if choice == "auto" else choice == "fixed"


class TPGroup:
    """This rank's place in the tensor-parallel group and its collectives; seconds: time spent in all_reduce and
    the LM head's gather. group: gloo, host tensors (control, weight staging); device_group: the collectives on
    device tensors (NCCL on CUDA; the same gloo group on CPU)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, fixed_order: bool,
                 device_group: dist.ProcessGroup | None = None):
        self.group, self.rank, self.size, self.fixed_order = group, rank, size, fixed_order
        self.device_group = group if device_group is None else device_group
        self.backend = str(dist.get_backend(self.device_group))
        self.seconds = 0.0

    def _on(self, t: torch.Tensor) -> dist.ProcessGroup:
        return self.group if t.device.type == "cpu" else self.device_group

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's partial sums added over the ranks."""
        start = time.perf_counter()
        group = self._on(y)
        out = fixed_order_sum(group, self.size, y) if self.fixed_order else library_sum(group, y)
        self.seconds += time.perf_counter() - start
        return out

    def gather_vocab(self, local: torch.Tensor, per_rank: int, vocab: int) -> torch.Tensor | None:
        """The LM head's logits: each rank's [rows, its vocabulary rows] side by side on rank 0 ([rows, vocab]);
        None on the other ranks."""
        start = time.perf_counter()
        if local.shape[-1] < per_rank:  # the last rank's rows (a gather takes one size from every rank)
            local = torch.nn.functional.pad(local, (0, per_rank - local.shape[-1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self._on(local))
        self.seconds += time.perf_counter() - start
        if parts is None:
            return None
        logits = torch.cat(parts, dim=-1)
        return logits if logits.shape[-1] == vocab else logits[..., :vocab].contiguous()

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._on(t))
        return t

    def min_int(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)

    def send(self, t: torch.Tensor, rank: int) -> None:
        dist.send(_wire(t), dst=rank, group=self.group)

    def recv(self, t: torch.Tensor) -> None:
        """t from rank 0 (what its send to this rank holds)."""
        dist.recv(_wire(t), src=0, group=self.group)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What goes over the wire: 1-byte dtypes (FP8) as bytes."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


# ------------------------------------------------------------------------------------------------ update slices
Region = tuple[slice | None, slice | None] | str | None  # (rows, columns) of a full tensor; "all"; None: nothing


def pieces(target: Target, dtype: torch.dtype) -> list[tuple[tuple, TPSlice | None, torch.Tensor]]:
    """What a rank holds of a target, for get_weights_by_name to gather: (index into the full tensor, where in that
    the rank's rows and columns sit or None, the values) per piece; a split target whose parts are slices (a GDN
    layer's in_proj_qkv, a split expert's stacked tensor) one per part, another rank's expert none."""
    if target.kind in SKIPPED_KINDS:
        return []
    if target.kind == "split" and any(part.tp is not None for _, part in target.parts):
        return [(index, part.tp, read(part, dtype)) for index, part in target.parts]
    return [((), target.tp, read(target, dtype))]


def update_region(target: Target, dtype: torch.dtype) -> Region:
    """The part of an update's full tensor (of `dtype`) that a rank's write of `target` reads: its rows and columns
    (a float weight bound for FP8: the whole 128-row blocks they sit in, which it quantizes), the whole tensor for a
    target that is not a slice (or is an expert-parallel stacked one), None for another rank's."""
    if target.kind in SKIPPED_KINDS:
        return None
    if target.tp is None or target.kind == "split":
        return "all"
    rows = target.tp.block_rows() if target.kind == "fp8_weight" and dtype != FP8_DTYPE else target.tp.rows
    return rows, target.tp.cols


def cut(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    """A region of a full tensor (a view)."""
    if region == "all":
        return tensor
    rows, cols = region
    tensor = tensor if rows is None else tensor[rows]
    return tensor if cols is None else tensor[:, cols]


def region_target(target: Target, region: Region, shape: tuple[int, ...]) -> Target:
    """The target as the writer of a region (of `shape`) sees it: its TPSlice counted from the region's first row."""
    rows = region[0]
    inner = None if rows is None or target.tp.rows is None else slice(target.tp.rows.start - rows.start,
                                                                      target.tp.rows.stop - rows.start)
    return dataclasses.replace(target, tp=TPSlice(tuple(shape), inner))


# ------------------------------------------------------------------------------------------------ rank 0
class Leader:
    """Rank 0's side: starts the workers and owns them, sends them each call, and turns a worker's death (killed, out
    of memory, an exception) into a RuntimeError naming its rank and exit status, on the call in progress and every
    later one. Workers exit when rank 0's process does (their socket closes) or when close() stops them.

    A watcher thread looks for a worker's exit every WATCH_INTERVAL_S. gloo fails a collective whose peer is gone at
    once, but an NCCL one never completes: rank 0 would wait in its next device sync until NCCL's timeout (whose
    default handling then ends the process). So on CUDA the watcher aborts the device group, which ends that wait,
    and rank 0's own device work (guard(sync=True): its forwards, replays and head calls) waits for its stream before
    its results count: a worker that died meanwhile fails the call, and what that step computed never reaches the
    caller."""

    def __init__(self, config: EngineConfig, model_dir: str):
        self.size = config.tensor_parallel_size
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.failed: str | None = None
        self.last_words: dict[int, str] = {}  # by rank: the traceback a dying worker sent
        self.lock = threading.RLock()  # one caller at a time talks to the workers (model_runner's _exclusive)
        self.lost = False  # the watcher saw a worker exit
        self._stop = threading.Event()  # set when the workers are stopped on purpose: the watcher ends
        self._closer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._stop)
        devices = device_indices(config)
        # rank 0's own device work is waited for before its results count (guard(sync=True)); none on CPU
        self.device_sync = None if devices[0] is None else functools.partial(_sync_stream, devices[0])
        self._ending = threading.Lock()  # the watcher's abort and close()'s destroy of the groups: one, then the other
        port = device_port = free_port()
        while device_port == port:
            device_port = free_port()
        threads = torch.get_num_threads()  # every rank's
        if config.device == "cpu" and (warning := oversubscribed(threads, self.size)) is not None:
            logger.warning("%s", warning)
        for rank in range(1, self.size):
            mine, theirs = socket.socketpair()
            self.procs.append(subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(theirs.fileno())],
                                               pass_fds=(theirs.fileno(),)))
            theirs.close()
            self.conns.append(Connection(mine.detach()))
            post(self.conns[-1], (config, model_dir, rank, port, threads, devices[rank], device_port))
        with self.guard():
            self.replies(timeout_s=READY_TIMEOUT_S)  # each worker imported what it runs and joins the group now
            group, device_group = join_groups(config, port, device_port, 0)
        self.group = TPGroup(group, 0, self.size, fixed_order(config), device_group)
        threading.Thread(target=_watch, args=(weakref.ref(self), self.procs, self._stop), name="fp8engine-tp-watch",
                         daemon=True).start()

    def _worker_exited(self) -> None:
        """The watcher's: a worker exited while the group was up. On CUDA the device group is aborted, so a wait of
        rank 0's on a collective the worker will never join ends (NCCL's abort; gloo's group already failed it)."""
        with self._ending:
            if self.failed is not None:  # closed (or failed) meanwhile: its groups are destroyed, or being
                return
            self.lost = True
            group = getattr(self, "group", None)
            if group is not None and group.device_group is not group.group:
                logger.error("tensor-parallel worker exited: aborting the device group (%s)", group.backend)
                _abort(group.device_group)

    def send(self, op: str, *args) -> None:
        """Every worker runs `op(*args)` next (tp_worker.Worker); raises the group's failure if there is one."""
        self.check()
        with self.guard():
            for conn in self.conns:
                post(conn, (op, args))

    def call(self, op: str, *args) -> list:
        """send, then every worker's reply (rank 1 first)."""
        self.send(op, *args)
        with self.guard():
            return self.replies()

    def replies(self, timeout_s: float | None = None) -> list:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            while not conn.poll(0.05):
                if proc.poll() is not None:
                    raise ConnectionError(f"rank {rank} exited")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel rank {rank} did not answer in {timeout_s:.0f} s")
            kind, value = receive(conn)
            if kind == "died":
                self.last_words[rank] = str(value).strip()
                raise ConnectionError(f"rank {rank} failed")
            out.append(value)
        return out

    def check(self) -> None:
        """RuntimeError if the group failed, or a worker has exited since the last call."""
        if self.failed is None and any(p.poll() is not None for p in self.procs):
            self._fail(None)
        if self.failed is not None:
            raise RuntimeError(self.failed)

    @contextlib.contextmanager
    def guard(self, sync: bool = False):
        """Around anything rank 0 does while the workers follow: an exception there (a collective a dead worker left,
        a broken socket, rank 0's own error) ends the group, and the RuntimeError says which rank and why. sync: rank
        0 ran device work inside (a forward, a replay, the head): on CUDA its stream is waited for here, and a worker
        that the watcher saw exit fails the call even where rank 0's own part ended (its collectives were aborted)."""
        try:
            yield
            if sync:
                if self.device_sync is not None:
                    self.device_sync()
                if self.lost:
                    raise ConnectionError("a tensor-parallel worker exited")
        except BaseException as exc:
            if self.failed is not None:
                raise RuntimeError(self.failed) from exc
            if not isinstance(exc, Exception):  # an interrupt: the ranks are out of step, the group ends
                self.failed = f"tensor-parallel group stopped by {type(exc).__name__} on rank 0"
                self.close()
                raise
            self._fail(exc)

    def _fail(self, exc: Exception | None) -> None:
        deadline = time.monotonic() + DEATH_WAIT_S
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            time.sleep(0.02)
        dead = [f"tensor-parallel rank {rank} exited with status {_status(proc.returncode)}"
                + (f": {words}" if (words := self._last_words(rank, conn)) else "")
                for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1) if proc.poll() is not None]
        self.failed = "; ".join(dead) or (f"tensor-parallel group failed on rank 0 ({type(exc).__name__}: {exc}); "
                                          f"its workers were stopped")
        self.close()
        raise RuntimeError(self.failed) from exc

    def _last_words(self, rank: int, conn: Connection) -> str:
        """What a dying worker sent (its exception's traceback), if anything."""
        with contextlib.suppress(Exception):
            while conn.poll(0):
                kind, value = receive(conn)
                if kind == "died":
                    self.last_words[rank] = str(value).strip()
        return self.last_words.get(rank, "")

    def close(self) -> None:
        """Stops the workers (asked first, then killed); the group cannot be used after."""
        if self.failed is None:
            self.failed = "the tensor-parallel workers were shut down"
        self._closer()
        with self._ending:
            group, self.group = getattr(self, "group", None), None
            if group is not None:
                for pg in {group.group, group.device_group}:
                    with contextlib.suppress(Exception):
                        dist.destroy_process_group(pg)


def device_indices(config: EngineConfig) -> list[int | None]:
    """Each rank's CUDA device: rank 0's is the current device of the process that builds the engine, rank r's the
    r-th after it (wrapping); None per rank on CPU. ValueError when fewer devices are visible than ranks."""
    if config.device != "cuda":
        return [None] * config.tensor_parallel_size
    count, first = torch.cuda.device_count(), torch.cuda.current_device()
    if count < config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs a CUDA device per rank; this "
                         f"process sees {count} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return [(first + rank) % count for rank in range(config.tensor_parallel_size)]


def join_groups(config: EngineConfig, port: int, device_port: int,
                rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's gloo group (host tensors) and, on CUDA, its group for device tensors (FP8ENGINE_TP_DEVICE_BACKEND,
    NCCL by default), each with its own rendezvous; every rank joins both in this order."""
    group = init_process_group("127.0.0.1", port, rank, config.tensor_parallel_size, group_name(port),
                               timeout_s=DEFAULT_TIMEOUT_S)
    if config.device != "cuda":
        return group, None
    return group, init_process_group("127.0.0.1", device_port, rank, config.tensor_parallel_size,
                                     group_name(port) + "-device", backend=envs.get("FP8ENGINE_TP_DEVICE_BACKEND"),
                                     timeout_s=DEFAULT_TIMEOUT_S)


def oversubscribed(threads: int, size: int, cores: int | None = None) -> str | None:
    """What to tell a replica whose size ranks of `threads` threads each want more cores than this process may use."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    if threads * size <= cores:
        return None
    return (f"tensor_parallel_size={size}: {size} ranks x {threads} threads on {cores} cores; ranks that share cores "
            f"stall each other in every all-reduce: torch.set_num_threads({max(1, cores // size)}) before the engine "
            f"starts gives each rank its own (the workers take rank 0's count)")


def post(conn: Connection, message) -> None:
    """One message over a rank's socket, plain-pickled (multiprocessing's pickler would pass tensors as shared-memory
    handles, which processes it did not start cannot open)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection):
    return pickle.loads(conn.recv_bytes())


def _status(code: int) -> str:
    return f"{code} ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else str(code)


def _watch(leader: "weakref.ref[Leader]", procs: list[subprocess.Popen], stop: threading.Event) -> None:
    """Rank 0's watcher thread (holding no reference that keeps the Leader alive): tells it when a worker exits."""
    while not stop.wait(WATCH_INTERVAL_S):
        if any(proc.poll() is not None for proc in procs):
            owner = leader()
            if owner is not None and not stop.is_set():
                owner._worker_exited()
            return


def _sync_stream(device: int) -> None:
    """Waits for what is queued on rank 0's device's current stream (its forward's kernels, which wait on their
    collectives), not for the device's other streams (a colocated trainer's)."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    done.synchronize()


def _abort(group: dist.ProcessGroup) -> None:
    """Ends the group's collectives in flight (ncclCommAbort on NCCL: its kernels return and the streams waiting on
    them complete); the group is not used again."""
    try:
        group.abort()
    except Exception as exc:  # an abort that fails leaves rank 0 to NCCL's timeout, as before the watcher
        logger.error("could not abort the tensor-parallel device group: %s: %s", type(exc).__name__, exc)


def _stop_workers(procs: list[subprocess.Popen], conns: list[Connection], stop: threading.Event) -> None:
    stop.set()
    for conn in conns:
        with contextlib.suppress(Exception):
            post(conn, ("shutdown", ()))
    deadline = time.monotonic() + 5.0
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
