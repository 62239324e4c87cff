"""Builds and loads the C++ CPU kernels in csrc/ (compiled on first use, cached by source hash).

Each csrc/*.cpp registers its ops with TORCH_LIBRARY_FRAGMENT(fp8engine, m); after loading they are
reachable as torch.ops.fp8engine.<name>. Without a compiler the engine falls back to the torch
reference implementations and says so once; with FP8ENGINE_REQUIRE_CPP=1 (what `make test` and CI set)
a failed build is an error instead, so a broken csrc/ cannot pass on the fallback.
"""

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parents[3] / "csrc"


def cache_root() -> Path:
    return Path(os.environ.get("FP8ENGINE_CACHE", Path.home() / ".cache" / "fp8engine"))


def _sources() -> list[Path]:
    return sorted(CSRC_DIR.glob("*.cpp"))


def require_cpp() -> bool:
    """Whether a failed C++ build must raise instead of falling back (FP8ENGINE_REQUIRE_CPP=1)."""
    return os.environ.get("FP8ENGINE_REQUIRE_CPP") == "1"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux); empty where /proc/cpuinfo does not list them."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                           if line.startswith("flags")), []))


@functools.cache
def load_cpu_ops():
    """torch.ops.fp8engine after building csrc/, or None when it cannot be built."""
    if os.environ.get("FP8ENGINE_DISABLE_CPP") == "1":
        return None
    sources = _sources()
    if not sources:
        return None
    # -march=native: a build is for this CPU's instruction sets (a home directory may move between machines).
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(sorted(cpu_flags())).encode())
    for src in sources + sorted(CSRC_DIR.glob("*.h")):
        digest.update(src.name.encode() + src.read_bytes())
    build_dir = cache_root() / "cpu_ops" / digest.hexdigest()[:16]
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils.cpp_extension import load
        load(name="fp8engine_cpu", sources=[str(s) for s in sources], build_directory=str(build_dir),
             extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++17"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, or a build error
        if require_cpp():
            raise RuntimeError(f"fp8engine: C++ CPU kernels failed to build and FP8ENGINE_REQUIRE_CPP=1: {exc}") from exc
        logger.warning("fp8engine: C++ CPU kernels unavailable (%s); using the torch reference", exc)
        return None
    return torch.ops.fp8engine


@functools.cache
def cpu_kernel(name: str):
    """torch.ops.fp8engine.<name> when the C++ kernels are built and hold it, else None."""
    ops = load_cpu_ops()
    return getattr(ops, name, None) if ops is not None else None


def fused_kernel(name: str, x: torch.Tensor):
    """The C++ op `name` for a CPU tensor in a dtype the kernels handle, else None (use torch)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_kernel(name)
