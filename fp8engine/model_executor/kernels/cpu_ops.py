"""Builds and loads the C++ CPU kernels in fp8engine/csrc/ (compiled on first use, cached by source hash).

The sources ship inside the package, so a checkout and an installed wheel build them alike: same cache key
(torch version, CPU flags, every source's name and bytes), same flags, and the same build: the sources are built
from a copy inside their cache directory, so a checkout and an install (their paths differ) share one build instead
of rebuilding each other's. Each csrc/*.cpp registers its ops with
TORCH_LIBRARY_FRAGMENT(fp8engine, m); after loading they are reachable as torch.ops.fp8engine.<name>. A build
that cannot happen (no compiler, a build error, sources missing) warns once, naming the cause, and the engine
runs the torch reference implementations; with FP8ENGINE_REQUIRE_CPP=1 (what `make test` and CI set) it is an
error instead, so a broken or missing csrc/ cannot pass on the fallback. FP8ENGINE_DISABLE_CPP=1 skips them.
"""

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

from fp8engine import envs

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]


def require_cpp() -> bool:
    """Whether a failed C++ build must raise instead of falling back (FP8ENGINE_REQUIRE_CPP=1)."""
    return envs.flag("FP8ENGINE_REQUIRE_CPP")


def _cpuinfo(key: str) -> str | None:
    """The value of /proc/cpuinfo's first `key` line (Linux), else None."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return None
    return next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith(key)), None)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux); empty where /proc/cpuinfo does not list them."""
    return frozenset((_cpuinfo("flags") or "").split())


@functools.cache
def cpu_name() -> str | None:
    """The CPU's model name (Linux), else None."""
    return _cpuinfo("model name")


def thread_warning(threads: int) -> str | None:
    """What to tell a CPU engine running `threads` intra-op threads about its OpenMP setting, or None.
    OMP_WAIT_POLICY=passive puts the worker threads to sleep at the end of every parallel region, and a decode step
    opens ~150 of them (one per projection, attention call and head), each of which must then wake them through
    the kernel: batch-1 decode on a 2-vCPU Xeon took 15.5-17.8 ms a token against 5.7-6.2 with the default
    (libgomp spins a while before it sleeps)."""
    if threads > 1 and os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        return (f"OMP_WAIT_POLICY=passive with {threads} threads: every parallel region wakes sleeping workers, "
                "~3x slower decode steps; unset it (or set it to active)")
    return None

def build_dir(sources: list[Path]) -> Path:
    """Where these sources build: keyed by torch's version, the CPU's flags (-march=native builds for this CPU,
    and a home directory may move between machines) and every source file's name and bytes."""
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(sorted(cpu_flags())).encode())
    for src in sources:
        digest.update(src.name.encode() + src.read_bytes())
    return envs.cache_root() / "cpu_ops" / digest.hexdigest()[:16]


@functools.cache
def load_cpu_ops():
    """torch.ops.fp8engine after building csrc/, or None when it cannot be built (warned once)."""
    if envs.flag("FP8ENGINE_DISABLE_CPP"):
        logger.info("fp8engine: FP8ENGINE_DISABLE_CPP=1, the C++ CPU kernels are not loaded")
        return None
    try:
        sources = sorted(CSRC_DIR.glob("*.cpp"))
        if not sources:
            raise FileNotFoundError(f"no C++ sources in {CSRC_DIR} (an install without the package data?)")
        from torch.utils.cpp_extension import load
        files = sources + sorted(CSRC_DIR.glob("*.h"))
        directory = build_dir(files)
        copies = _copy_sources(files, directory / "src")
        load(name="fp8engine_cpu", sources=[str(c) for c in copies if c.suffix == ".cpp"], build_directory=str(directory),
             extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # no sources, no compiler, no ninja, or a build error
        if require_cpp():
            raise RuntimeError(f"fp8engine: C++ CPU kernels failed to build and FP8ENGINE_REQUIRE_CPP=1: {exc}") from exc
        logger.warning("fp8engine: C++ CPU kernels unavailable (%s); using the torch reference", exc)
        return None
    return torch.ops.fp8engine


def _copy_sources(files: list[Path], into: Path) -> list[Path]:
    """The files copied into `into` (once: the directory's name is their content's hash; a copy keeps its time,
    so a later build finds nothing changed). Each copy lands whole, even with several processes at once."""
    into.mkdir(parents=True, exist_ok=True)
    copies = []
    for src in files:
        dst = into / src.name
        if not dst.exists():
            tmp = into / f".{src.name}.{os.getpid()}"
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        copies.append(dst)
    return copies


@functools.cache
def cpu_kernel(name: str):
    """torch.ops.fp8engine.<name> when the C++ kernels are built and hold it, else None."""
    ops = load_cpu_ops()
    return getattr(ops, name, None) if ops is not None else None
