"""Every FP8ENGINE_* environment variable, in one table.

Each is read when it is needed once per process or per engine: the cache and build variables when the C++
kernels are first built, the kernel overrides when an engine starts and chooses its kernel set
(model_executor/kernel_set.py). Nothing reads them in the hot path. docs/environment.md is generated from
this table (`markdown_table()`; tests/test_envs.py keeps the two equal).
"""

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str
    choices: tuple[str, ...] | None
    help: str


VARIABLES = (
    EnvVar("FP8ENGINE_CACHE", "~/.cache/fp8engine", None,
           "where the default model is converted to and the C++ kernels are built"),
    EnvVar("FP8ENGINE_REQUIRE_CPP", "0", ("0", "1"),
           "1: a C++ kernel build that fails, or sources that are missing, is an error instead of a warning and "
           "the torch reference (`make test` and CI set it)"),
    EnvVar("FP8ENGINE_DISABLE_CPP", "0", ("0", "1"),
           "1: never build or load the C++ kernels; the engine runs the torch reference on CPU"),
    EnvVar("FP8ENGINE_FP8_GEMM", "auto", ("auto", "avx512", "amx"),
           "the GEMM of the CPU FP8 linears: AMX tiles where the CPU grants them (auto), or forced; `amx` "
           "where the tiles are missing is an error; `avx512` is the kernels below AMX (AVX2 + FMA where the CPU "
           "lacks AVX512-BF16)"),
    EnvVar("FP8ENGINE_BF16_GEMM", "auto", ("auto", "avx512", "amx"),
           "the same for the CPU BF16 linears and LM head"),
    EnvVar("FP8ENGINE_BI_GEMM", "cpp", ("cpp", "chunked"),
           "batch-invariant BF16 linears on CPU: the C++ GEMM (cpp) or torch's GEMM fed one shape, rows in "
           "zero-padded chunks of 64 (chunked)"),
    EnvVar("FP8ENGINE_FP32_HEAD", "tiles", ("tiles", "fma"),
           "the float32 LM head (lm_head_fp32) on CPU: the BF16 GEMM over an exact three-way bf16 split of "
           "the input (tiles), or the float32 FMA kernel (fma)"),
    EnvVar("FP8ENGINE_HUGE_PAGES", "1", ("0", "1"),
           "0: a CPU engine's weights go on small pages instead of transparent huge pages (on the engine's own "
           "mapping either way, which sleep releases in place: model_executor/host_memory.py)"),
    EnvVar("FP8ENGINE_NT16", "1", ("0", "1"),
           "0: a CPU engine on the AVX-512 BF16 kernels (or batch invariant on AMX tiles) keeps its weights as rows "
           "instead of the nt16 layout its small-batch kernel reads without transposing (weights/layout.py); batch "
           "invariant, the same bits either way; plain, rows take the gemv at 1-4 rows (another summation order)"),
    EnvVar("FP8ENGINE_FUSED_DECODER", "1", ("0", "1"),
           "0: never run the decoder layers as one C++ call (DecoderPlan); the Python layers run instead"),
    EnvVar("FP8ENGINE_PREFETCH_NEXT", "1", ("0", "1"),
           "0: the decoder plan does not name each projection's successor to its kernel, whose threads then do not "
           "prefetch their first share of the next weight (csrc/next_weight.h; an A/B switch: the same bits)"),
    EnvVar("FP8ENGINE_CUDA_FUSION", "1", ("0", "1"),
           "0: on CUDA, the decoder layers run unfused (torch ops for RMSNorm, RoPE and SiLU, an activation-quant "
           "launch before each FP8 GEMM) instead of the fused kernels of kernels/fused_triton.py (an A/B switch)"),
    EnvVar("FP8ENGINE_PDL", "0", ("0", "1"),
           "1: on CUDA sm_90 and later, the decode path's Triton kernels take programmatic dependent launch (each "
           "may start while the one before ends, and waits for it before touching memory: kernels/pdl.py); off "
           "until a device run has checked it"),
    EnvVar("FP8ENGINE_TMA_GEMM", "0", ("0", "1"),
           "1: on CUDA sm_90 and later, FP8 GEMMs of more than 64 rows copy their tiles with TMA descriptors "
           "(kernels/fp8_triton.py); off until a device run has timed it against the pointer loads"),
    EnvVar("FP8ENGINE_SWAP_AB_GEMM", "0", ("0", "1"),
           "1: on CUDA sm_90 and later, FP8 GEMMs of at most 16 rows put the weight tile on the 64-row side of the "
           "tensor cores' wgmma and the rows on its narrow side (E4M3 wgmma instead of f16 mma on converted codes; "
           "kernels/fp8_triton.py); not in batch-invariant engines; off until a device run has timed it"),
    EnvVar("FP8ENGINE_TP_ALL_REDUCE", "auto", ("auto", "fixed", "library"),
           "tensor parallelism: how row-parallel partial sums are added over the ranks: gathered and added in rank "
           "order (fixed: the same bits at any batch) or by the backend's all-reduce (library: gloo on CPU, NCCL on "
           "CUDA); auto = fixed with batch_invariant, else library"),
    EnvVar("FP8ENGINE_TP_DEVICE_BACKEND", "nccl", ("nccl", "gloo"),
           "tensor parallelism on CUDA: the backend of the ranks' collectives on device tensors (the forward's "
           "all-reduces, the LM head's gather); gloo, for debugging, copies through the host and cannot be captured "
           "in CUDA graphs (use it with enforce_eager=True). Control and weight staging always go over a gloo group "
           "of host tensors"),
    EnvVar("FP8ENGINE_NCCL_SO", "", None,
           "on CUDA, the NCCL library that vLLM-style weight transfer (weights/pynccl.py) loads; unset: the "
           "nvidia-nccl wheel's libnccl.so found on sys.path, else libnccl.so.2 from the loader's path"),
)
_BY_NAME = {v.name: v for v in VARIABLES}


def get(name: str) -> str:
    """The value of a variable of the table (its default when unset); ValueError naming it when not allowed."""
    var = _BY_NAME[name]
    value = os.environ.get(name, "").strip() or var.default
    if var.choices is not None and value not in var.choices:
        raise ValueError(f"{name} must be one of {var.choices}, got {value!r}")
    return value


def flag(name: str) -> bool:
    """A 0/1 variable as a bool."""
    return get(name) == "1"


def cache_root() -> Path:
    """FP8ENGINE_CACHE as a path (the default model and the C++ builds live under it)."""
    return Path(get("FP8ENGINE_CACHE")).expanduser()


def markdown_table() -> str:
    """docs/environment.md's table: a row per variable."""
    rows = ["| variable | default | values | what it does |", "|---|---|---|---|"]
    for v in VARIABLES:
        values = ", ".join(f"`{c}`" for c in v.choices) if v.choices else "a path"
        default = f"`{v.default}`" if v.default else "(unset)"
        rows.append(f"| `{v.name}` | {default} | {values} | {v.help} |")
    return "\n".join(rows) + "\n"
