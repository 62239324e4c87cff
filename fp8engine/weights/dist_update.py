"""Weights broadcast from a trainer over a torch.distributed group of their own (the SGLang convention).

The trainer is rank 0 and hosts the group's TCP store at master_address:master_port; each engine
joins as rank `rank_offset` (LLMEngine.init_weights_update_group). The group is apart from any
default process group either side runs (FSDP, DDP): it has its own store and name. For each update
the trainer broadcasts every tensor in `names` order; an engine receives them into fresh buffers
and hands them to the same validate-then-commit path as `update_weights`, so nothing is written
before the last tensor arrived and validated. gloo carries CPU tensors, NCCL CUDA tensors.

Trainer side (the engines call init_weights_update_group / update_weights_from_distributed meanwhile):

    group = init_process_group(address, port, rank=0, world_size=1 + num_engines)
    names, dtypes, shapes = tensor_specs(state_dict.items())
    broadcast_weights(group, state_dict.items())
    torch.distributed.destroy_process_group(group)
"""

import datetime
import json
import socket
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _new_process_group_helper, _world
from torch.distributed.rendezvous import rendezvous

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 600.0


def init_process_group(master_address: str, master_port: int, rank: int, world_size: int,
                       group_name: str = "weights", backend: str = "gloo",
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.ProcessGroup:
    """Join (rank 0: host) a process group of its own; blocks until all `world_size` ranks joined.

    Built like SGLang's and OpenRLHF's `init_custom_process_group` (a TCP rendezvous, a store
    prefixed with the group name, torch's group constructor), so a trainer using theirs can join.
    timeout_s: how long the rendezvous, and later each broadcast, may wait (s).
    """
    _check_group_args(master_port, rank, world_size, backend, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    # torch has no public constructor for a group outside the default one's world
    group, _ = _new_process_group_helper(world_size, rank, [], backend, dist.PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def free_port() -> int:
    """A TCP port free on this host now (for a group's rendezvous or a server)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its attribute name ("bfloat16", "float32", ... with or without "torch.") or itself."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else name
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use a torch attribute name such as 'bfloat16' or 'float32'")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of (name, tensor) pairs, as update_weights_from_distributed takes them."""
    names, dtypes, shapes = [], [], []
    for name, tensor in tensors:
        names.append(name)
        dtypes.append(dtype_name(tensor.dtype))
        shapes.append(list(tensor.shape))
    return names, dtypes, shapes


def broadcast_weights(group: dist.ProcessGroup, tensors: Iterable[tuple[str, torch.Tensor]],
                      device: str = "cpu") -> int:
    """Rank 0's side of an update: broadcast each tensor in order; returns the bytes sent."""
    num_bytes = 0
    for _, tensor in tensors:
        tensor = tensor.detach().to(device).contiguous()
        dist.broadcast(_wire(tensor), src=0, group=group)
        num_bytes += tensor.numel() * tensor.element_size()
    return num_bytes


def broadcast_header(group: dist.ProcessGroup, header: dict | None, device: str = "cpu") -> dict:
    """A JSON header from rank 0 to every rank of `group` (rank 0 passes it, the others None and get it back):
    what a bucket that follows holds, for receivers that do not know it in advance."""
    if header is not None:
        data = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8, device=device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=group)
    if header is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0, group=group)
    return header if header is not None else json.loads(bytes(data.cpu().tolist()))


class WeightsUpdateGroup:
    """An engine's end of a weight-update group: rank `rank_offset` of `world_size`, receiving."""

    def __init__(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                 group_name: str = "weights", backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: str = "cpu"):
        if rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (the trainer is rank 0), got {rank_offset!r}")
        self.device = device if backend == "nccl" else "cpu"
        self.group_name = group_name
        self.group = init_process_group(master_address, master_port, rank_offset, world_size, group_name,
                                        backend, timeout_s)

    def receive(self, names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]],
                transform: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]] | None = None
                ) -> list[tuple[str, torch.Tensor]]:
        """The tensors rank 0 broadcasts, in `names` order; `transform` maps each one as it arrives to what is
        kept of it (updater.Prequantizer: FP8-bound weights as E4M3 codes and scales), so that one received
        tensor at a time is held as it came. ValueError for inconsistent specs (before anything is received);
        RuntimeError (torch's DistBackendError) when the transfer fails."""
        specs = _specs(names, dtypes, shapes)
        received = []
        for name, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(_wire(tensor), src=0, group=self.group)
            received += [(name, tensor)] if transform is None else transform(name, tensor)
        return received

    def destroy(self) -> None:
        dist.destroy_process_group(self.group)


def _specs(names, dtypes, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes must have one entry per tensor, got "
                         f"{len(names)}, {len(dtypes)} and {len(shapes)}")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be strings, got {name!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"weight {name!r}: shape {shape!r} is not a list of non-negative integers")
        specs.append((name, parse_dtype(dtype), tuple(shape)))
    return specs


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What goes over the wire: the tensor, or its bytes for 1-byte dtypes the backends may lack (FP8)."""
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor


def _check_group_args(master_port, rank, world_size, backend, timeout_s) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise ValueError(f"master_port must be an integer in [1, 65535], got {master_port!r}")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an integer >= 2 (the trainer and at least one engine), "
                         f"got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
