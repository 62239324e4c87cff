"""The engine's end of vLLM's NCCL weight-transfer protocol (vllm/distributed/weight_transfer/nccl_engine.py), as a
trainer that speaks it to vLLM drives it: /init_weight_transfer_engine, /start_weight_update, /update_weights (one
or more), /finish_weight_update.

Rendezvous: the trainer is rank 0 and hosts a TCP store at master_address:master_port for `world_size` ranks
(vLLM's StatelessProcessGroup.create); the engine joins it as rank `rank_offset`. The data plane is a group over
that store: on GPUs an NCCL communicator from the unique id vLLM's trainer publishes in the store, as its PyNccl
communicator does (weights/pynccl.py: written to vLLM's protocol, not yet run on a GPU); on CPU a gloo group on the
same store under the prefix GLOO_PREFIX. Both open with a one-element all-reduce (the warm-up each side issues
before any broadcast). Each update_info {names, dtype_names, shapes} is then broadcast from rank 0 in order: tensor by
tensor, or with init_info.packed, as uint8 buffers of the tensors' bytes back to back, a buffer closed by the first
tensor that takes it past packed_buffer_size_bytes (vLLM's packed_nccl_broadcast_producer), the last one by the
end of the list.

Unlike vLLM, which loads each tensor as it arrives, nothing is written before /finish_weight_update: every tensor
is received (so the trainer's broadcast always completes), checked as /update_weights checks a bucket, and staged;
finish applies them all in one LLMEngine.update_weights, which validates everything before it writes. A bad
update_info answers 400 and drops the staged update; the engine keeps its weights.
"""

import asyncio
import base64
import datetime
import math

import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from fp8engine.entrypoints.async_engine import AsyncEngine
from fp8engine.entrypoints.protocol import ApiError, _Request
from fp8engine.outputs import WeightUpdateReport
from fp8engine.weights import pynccl
from fp8engine.weights.dist_update import parse_dtype

GLOO_PREFIX = "fp8engine-gloo"
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's defaults: both sides must agree
DEFAULT_PACKED_NUM_BUFFERS = 2
TIMEOUT_S = 300.0  # as vLLM's StatelessProcessGroup store


class TransferInit(_Request):
    """init_info of POST /init_weight_transfer_engine (vLLM's NCCLWeightTransferInitInfo): one rendezvous, the
    trainer's TCP store (master_address + master_port) or an NCCL unique id it minted out of band and sends here
    (nccl_unique_id_b64, standard base64 of ncclGetUniqueId's 128 bytes: torch-free trainers such as JAX ones; the
    ranks then meet in ncclCommInitRank alone, so the trainer joins while this request waits; CUDA only)."""

    master_address: str | None = None
    master_port: int | None = Field(None, ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    packed: bool = False
    packed_buffer_size_bytes: int = Field(DEFAULT_PACKED_BUFFER_SIZE_BYTES, gt=0)
    packed_num_buffers: int = Field(DEFAULT_PACKED_NUM_BUFFERS, ge=1)
    nccl_unique_id_b64: str | None = None
    timeout_s: float = Field(TIMEOUT_S, gt=0)  # our extension: the rendezvous's and each broadcast's limit

    @model_validator(mode="after")
    def _rank(self) -> "TransferInit":
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset: {self.rank_offset} is not a rank of a group of world_size "
                             f"{self.world_size}")
        by_store = self.master_address is not None or self.master_port is not None
        if self.nccl_unique_id_b64 and by_store:
            raise ValueError("nccl_unique_id_b64: give it or master_address and master_port, not both")
        if not self.nccl_unique_id_b64 and (self.master_address is None or self.master_port is None):
            raise ValueError(f"master_address: a rendezvous needs master_address and master_port (or "
                             f"nccl_unique_id_b64); got master_address={self.master_address!r}, "
                             f"master_port={self.master_port!r}")
        if self.nccl_unique_id_b64:
            self.unique_id()
        return self

    def unique_id(self) -> bytes | None:
        """nccl_unique_id_b64's 128 bytes (None without it); ValueError naming it when it is not that."""
        if not self.nccl_unique_id_b64:
            return None
        try:
            raw = base64.b64decode(self.nccl_unique_id_b64, validate=True)
        except (ValueError, TypeError):
            raise ValueError("nccl_unique_id_b64 is not standard base64 (URL-safe base64 is not accepted)") from None
        if len(raw) != pynccl.UNIQUE_ID_BYTES:
            raise ValueError(f"nccl_unique_id_b64 must decode to {pynccl.UNIQUE_ID_BYTES} bytes (ncclGetUniqueId's), "
                             f"got {len(raw)}")
        return raw


class TransferUpdate(_Request):
    """update_info of POST /update_weights (vLLM's NCCLWeightTransferUpdateInfo)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None  # where SkyRL and vLLM before 0.32 say it; init_info's otherwise

    @model_validator(mode="after")
    def _aligned(self) -> "TransferUpdate":
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names: names, dtype_names and shapes need one entry per tensor, got "
                             f"{len(self.names)}, {len(self.dtype_names)} and {len(self.shapes)}")
        for name, shape in zip(self.names, self.shapes):
            if any(d < 0 for d in shape):
                raise ValueError(f"shapes: weight {name!r} has a negative dimension {shape}")
        return self

    def specs(self) -> list[tuple[str, torch.dtype, list[int]]]:
        try:
            return [(n, parse_dtype(d), s) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]
        except ValueError as exc:
            raise ApiError(400, f"update_info.dtype_names: {exc}", param="update_info") from None


class WeightTransfer:
    """One server's weight-transfer state: the group, and the update being staged between start and finish."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.init_info: TransferInit | None = None
        self.group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None
        self.staged: list[tuple[str, torch.Tensor]] | None = None
        self.prequantizer = None

    async def init(self, init_info: TransferInit) -> None:
        if self.group is not None:
            raise ApiError(409, "the weight-transfer engine is already initialized; POST "
                                "/shutdown_weight_transfer_engine first", code="already_initialized")
        device = self.engine.engine.runner.device
        if init_info.nccl_unique_id_b64 and device.type != "cuda":
            raise ApiError(400, f"nccl_unique_id_b64: an NCCL unique id needs an engine on CUDA; this one runs on "
                                f"{device.type}: rendezvous with master_address and master_port (gloo)",
                           param="init_info")
        try:
            self.store, self.group = await asyncio.to_thread(_join, init_info, device)
        except (RuntimeError, ValueError, OSError) as exc:  # torch's DistError, timeouts; NCCL's library, errors
            where = ("by its NCCL unique id" if init_info.nccl_unique_id_b64
                     else f"at {init_info.master_address}:{init_info.master_port}")
            raise ApiError(500, f"could not join the trainer's weight-transfer group {where}: {exc}",
                           code="rendezvous_failed") from None
        self.init_info = init_info

    async def shutdown(self) -> None:
        if isinstance(self.group, pynccl.NcclComm):
            self.group.abort()
        self.group, self.store, self.staged = None, None, None  # a gloo group's sockets close with it

    def start(self) -> None:
        """Open an update (as vLLM, also before /init_weight_transfer_engine: a start and a finish alone set the
        version)."""
        if self.staged is not None:
            raise ApiError(409, "a weight update is already started; POST /finish_weight_update first",
                           code="update_in_progress")
        self.staged = []
        self.prequantizer = self.engine.engine.prequantizer()

    async def receive(self, update: TransferUpdate) -> None:
        """Receive one update_info's tensors, check them and stage them (all received even when they are bad, so
        the trainer's broadcast completes; then 400 and the staged update is dropped)."""
        if self.staged is None:
            raise ApiError(409, "no weight update started: POST /start_weight_update first",
                           code="no_update_started")
        specs = update.specs()
        if self.group is None:
            raise ApiError(409, "no weight-transfer engine: POST /init_weight_transfer_engine first",
                           code="not_initialized")
        try:
            tensors = await asyncio.to_thread(self._receive, specs, self.init_info.packed if update.packed is None
                                              else update.packed)
        except RuntimeError as exc:
            await self.shutdown()
            raise ApiError(500, f"weight broadcast failed; the transfer engine is shut down and the update "
                                f"dropped: {exc}", code="broadcast_failed") from None
        try:
            await self.engine.call(lambda llm: llm.check_weights(tensors))
        except ValueError as exc:
            self.staged = None
            raise ApiError(400, f"bad update_info, the whole update is dropped: {exc}", param="update_info") from None
        self.staged += tensors

    async def finish(self, weight_version: int | None) -> WeightUpdateReport:
        if self.staged is None:
            raise ApiError(409, "no weight update started: POST /start_weight_update first",
                           code="no_update_started")
        tensors, self.staged = self.staged, None
        if not tensors:  # nothing was sent: the version alone changes, as vLLM's empty update does
            version = await self.engine.call(lambda llm: set_weight_version(llm, weight_version))
            return WeightUpdateReport(num_tensors=0, num_bytes=0, seconds=0.0, num_quantized=0, weight_version=version)
        try:
            return await self.engine.update_weights(tensors, weight_version=weight_version)
        except ValueError as exc:
            raise ApiError(400, f"the update was refused, nothing changed: {exc}", param="update_info") from None

    def _receive(self, specs: list[tuple[str, torch.dtype, list[int]]], packed: bool) -> list[tuple[str, torch.Tensor]]:
        keep = self.prequantizer or (lambda name, tensor: [(name, tensor)])
        device = self.engine.engine.runner.device
        if not packed:
            received = []
            for name, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                _broadcast(self.group, tensor)
                received += keep(name, tensor)
            return received
        received = []
        for chunk in packed_chunks(specs, self.init_info.packed_buffer_size_bytes):
            buffer = torch.empty(sum(size for *_, size in chunk), dtype=torch.uint8, device=device)
            _broadcast(self.group, buffer)
            for (name, dtype, shape, _), piece in zip(chunk, buffer.split([size for *_, size in chunk])):
                received += keep(name, piece.view(dtype).view(shape))
        return received


def set_weight_version(llm, weight_version: int | None) -> int:
    """Label the engine's current weights `weight_version` (None: leave it); the version now served."""
    if weight_version is not None:
        llm.weight_version = weight_version
    return llm.weight_version


def packed_chunks(specs: list[tuple[str, torch.dtype, list[int]]], buffer_size: int) -> list[list[tuple]]:
    """The tensors of each packed buffer, as vLLM's producer fills them: in order, a buffer closed by the first
    tensor that takes it past buffer_size bytes (so every buffer but the last is larger than buffer_size)."""
    chunks, chunk, size = [], [], 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        chunk.append((name, dtype, shape, nbytes))
        size += nbytes
        if size > buffer_size:
            chunks.append(chunk)
            chunk, size = [], 0
    if chunk:
        chunks.append(chunk)
    return chunks


def _join(init_info: TransferInit, device: torch.device
          ) -> tuple[dist.Store | None, dist.ProcessGroup | pynccl.NcclComm]:
    """Join the trainer's store as rank rank_offset, then the data plane on it, and do the warm-up all-reduce: on
    CPU a gloo group on the store; on CUDA an NCCL communicator from the unique id the trainer published there
    (vLLM's PyNccl handshake, weights/pynccl.py; not yet run on a GPU), or from the one init_info carries (no
    store)."""
    unique_id = init_info.unique_id()
    if unique_id is not None:
        return None, pynccl.NcclComm(unique_id, init_info.rank_offset, init_info.world_size, device)
    timeout = datetime.timedelta(seconds=init_info.timeout_s)
    store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, is_master=False,
                          timeout=timeout, use_libuv=False)
    if device.type == "cuda":
        return store, pynccl.NcclComm(pynccl.read_unique_id(store), init_info.rank_offset, init_info.world_size,
                                      device)
    group = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, store), init_info.rank_offset,
                                  init_info.world_size, timeout)
    group.allreduce([torch.zeros(1)]).wait()
    return store, group


def _broadcast(group: dist.ProcessGroup | pynccl.NcclComm, tensor: torch.Tensor) -> None:
    """Receive rank 0's broadcast into `tensor`. A gloo group is the engine's own, outside torch.distributed's world
    (its methods are called directly), and carries 1-byte dtypes as bytes."""
    if isinstance(group, pynccl.NcclComm):
        group.broadcast(tensor)
        return
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor], options).wait()
