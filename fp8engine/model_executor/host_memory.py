"""The weights of a CPU engine on transparent huge pages.

A decode step at small batch streams every weight once: on 4 KiB pages that is a TLB miss every 4 KiB of a 100+ MB
stream. torch's allocator aligns and advises huge pages only when THP_MEM_ALLOC_ENABLE is set before torch starts,
which would change every allocation of the trainer beside the engine too; so the engine moves its own parameters
and buffers onto one private anonymous mapping advised MADV_HUGEPAGE, aligned to a huge page, once, before the
weights are loaded into them (weight updates write into the same memory). SmolLM2 batch-1 decode on a 2-vCPU Xeon:
8.1-8.4 -> 7.2-7.7 ms a step. The KV cache stays on the allocator's pages: its pages are first touched during the
run, where huge-page faults cost more than they saved (128 sequences: prefill 5.6 -> 6.6 s, decode steps equal).
Where the kernel offers no transparent huge pages (not Linux, or THP "never") nothing moves.
"""

import mmap
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


def arena(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed uint8 starting on a huge-page boundary, on a private anonymous mapping advised
    MADV_HUGEPAGE; pages are faulted in (2 MiB at a time where the kernel can) on first touch. The tensor
    keeps the mapping alive."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -base.data_ptr() % HUGE_PAGE
    return base[start:start + nbytes]


def _whole(t: torch.Tensor) -> bool:
    """A contiguous CPU tensor that is all of its storage."""
    return (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0 and t.numel() > 0
            and t.untyped_storage().nbytes() == t.nbytes)


def rehome(module: nn.Module, min_bytes: int | None = None) -> int:
    """Moves the module's parameters and buffers onto one huge-page arena, values unchanged, when they come to at
    least min_bytes (MIN_BYTES by default); returns the bytes moved. A tensor that shares its storage with another
    parameter or buffer, or is only part of it, stays where it is (moving it would part it from the other)."""
    tensors = list({id(t): t for t in (*module.parameters(), *module.buffers())}.values())
    users = Counter(t.untyped_storage().data_ptr() for t in tensors)
    tensors = [t for t in tensors if _whole(t) and users[t.untyped_storage().data_ptr()] == 1]
    sizes = [cdiv(t.nbytes, _ALIGN) * _ALIGN for t in tensors]
    if not tensors or sum(sizes) < (MIN_BYTES if min_bytes is None else min_bytes):
        return 0
    memory, offset = arena(sum(sizes)), 0
    for t, size in zip(tensors, sizes):
        home = memory[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        home.copy_(t)
        t.data = home
        offset += size
    return offset
