"""The host memory of a CPU engine: its weights and KV cache on mappings of its own.

A decode step at small batch streams every weight once: on 4 KiB pages that is a TLB miss every 4 KiB of a 100+ MB
stream. torch's allocator aligns and advises huge pages only when THP_MEM_ALLOC_ENABLE is set before torch starts,
which would change every allocation of the trainer beside the engine too; so the engine moves its own parameters
and buffers onto one private anonymous mapping, advised MADV_HUGEPAGE when they are big enough, aligned to a huge
page, once, before the weights are loaded into them (weight updates write into the same memory). SmolLM2 batch-1
decode on a 2-vCPU Xeon: 8.1-8.4 -> 7.2-7.7 ms a step. The KV cache gets a mapping too, on small pages: its pages
are first touched during the run, where huge-page faults cost more than they saved (128 sequences: prefill 5.6 ->
6.6 s, decode steps equal); the kernel zero-fills them, so none is resident before a step writes it.

Mappings of the engine's own are what lets a colocated engine sleep (engine.py, sleep / wake_up): MADV_DONTNEED hands
a span's pages back to the kernel at once, at the same addresses (the fused decoder plan's pointers stay valid),
and they read as zeros when touched again; a Spill keeps the weights' bytes on disk meanwhile (a host copy would
free nothing on a CPU). The weights come first on their mapping, a whole number of pages that holds nothing else.
"""

import math
import mmap
import os
import tempfile
from dataclasses import dataclass
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from fp8engine.weights.quant import cdiv

HUGE_PAGE = 2 << 20
_ALIGN = 64  # every tensor starts on a cache line
# Below this much movable weight nothing moves: a model that small stays in the last-level cache between steps, and
# on a VM whose host backs guest memory lazily each 2 MiB page can cost ~5 ms to fault in at start-up (a test suite
# builds hundreds of tiny engines: one with 26 MB of weights took 0.20-0.33 s to build moved, 0.15 s not).
MIN_BYTES = 64 << 20
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether the kernel gives transparent huge pages to a mapping that asks for them."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_ENABLED.read_text()
    except OSError:
        return False


PAGE = mmap.PAGESIZE
# Filesystems whose files live in memory: a spill there frees nothing.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")
_SPILL_CHUNK = 64 << 20  # bytes a spill writes or reads at a time


class HostMapping:
    """nbytes of zeroed bytes (`memory`, uint8) on a private anonymous mapping of their own, starting on a
    huge-page boundary advised MADV_HUGEPAGE when `huge` (else on a page boundary); pages are faulted in on first
    touch. `memory` keeps the mapping alive."""

    def __init__(self, nbytes: int, huge: bool = False):
        self.mapping = mmap.mmap(-1, max(nbytes, 1) + (HUGE_PAGE if huge else 0),
                                 flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            self.mapping.madvise(mmap.MADV_HUGEPAGE)
        base = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.start = -base.data_ptr() % HUGE_PAGE if huge else 0
        self.memory = base[self.start:self.start + nbytes]
        self.huge = huge

    def release(self, nbytes: int | None = None) -> None:
        """Hands the pages of the first nbytes (all by default; a whole number of pages) back to the kernel
        (MADV_DONTNEED): resident memory falls at once, the addresses stay, and the bytes read as zeros after."""
        nbytes = self.memory.numel() if nbytes is None else nbytes
        if nbytes:
            self.mapping.madvise(mmap.MADV_DONTNEED, self.start, cdiv(nbytes, PAGE) * PAGE)


def arena(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed uint8 starting on a huge-page boundary, on a private anonymous mapping advised
    MADV_HUGEPAGE (HostMapping(nbytes, huge=True).memory)."""
    return HostMapping(nbytes, huge=True).memory


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[HostMapping, torch.Tensor]:
    """A zero tensor on a mapping of its own (small pages, none resident until written) and that mapping."""
    home = HostMapping(math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
    return home, home.memory.view(dtype).view(shape)


def memory_filesystem(path: str) -> str | None:
    """The type of the filesystem that holds path when its files live in memory (tmpfs and the like), else None
    (the mount of the longest mount point above path's real path, /proc/self/mountinfo)."""
    real, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                fields = line.split()
                point, fstype = fields[4], fields[fields.index("-") + 1]
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, fstype
    except OSError:
        return None
    return kind if kind in MEMORY_FILESYSTEMS else None


def spill_directory(path: str) -> str:
    """path, created if need be, after checking that a spill there frees memory; ValueError naming it if not."""
    fstype = memory_filesystem(path)
    if fstype is not None:
        raise ValueError(f"sleep spill directory {path!r} is on {fstype}, whose files live in memory: a spill there "
                         f"frees nothing; set EngineConfig.sleep_spill_dir to a directory on disk")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"sleep spill directory {path!r} cannot be created: {exc}") from exc
    return path


class Spill:
    """A copy of some bytes in an unlinked file of a directory on disk, written at once and left out of the page
    cache (fsync, then POSIX_FADV_DONTNEED), so it takes no memory until `restore` reads it back and closes it.
    Nothing is left on disk if the process dies."""

    def __init__(self, memory: torch.Tensor, directory: str):
        fd, path = tempfile.mkstemp(prefix="fp8engine-sleep-", dir=directory)
        os.unlink(path)
        self.file, self.nbytes = os.fdopen(fd, "r+b", buffering=0), memory.numel()
        try:
            data = memoryview(memory.numpy())
            for at in range(0, self.nbytes, _SPILL_CHUNK):
                chunk = data[at:at + _SPILL_CHUNK]
                while chunk:
                    chunk = chunk[self.file.write(chunk):]
            os.fsync(fd)
            _drop_cached(fd)
        except BaseException:
            self.file.close()
            raise

    def restore(self, memory: torch.Tensor) -> None:
        """Reads the bytes back into memory (as many as were spilled) and closes the file; a read that fails leaves
        it open, so that the restore can be tried again."""
        data, at = memoryview(memory.numpy()), 0
        self.file.seek(0)
        while at < self.nbytes:
            got = self.file.readinto(data[at:min(self.nbytes, at + _SPILL_CHUNK)])
            if not got:
                raise OSError(f"sleep spill file ended after {at} of {self.nbytes} bytes")
            at += got
        _drop_cached(self.file.fileno())
        self.file.close()


def _drop_cached(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _whole(t: torch.Tensor) -> bool:
    """A contiguous CPU tensor that is all of its storage."""
    return (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0 and t.numel() > 0
            and t.untyped_storage().nbytes() == t.nbytes)


@dataclass(eq=False)
class Home:
    """Where rehome put a module's tensors: one mapping, the weights (parameters and weight buffers) first, in its
    first weight_bytes (a whole number of pages that holds nothing else), then the other buffers."""

    mapping: HostMapping
    moved: int  # bytes moved, each tensor on a 64-byte boundary
    weight_bytes: int
    left: list[str]  # the weights that stay where they were (their storage shared or only part theirs)


def rehome(module: nn.Module, min_bytes: int = 0, *, huge_pages: bool = True,
           weight_buffers: frozenset[str] = frozenset()) -> Home | None:
    """Moves the module's parameters and buffers onto one mapping of their own, values unchanged, when they come
    to at least min_bytes; on huge pages when huge_pages allows and they come to MIN_BYTES. The parameters and the
    buffers named in weight_buffers (the weights) come first. A tensor that shares its storage with another
    parameter or buffer, or is only part of it, stays where it is (moving it would part it from the other).
    Returns where they went (None: nothing moved)."""
    named = {}
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        named.setdefault(id(t), (name, t))
    users = Counter(t.untyped_storage().data_ptr() for _, t in named.values())
    weights, others, left = [], [], []
    for name, t in named.values():
        is_weight = isinstance(t, nn.Parameter) or name in weight_buffers
        if _whole(t) and users[t.untyped_storage().data_ptr()] == 1:
            (weights if is_weight else others).append(t)
        elif is_weight:
            left.append(name)
    weight_sizes = [cdiv(t.nbytes, _ALIGN) * _ALIGN for t in weights]
    other_sizes = [cdiv(t.nbytes, _ALIGN) * _ALIGN for t in others]
    moved = sum(weight_sizes) + sum(other_sizes)
    if not moved or moved < min_bytes:
        return None
    weight_bytes = cdiv(sum(weight_sizes), PAGE) * PAGE
    mapping = HostMapping(weight_bytes + sum(other_sizes), huge=huge_pages and moved >= MIN_BYTES)
    for tensors, sizes, offset in ((weights, weight_sizes, 0), (others, other_sizes, weight_bytes)):
        for t, size in zip(tensors, sizes):
            home = mapping.memory[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
            home.copy_(t)
            t.data = home
            offset += size
    return Home(mapping, moved, weight_bytes, left)
