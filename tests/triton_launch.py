"""The Triton kernels' launches as the engine issues them, shared by the native-compile test
(tests/test_triton_compile.py, no GPU needed) and the GPU check (`make gpu-check`).

Nothing here restates a wrapper's launch configuration. A case builds the engine's tensors (the model's
fused Linear layers with their per-shard views, the KV cache as views of one [layers, 2, ...] tensor,
the step metadata in the dtypes model_runner uses) and calls the same wrappers the engine calls:
`Linear.forward` -> fp8_block_linear_triton, the loader's per-shard quantize_weight_blockwise_triton,
write_kv_cache_triton and paged_attention_triton. On "meta" tensors the wrappers run on the host only and
`record_launches` captures each kernel launch (grid, arguments, constexprs, num_warps, num_stages);
`compile_launch` then specialises it with Triton's own launch binder (pointer alignment, integer
divisibility, ints equal to 1 as constexprs, as a CUDA launch would) and compiles it for a GPU target.
On CUDA tensors the same cases run for real (benchmarks/gpu_check.py).

The kernel modules choose their interpreter-only branches (E4M3_BY_BITS / INTERPRET) from
triton.knobs.runtime.interpret when imported, and @triton.jit itself builds interpreter objects under
TRITON_INTERPRET=1, triton.language's own helpers included (at `import triton`). So native compiles run in
spawned processes with TRITON_INTERPRET unset (`clean_process_pool`, `compile_all`), on private copies of
both modules (`native_kernels()`) that never replace the modules sys.modules holds.

Triton is imported only inside functions: importing this module does not import it.
"""

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import torch

from fp8engine.model_executor import kernels as kernel_modules
from fp8engine.model_executor.kernels.attention_ref import FP8_DTYPE

_PACKAGE = "fp8engine.model_executor.kernels"
_KERNELS_DIR = Path(kernel_modules.__file__).parent

# Interpreter-only constexprs: compiled natively they must be False.
INTERPRETER_FLAGS = ("E4M3_BY_BITS", "INTERPRET")

# Per-block shared memory limits (opt-in maximum): H100/H200 227 KiB, Ada (sm_89) 99 KiB.
SHARED_LIMIT = {90: 232448, 89: 101376}
# Per-SM limits for occupancy (the CUDA occupancy calculator's rules): registers (allocated 256 a warp), shared
# memory (1 KiB reserved a block), warps, blocks; and the SMs of the device the arch is checked for (H100 SXM and
# H200: 132; L40S: 142).
SM_LIMITS = {90: dict(regs=65536, shared=233472, warps=64, blocks=32, sms=132),
             89: dict(regs=65536, shared=102400, warps=48, blocks=24, sms=142)}
MAX_REGS = 255
TARGETS = (90, 89)


# ------------------------------------------------------------------------------------------ shapes


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


MODELS = {
    # The default model (SmolLM2-135M-Instruct, a Llama): q/k/v shards of 576/192/192 rows are not
    # multiples of 128, so qkv_proj runs one GEMM per shard.
    "smollm2-135m": ModelShape("smollm2-135m", hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536),
    "llama-7b": ModelShape("llama-7b", hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336),
}

# Tokens in one forward step: a single decoding sequence (M = 1 is specialised as a constexpr), a decode
# batch (BLOCK_M 16), a prefill chunk (BLOCK_M 64).
LINEAR_TOKENS = {"decode1": 1, "decode": 13, "prefill": 512}

# Attention batches, per sequence (context length including the new tokens, new tokens), as the scheduler
# forms them: one decoding sequence (num_seqs == 1 is a constexpr), a decode batch (BLOCK_M 16) and a
# chunked prefill mixed with decodes (BLOCK_M 64).
ATTENTION_BATCHES = {
    "decode1": [(57, 1)],
    "decode": [(1, 1), (17, 1), (40, 1), (100, 1), (33, 1), (16, 1), (64, 1), (5, 1)],
    "prefill": [(300, 300), (77, 45), (40, 1)],
    "decode_long": [(3000, 1)],  # one sequence at 3K of context: split over the keys, then combined
}

# KV-cache modes: the model dtype, E4M3 with scales, E4M3 with full FP8 attention (fp8_q_scale).
KV_MODES = ("model", "fp8", "full-fp8")
K_SCALE, V_SCALE, Q_SCALE = 0.05, 0.03, 0.02
NUM_LAYERS_IN_CACHE = 2  # the cache tensor holds a few layers; cases use layer 1's views


def linear_layers(shape: ModelShape) -> list[tuple[str, int, list[int]]]:
    """(name, in_features, shard_sizes) of one decoder layer's projections, as models/llama.py builds them."""
    q_size, kv_size = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return [("qkv_proj", shape.hidden, [q_size, kv_size, kv_size]),
            ("o_proj", q_size, [shape.hidden]),
            ("gate_up_proj", shape.hidden, [shape.intermediate] * 2),
            ("down_proj", shape.intermediate, [shape.hidden])]


# ------------------------------------------------------------------------------------------ kernels


def _load_copy(name: str):
    path = _KERNELS_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{_PACKAGE}._native_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _as_imported(name: str, module) -> Iterator[None]:
    """sys.modules[name] is `module` within the block (what an `import` of it in a loading copy gets)."""
    canonical = f"{_PACKAGE}.{name}"
    saved = sys.modules.get(canonical)
    sys.modules[canonical] = module
    try:
        yield
    finally:
        if saved is None:
            del sys.modules[canonical]
        else:
            sys.modules[canonical] = saved


@functools.cache
def native_kernels() -> SimpleNamespace:
    """Copies of fp8_triton, attention_triton and dense_triton loaded with the Triton interpreter off:
    JITFunctions, module flags _E4M3_BY_BITS / _INTERPRET False. sys.modules keeps the real modules."""
    import triton
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        fp8 = _load_copy("fp8_triton")
        # attention_triton imports a helper from fp8_triton, dense_triton from attention_triton: give
        # them the native copies'.
        with _as_imported("fp8_triton", fp8):
            attention = _load_copy("attention_triton")
        with _as_imported("attention_triton", attention):
            dense = _load_copy("dense_triton")
            with _as_imported("fp8_triton", fp8):
                fused = _load_copy("fused_triton")
                moe = _load_copy("moe_triton")
    return SimpleNamespace(fp8=fp8, attention=attention, dense=dense, fused=fused, moe=moe)


def canonical_kernels() -> SimpleNamespace:
    """The modules the engine imports (on CUDA, without the interpreter)."""
    from fp8engine.model_executor.kernels import attention_triton, dense_triton, fp8_triton, fused_triton, moe_triton
    return SimpleNamespace(fp8=fp8_triton, attention=attention_triton, dense=dense_triton, fused=fused_triton,
                           moe=moe_triton)


def _modules(mods: SimpleNamespace) -> tuple:
    return tuple(getattr(mods, name) for name in ("fp8", "attention", "dense", "fused", "moe") if hasattr(mods, name))


def kernel_names(mods: SimpleNamespace) -> dict[str, object]:
    """Every @triton.jit kernel (a function with a program grid) of the kernel modules, by name."""
    return {name: getattr(mod, name) for mod in _modules(mods) for name in dir(mod) if _is_kernel(mod, name)}


def _is_kernel(mod, name: str) -> bool:
    """A launchable kernel: `*_kernel`, or its batch-invariant twin `*_kernel_bi` (the same function jitted
    without specialising on the batch size)."""
    return name.endswith(("_kernel", "_kernel_bi")) and hasattr(getattr(mod, name), "arg_names")


@contextlib.contextmanager
def triton_only(mods: SimpleNamespace) -> Iterator[None]:
    """The Triton kernels: the wrappers take DeepGEMM or FlashInfer only when asked (deepgemm= / flashinfer=,
    which the cases never pass), so there is nothing to switch off."""
    yield


# ------------------------------------------------------------------------------------------ cases


@dataclasses.dataclass
class Case:
    """One engine call: `run(mods, inputs)` calls the Triton wrappers, `ref(inputs)` the torch reference."""
    name: str
    kind: str  # act_quant | weight_quant | linear | dense | rms_norm | lora | write_kv | attention | gdn | fused
    make: Callable[[torch.device], dict]
    run: Callable[[SimpleNamespace, dict], object]
    ref: Callable[[dict], object] | None


def _randn(shape, dtype, device, scale=1.0):
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    return (torch.randn(shape, device=device) * scale).to(dtype)


def _linear_layer(mods, in_features: int, shards: list[int], shape: ModelShape, device, scale_fmt,
                  batch_invariant: bool = False):
    from fp8engine.model_executor.layers.linear import Linear

    def fp8_fn(x, w_q, w_scale_inv, bias=None, scale_fmt=None):  # the kernel set's fp8_linear on CUDA
        return mods.fp8.fp8_block_linear_triton(x, w_q, w_scale_inv, bias, scale_fmt=scale_fmt,
                                                batch_invariant=batch_invariant)
    # What Linear reads of its kernel set (model_executor/kernel_set.py), with these modules' FP8 linear.
    kernels = SimpleNamespace(fp8_linear=fp8_fn, fp8_scale_rows=False)
    with torch.device(device):
        return Linear(in_features, shards, shape.dtype, kernels, fp8=True, scale_fmt=scale_fmt)


def _weight_quant_case(shape: ModelShape, layer: str, in_features: int, shards: list[int],
                       scale_fmt: str | None) -> Case:
    def make(device):
        return {"shards": shards, "in_features": in_features, "device": device,
                "w": [_randn((n, in_features), shape.dtype, device, 0.02) for n in shards]}

    def run(mods, inputs):
        # The loader's write(): each checkpoint shard quantised into its views of the fused layer.
        if "layer" not in inputs:
            inputs["layer"] = _linear_layer(mods, in_features, shards, shape, inputs["device"], scale_fmt)
        lin = inputs["layer"]
        for i, w in enumerate(inputs["w"]):
            out_q, out_scale = lin.shard_views(i)
            mods.fp8.quantize_weight_blockwise_triton(w, out_q, out_scale, scale_fmt=scale_fmt)
        return [lin.shard_views(i) for i in range(len(shards))]

    def ref(inputs):
        from fp8engine.weights import quant
        return [quant.quantize_weight_blockwise(w, scale_fmt=scale_fmt) for w in inputs["w"]]
    fmt = f"/{scale_fmt}" if scale_fmt else ""
    return Case(f"{shape.name}/weight_quant/{layer}{fmt}", "weight_quant", make, run, ref)


def _linear_case(shape: ModelShape, layer: str, in_features: int, shards: list[int], tokens: str,
                 scale_fmt: str | None, batch_invariant: bool = False) -> Case:
    m = LINEAR_TOKENS[tokens]

    def make(device):
        inputs = {"x": _randn((m, in_features), shape.dtype, device), "device": device,
                  "w": _randn((sum(shards), in_features), shape.dtype, device, 0.02)}
        return inputs

    def _layer(mods, inputs):
        from fp8engine.weights import quant
        lin = _linear_layer(mods, in_features, shards, shape, inputs["device"], scale_fmt, batch_invariant)
        if torch.device(inputs["device"]).type != "meta":
            with torch.no_grad():
                for i, n in enumerate(shards):
                    out_q, out_scale = lin.shard_views(i)
                    start = lin.shard_offsets[i]
                    quant.quantize_weight_into(inputs["w"][start:start + n], out_q, out_scale, scale_fmt=scale_fmt)
        return lin

    def run(mods, inputs):
        if "layer" not in inputs:
            inputs["layer"] = _layer(mods, inputs)
        return inputs["layer"](inputs["x"])  # its kernel set holds these modules' FP8 linear, on any device

    def ref(inputs):
        from fp8engine.weights import quant
        lin = inputs["layer"]
        return quant.fp8_block_linear_ref(inputs["x"], lin.weight, lin.weight_scale_inv, None,
                                          scale_fmt=scale_fmt, scale_rows=lin.scale_rows)
    return Case(f"{shape.name}/linear/{layer}/{tokens}", "linear", make, run, ref)


def _dense_case(shape: ModelShape, layer: str, in_features: int, out_features: int, tokens: str,
                out_dtype: torch.dtype | None = None) -> Case:
    """A model-dtype linear layer (or, with out_dtype float32, the float32-logit LM head) on the
    batch-invariant Triton GEMM."""
    m = LINEAR_TOKENS[tokens]

    def make(device):
        return {"x": _randn((m, in_features), shape.dtype, device),
                "w": _randn((out_features, in_features), shape.dtype, device, 0.02)}

    def run(mods, inputs):
        return mods.dense.linear_triton(inputs["x"], inputs["w"], out_dtype=out_dtype)

    def ref(inputs):
        out = inputs["x"].float() @ inputs["w"].float().T
        return out.to(out_dtype or inputs["x"].dtype)
    return Case(f"{shape.name}/dense/{layer}/{tokens}", "dense", make, run, ref)


LORA_RANK = 16


def _lora_case(shape: ModelShape, layer: str, in_features: int, shards: list[int], tokens: str) -> Case:
    """A rank-16 LoRA adapter on every shard of a linear layer, added to its output (layers/lora.py's buffers:
    A [S*R, K], B^T [S*R, N] block-diagonal, a segment per shard)."""
    m, r = LINEAR_TOKENS[tokens], LORA_RANK

    def make(device):
        width, n = len(shards) * r, sum(shards)
        offsets = [sum(shards[:i]) for i in range(len(shards))]
        segments = torch.tensor([[i * r, (i + 1) * r, o, o + size] for i, (o, size) in enumerate(zip(offsets, shards))])
        bt = _randn((width, n), shape.dtype, device, 0.02)
        if torch.device(device).type != "meta":
            inside = torch.zeros(width, n, dtype=torch.bool, device=device)
            for j0, j1, o0, o1 in segments.tolist():
                inside[j0:j1, o0:o1] = True
            bt = torch.where(inside, bt, torch.zeros((), dtype=bt.dtype, device=device))
        return {"x": _randn((m, in_features), shape.dtype, device), "y": _randn((m, n), shape.dtype, device),
                "a": _randn((width, in_features), shape.dtype, device, 0.02), "bt": bt, "segments": segments}

    def run(mods, inputs):
        return mods.dense.lora_add_triton(inputs["y"].clone(), inputs["x"], inputs["a"], inputs["bt"],
                                          inputs["segments"])

    def ref(inputs):
        from fp8engine.model_executor.kernels.layer_ops_ref import lora_add_ref
        return lora_add_ref(inputs["y"].clone(), inputs["x"], inputs["a"], inputs["bt"])
    return Case(f"{shape.name}/lora/{layer}/{tokens}", "lora", make, run, ref)


def _rms_norm_case(shape: ModelShape, tokens: str) -> Case:
    m = LINEAR_TOKENS[tokens]

    def make(device):
        return {"x": _randn((m, shape.hidden), shape.dtype, device), "r": _randn((m, shape.hidden), shape.dtype, device),
                "w": _randn((shape.hidden,), shape.dtype, device)}

    def run(mods, inputs):
        return mods.dense.rms_norm_triton(inputs["x"], inputs["r"], inputs["w"], 1e-5)

    def ref(inputs):
        summed = inputs["x"] + inputs["r"]
        xf = summed.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(summed.dtype)
        return inputs["w"] * normed, summed
    return Case(f"{shape.name}/rms_norm/{tokens}", "rms_norm", make, run, ref)


def _act_quant_case(shape: ModelShape, in_features: int, tokens: str, scale_fmt: str | None) -> Case:
    m = LINEAR_TOKENS[tokens]

    def make(device):
        return {"x": _randn((m, in_features), shape.dtype, device)}

    def run(mods, inputs):
        return mods.fp8.per_token_group_quant_fp8(inputs["x"], scale_fmt=scale_fmt)

    def ref(inputs):
        from fp8engine.weights import quant
        return quant.quantize_activation_groups(inputs["x"], scale_fmt=scale_fmt)
    fmt = f"/{scale_fmt}" if scale_fmt else ""
    return Case(f"{shape.name}/act_quant/K={in_features}/{tokens}{fmt}", "act_quant", make, run, ref)


def attention_inputs(shape: ModelShape, batch: str, kv_mode: str, device) -> dict:
    """A step's attention tensors in the engine's layout: q / k / v as rotary and split leave them
    (contiguous), layer 1's K/V views of a [layers, 2, blocks, block_size, kv_heads, head_dim] cache,
    metadata as model_runner._prepare builds it (blocks shuffled over the pool)."""
    seqs = ATTENTION_BATCHES[batch]
    bs = shape.block_size
    needed = [-(-seq_len // bs) for seq_len, _ in seqs]
    num_blocks = sum(needed) + 3
    gen = torch.Generator().manual_seed(len(seqs) * 1000 + num_blocks)
    ids = torch.randperm(num_blocks, generator=gen)
    tables, slots, starts = [], [], [0]
    offset = 0
    for (seq_len, new), n in zip(seqs, needed):
        table = ids[offset:offset + n].tolist()
        offset += n
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(seq_len - new, seq_len)]
        starts.append(starts[-1] + new)
    width = max(needed)
    padded = [t + [0] * (width - len(t)) for t in tables]
    tokens = starts[-1]
    kv_dtype = shape.dtype if kv_mode == "model" else FP8_DTYPE
    meta = torch.device(device).type == "meta"
    cache_shape = (NUM_LAYERS_IN_CACHE, 2, num_blocks, bs, shape.kv_heads, shape.head_dim)
    if meta:
        cache = torch.empty(cache_shape, dtype=kv_dtype, device=device)
    else:
        # The positions before this step's tokens were written by earlier steps.
        cache = torch.randn(cache_shape, generator=gen)
        if kv_dtype == FP8_DTYPE:  # real values N(0, 1), stored / k_scale (v_scale)
            cache[:, 0] /= K_SCALE
            cache[:, 1] /= V_SCALE
            cache = cache.clamp(-448, 448)
        cache = cache.to(kv_dtype).to(device)
    scales = kv_dtype == FP8_DTYPE

    def tensor(values, dtype):
        return torch.empty(len(values), dtype=dtype, device=device) if meta else \
            torch.tensor(values, dtype=dtype, device=device)
    return dict(
        q=_randn((tokens, shape.heads, shape.head_dim), shape.dtype, device),
        k=_randn((tokens, shape.kv_heads, shape.head_dim), shape.dtype, device),
        v=_randn((tokens, shape.kv_heads, shape.head_dim), shape.dtype, device),
        k_cache=cache[1, 0], v_cache=cache[1, 1],
        slot_mapping=tensor(slots, torch.int64),
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor([seq_len for seq_len, _ in seqs], torch.int32),
        block_tables=(torch.empty(len(seqs), width, dtype=torch.int32, device=device) if meta
                      else torch.tensor(padded, dtype=torch.int32, device=device)),
        scale=shape.head_dim ** -0.5,
        k_scale=K_SCALE if scales else 1.0, v_scale=V_SCALE if scales else 1.0,
        fp8_q_scale=Q_SCALE if kv_mode == "full-fp8" else None,
    )


def _write_kv_args(inputs: dict) -> tuple:
    return (inputs["k"], inputs["v"], inputs["k_cache"], inputs["v_cache"], inputs["slot_mapping"],
            inputs["k_scale"], inputs["v_scale"])


def _attention_args(inputs: dict) -> tuple:
    return (inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["query_start_loc"],
            inputs["seq_lens"], inputs["scale"], inputs["k_scale"], inputs["v_scale"], inputs["fp8_q_scale"])


def _write_kv_case(shape: ModelShape, batch: str, kv_mode: str) -> Case:
    def run(mods, inputs):
        mods.attention.write_kv_cache_triton(*_write_kv_args(inputs))
        return inputs["k_cache"], inputs["v_cache"]

    def ref(inputs):
        from fp8engine.model_executor.kernels.attention_ref import write_kv_cache_ref
        k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
        write_kv_cache_ref(inputs["k"], inputs["v"], k_cache, v_cache, *_write_kv_args(inputs)[4:])
        return k_cache, v_cache
    return Case(f"{shape.name}/write_kv/{kv_mode}/{batch}", "write_kv",
                functools.partial(attention_inputs, shape, batch, kv_mode), run, ref)


def _attention_case(shape: ModelShape, batch: str, kv_mode: str, batch_invariant: bool = False) -> Case:
    def run(mods, inputs):
        return mods.attention.paged_attention_triton(*_attention_args(inputs), batch_invariant=batch_invariant)

    def ref(inputs):
        from fp8engine.model_executor.kernels.attention_ref import paged_attention_ref
        return paged_attention_ref(*_attention_args(inputs))
    return Case(f"{shape.name}/attention/{kv_mode}/{batch}", "attention",
                functools.partial(attention_inputs, shape, batch, kv_mode), run, ref)


def _attention_quant_case(shape: ModelShape, batch: str, kv_mode: str) -> Case:
    """Attention writing its output as the FP8 o_proj's input (kernels.attention_quant: 128-wide heads), in its own
    launch or, on a split decode, in the combine. Kind "fused": (codes, scales) against the reference's output
    quantized by the group quant's reference."""
    def run(mods, inputs):
        return mods.attention.paged_attention_quant_triton(*_attention_args(inputs))

    def ref(inputs):
        from fp8engine.model_executor.kernels.attention_ref import paged_attention_ref
        from fp8engine.weights.quant import quantize_activation_groups
        out = paged_attention_ref(*_attention_args(inputs))
        x_q, x_s = quantize_activation_groups(out.reshape(out.shape[0], -1))
        x_s[int(inputs["query_start_loc"][-1]):] = 0.0  # tokens outside every sequence: zero codes, zero scales
        return x_q, x_s
    return Case(f"{shape.name}/fused/attention_quant/{kv_mode}/{batch}", "fused",
                functools.partial(attention_inputs, shape, batch, kv_mode), run, ref)


def _fused_cases(shape: ModelShape, tokens: str, kv_mode: str) -> list[Case]:
    """The fused decoder-layer kernels (kernels/fused_triton.py) at a step of this model: the norm with the residual
    add and the FP8 activation quant (and the final norm's BF16 row), the qkv epilogue into a `kv_mode` cache, silu
    * mul with down_proj's quant. Kind "fused": a tuple of outputs, the reference fused_ref's."""
    m = LINEAR_TOKENS[tokens]
    h, heads, kv_heads, d = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
    name = f"{shape.name}/fused"

    def norm_make(device):
        return {"x": _randn((m, h), shape.dtype, device), "r": _randn((m, h), shape.dtype, device),
                "w": _randn((h,), shape.dtype, device)}

    def norm_run(quant):
        return lambda mods, inputs: mods.fused.norm_quant(inputs["x"], inputs["r"], inputs["w"], 1e-5, quant=quant,
                                                          normed=not quant)

    def norm_ref(quant):
        def ref(inputs):  # (x_q, x_scale, s, None) quantized, else (None, None, s, normed), as norm_quant returns
            from fp8engine.model_executor.kernels.fused_ref import norm_quant_ref
            x_q, x_scale, summed, normed = norm_quant_ref(inputs["x"], inputs["r"], inputs["w"], 1e-5, quant_out=quant)
            return x_q, x_scale, summed, None if quant else normed
        return ref

    def silu_make(device):
        return {"x": _randn((m, 2 * shape.intermediate), shape.dtype, device, 4.0)}

    def silu_run(mods, inputs):
        return mods.fused.silu_mul_quant(inputs["x"])

    def silu_ref(inputs):
        from fp8engine.model_executor.kernels.fused_ref import silu_mul_ref
        return silu_mul_ref(inputs["x"])

    def qkv_make(device):
        inputs = attention_inputs(shape, tokens, kv_mode, device)
        t = inputs["q"].shape[0]
        inputs |= {"qkv": _randn((t, (heads + 2 * kv_heads) * d), shape.dtype, device),
                   "cos": _randn((t, d), shape.dtype, device), "sin": _randn((t, d), shape.dtype, device)}
        return inputs

    def qkv_run(mods, inputs):
        k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
        q = mods.fused.qkv_epilogue(inputs["qkv"], inputs["cos"], inputs["sin"], None, None, 1e-6, k_cache, v_cache,
                                    inputs["slot_mapping"], inputs["k_scale"], inputs["v_scale"], heads, kv_heads, d)
        return q, k_cache, v_cache

    def qkv_ref(inputs):
        from fp8engine.model_executor.kernels.attention_ref import write_kv_cache_ref
        from fp8engine.model_executor.kernels.fused_ref import qkv_epilogue_ref
        q, k, v = qkv_epilogue_ref(inputs["qkv"], inputs["cos"], inputs["sin"], None, None, 1e-6, heads, kv_heads, d)
        k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
        write_kv_cache_ref(k, v, k_cache, v_cache, inputs["slot_mapping"], inputs["k_scale"], inputs["v_scale"])
        return q, k_cache, v_cache

    return [Case(f"{name}/norm_quant/{tokens}", "fused", norm_make, norm_run(True), norm_ref(True)),
            Case(f"{name}/norm/{tokens}", "fused", norm_make, norm_run(False), norm_ref(False)),
            Case(f"{name}/silu_mul_quant/{tokens}", "fused", silu_make, silu_run, silu_ref),
            Case(f"{name}/qkv_epilogue/{kv_mode}/{tokens}", "fused", qkv_make, qkv_run, qkv_ref)]


KINDS = ("weight_quant", "act_quant", "linear", "write_kv", "attention", "fused")


def engine_cases(shape: ModelShape, scale_fmts=(None,), kinds=KINDS, steps=tuple(ATTENTION_BATCHES),
                 kv_modes=KV_MODES) -> list[Case]:
    """The Triton calls a step (and a weight load) of this model makes: linear layers at LINEAR_TOKENS[step],
    attention over ATTENTION_BATCHES[step] for each KV mode; quantisation in each scale format (the linear
    layers in the first)."""
    layers = linear_layers(shape)
    cases = []
    if "weight_quant" in kinds:
        cases += [_weight_quant_case(shape, layer, k, shards, fmt)
                  for fmt in scale_fmts for layer, k, shards in layers]
    if "act_quant" in kinds:  # also inside every linear case; alone they are compared bit for bit
        in_features = sorted({k for _, k, _ in layers})
        cases += [_act_quant_case(shape, k, "prefill", fmt) for fmt in scale_fmts for k in in_features]
    if "linear" in kinds:
        cases += [_linear_case(shape, layer, k, shards, step, scale_fmts[0])
                  for step in steps if step in LINEAR_TOKENS for layer, k, shards in layers]
    for kv_mode in kv_modes:
        for step in steps:
            if "write_kv" in kinds and kv_mode != "full-fp8":  # full FP8 writes the cache as fp8 does
                cases.append(_write_kv_case(shape, step, kv_mode))
            if "attention" in kinds:
                cases.append(_attention_case(shape, step, kv_mode))
    if "fused" in kinds and shape.head_dim & (shape.head_dim - 1) == 0:
        fused = {}  # by name: the norm and silu cases do not depend on the KV mode
        for kv_mode in kv_modes:
            for step in steps:
                if kv_mode != "full-fp8" and step in LINEAR_TOKENS:
                    fused |= {c.name: c for c in _fused_cases(shape, step, kv_mode)}
                if shape.head_dim == 128 and step.startswith("decode"):  # o_proj's input from attention itself
                    fused[f"attention_quant/{kv_mode}/{step}"] = _attention_quant_case(shape, step, kv_mode)
        cases += fused.values()
    return cases


# Hybrid models' gated delta rule (dense_triton.gdn_recurrent_triton) at Qwen3.5-35B-A3B / Qwen3-Next's linear
# heads: 16 key and 32 value heads of 128; a decode step of 8 sequences and a prefill of two.
GDN_HEADS = (16, 32, 128, 128)
GDN_SEQS = {"decode": [1] * 8, "prefill": [64, 37]}


def _gdn_case(shape: ModelShape, step: str) -> Case:
    lens = GDN_SEQS[step]
    hk, hv, dk, dv = GDN_HEADS

    def make(device):
        from fp8engine.model_executor.kernels.gated_delta_ref import kernel_inputs
        t = sum(lens)
        raw = {"q": _randn((t, hk, dk), torch.float32, device), "k": _randn((t, hk, dk), torch.float32, device),
               "v": _randn((t, hv, dv), torch.float32, device), "g": _randn((t, hv), torch.float32, device, 0.1),
               "beta": _randn((t, hv), torch.float32, device, 0.3)}
        if torch.device(device).type != "meta":
            raw["g"], raw["beta"] = -raw["g"].abs(), raw["beta"].abs().clamp(max=1.0)
        prepared = dict(zip(("pq", "pk", "pv", "pg", "pbeta"), kernel_inputs(*raw.values())))
        state = _randn((len(lens) + 1, hv, dk, dv), torch.float32, device, 0.1)
        slots = torch.arange(1, len(lens) + 1, device=device)
        starts = torch.tensor([0, *lens], device="cpu").cumsum(0).to(device)
        return raw | prepared | {"state": state, "slots": slots, "starts": starts}

    def run(mods, inputs):
        state = inputs["state"].clone()
        return mods.dense.gdn_recurrent_triton(inputs["pq"], inputs["pk"], inputs["pv"], inputs["pg"],
                                               inputs["pbeta"], state, inputs["slots"], inputs["starts"])

    def ref(inputs):
        from fp8engine.model_executor.kernels.gated_delta_ref import recurrent_gated_delta_ref
        states = inputs["state"][inputs["slots"]]
        return recurrent_gated_delta_ref(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], states,
                                         lens)[0]
    return Case(f"{shape.name}/gdn/{step}", "gdn", make, run, ref)


# MoE layers (moe_triton.fused_moe_triton) at Qwen3-30B-A3B's sizes: 128 experts of 768, top 8, hidden 2048
MOE_SHAPE = dict(experts=128, top_k=8, hidden=2048, inter=768)


def _moe_case(label: str, tokens: str, fp8: bool, batch_invariant: bool = False) -> Case:
    """A MoE block's experts at LINEAR_TOKENS[tokens] rows: the grouped GEMM twice (gate_up, then down) over the
    rows sorted by expert (align_rows' fixed tile count), FP8 with its activation quants or BF16."""
    m, (e, k, h, i) = LINEAR_TOKENS[tokens], MOE_SHAPE.values()

    def make(device):
        meta = torch.device(device).type == "meta"
        ids = torch.empty(m, k, dtype=torch.int64, device=device) if meta else torch.stack(
            [torch.randperm(e, device=device)[:k] for _ in range(m)])
        weights = _randn((m, k), torch.bfloat16, device)
        wdtype = FP8_DTYPE if fp8 else torch.bfloat16
        inputs = {"x": _randn((m, h), torch.bfloat16, device), "ids": ids,
                  "weights": weights if meta else torch.softmax(weights.float(), -1).to(torch.bfloat16),
                  "w13": _randn((e, 2 * i, h), wdtype, device, 0.05), "w2": _randn((e, h, i), wdtype, device, 0.05),
                  "s13": None, "s2": None}
        if fp8:
            inputs["s13"] = _randn((e, 2 * i // 128, h // 128), torch.float32, device).abs() + 1e-3
            inputs["s2"] = _randn((e, h // 128, i // 128), torch.float32, device).abs() + 1e-3
        return inputs

    def run(mods, inputs):
        return mods.moe.fused_moe_triton(inputs["x"], inputs["ids"], inputs["weights"], inputs["w13"], inputs["w2"],
                                         inputs["s13"], inputs["s2"], batch_invariant=batch_invariant)

    def ref(inputs):
        from fp8engine.model_executor.kernels.moe_ref import fused_moe_ref
        return fused_moe_ref(inputs["x"], inputs["ids"], inputs["weights"], inputs["w13"], inputs["w2"],
                             inputs["s13"], inputs["s2"])
    return Case(f"{label}/moe/{'fp8' if fp8 else 'model'}/{tokens}", "moe", make, run, ref)


def batch_invariant_cases(shape: ModelShape, vocab: int = 49152) -> list[Case]:
    """The launches of EngineConfig(batch_invariant=True) on CUDA, at every step: FP8 and model-dtype linear
    layers, the float32 LM head, RMSNorm, a LoRA adapter on qkv_proj (the same kernels with or without batch
    invariance) and attention in each KV mode. Their shape name ends in "-bi"."""
    bi = dataclasses.replace(shape, name=f"{shape.name}-bi")
    cases = []
    for step in LINEAR_TOKENS:
        for layer, k, shards in linear_layers(shape):
            cases.append(_linear_case(bi, layer, k, shards, step, None, batch_invariant=True))
            cases.append(_dense_case(bi, layer, k, sum(shards), step))
        cases.append(_dense_case(bi, "lm_head_fp32", shape.hidden, vocab, step, torch.float32))
        cases.append(_rms_norm_case(bi, step))
        cases.append(_lora_case(bi, "qkv_proj", *linear_layers(shape)[0][1:], step))
    cases += [_attention_case(bi, step, kv_mode, batch_invariant=True)
              for kv_mode in KV_MODES for step in ATTENTION_BATCHES]
    cases += [_gdn_case(bi, step) for step in GDN_SEQS]  # one kernel with or without batch invariance
    cases += [_moe_case(bi.name, "decode", True, batch_invariant=True)]
    return cases


def case_sets() -> dict[str, list[Case]]:
    """The cases the compile test and the GPU check cover: the default model in bf16 (both scale formats, all
    steps), a 7B-class Llama in bf16 (decode batch and prefill), the default model's attention in float32
    (dtype="float32"; its fp32 dots run on FMA units), and the default model's batch-invariant launches."""
    fp32 = dataclasses.replace(MODELS["smollm2-135m"], name="smollm2-135m-fp32", dtype=torch.float32)
    return {
        "smollm2-135m": engine_cases(MODELS["smollm2-135m"], scale_fmts=(None, "ue8m0")),
        "llama-7b": engine_cases(MODELS["llama-7b"], steps=("decode", "prefill", "decode_long"))
        + [_moe_case("llama-7b", tokens, fp8) for fp8 in (True, False) for tokens in ("decode", "prefill")],
        "smollm2-135m-fp32": engine_cases(fp32, kinds=("write_kv", "attention"), steps=("decode", "prefill"),
                                          kv_modes=("model", "fp8")),
        "smollm2-135m-bi": batch_invariant_cases(MODELS["smollm2-135m"]),
    }


# ------------------------------------------------------------------------------------------ launches


@dataclasses.dataclass
class Launch:
    kernel: object  # a JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    case: str = ""
    attr: str = ""  # the module attribute launched (a batch-invariant twin shares its function's name)

    @property
    def name(self) -> str:
        return self.attr or self.kernel.__name__


class _Recorder:
    def __init__(self, kernel, launches: list, name: str):
        self.kernel, self.launches, self.name = kernel, launches, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(Launch(self.kernel, tuple(grid), args, kwargs, attr=self.name))
        return launch


@contextlib.contextmanager
def record_launches(mods: SimpleNamespace) -> Iterator[list[Launch]]:
    """Within the block, the modules' kernels record their launches instead of running."""
    launches: list[Launch] = []
    saved = []
    for mod in _modules(mods):
        for name in dir(mod):
            kernel = getattr(mod, name)
            if _is_kernel(mod, name):
                saved.append((mod, name, kernel))
                setattr(mod, name, _Recorder(kernel, launches, name))
    try:
        yield launches
    finally:
        for mod, name, kernel in saved:
            setattr(mod, name, kernel)


def case_launches(case: Case, mods: SimpleNamespace | None = None) -> list[Launch]:
    """The kernel launches the case makes, captured on meta tensors."""
    mods = mods or native_kernels()
    inputs = case.make(torch.device("meta"))
    with triton_only(mods), record_launches(mods) as launches:
        case.run(mods, inputs)
    for launch in launches:
        launch.case = case.name
    return launches


def _specialize(launch: Launch, target):
    """(signature, constexprs, attrs, options) of the launch, as JITFunction.run derives them."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    import triton
    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs)
    # The options JITFunction.run adds before binding.
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(triton.knobs.compilation, knob):
            kwargs[knob] = getattr(triton.knobs.compilation, knob)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options


def launch_key(launch: Launch, arch: int) -> str:
    """Launches with the same key compile to the same binary."""
    from triton.backends.compiler import GPUTarget
    signature, constexprs, attrs, options = _specialize(launch, GPUTarget("cuda", arch, 32))
    return repr((launch.name, signature, sorted(constexprs.items()), sorted(attrs.items()),
                 sorted(options.__dict__.items())))


@dataclasses.dataclass
class CompiledLaunch:
    """A compiled launch and what its code shows."""
    name: str
    arch: int
    cases: list[str]
    constexprs: dict
    num_warps: int
    num_stages: int
    ptx: str
    n_regs: int
    stack_bytes: int  # per-thread stack frame: spills here (these kernels make no calls)
    spill_stores: int  # STL instructions in the SASS
    spill_loads: int  # LDL instructions in the SASS
    shared: int  # bytes per block: Triton's dynamic shared memory plus any static
    pdl: bool = False  # launched with programmatic dependent launch (kernels/pdl.py)
    grids: list = dataclasses.field(default_factory=list)  # (case, grid) of each launch this binary serves

    @property
    def mma(self) -> dict[str, set[str]]:
        return mma_instructions(self.ptx)

    def summary(self) -> dict:
        mma = self.mma
        return {"kernel": self.name, "arch": f"sm_{self.arch}", "instr": instruction_class(self.ptx),
                "wgmma": sorted(mma["wgmma"]), "mma": sorted(mma["mma"]), "regs": self.n_regs,
                "stack": self.stack_bytes, "spill_stores": self.spill_stores, "spill_loads": self.spill_loads,
                "shared": self.shared, "num_warps": self.num_warps, "num_stages": self.num_stages,
                "constexprs": {k: str(v) for k, v in self.constexprs.items()}, "cases": self.cases}


def _constexpr_names(kernel, constexprs: dict) -> dict:
    """By argument name, as plain values (tl.dtype as its name: 'bf16', 'fp32')."""
    return {kernel.arg_names[path[0]]: value if isinstance(value, (bool, int, float, type(None))) else str(value)
            for path, value in constexprs.items() if len(path) == 1}


def compile_launch(launch: Launch, arch: int, cases: list[str] | None = None,
                   native_only: bool = True, grids: list | None = None) -> CompiledLaunch:
    """Compiles the launch natively for sm_<arch> (through ptxas) and reads its resource use. native_only:
    refuse interpreter-only constexprs set True."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", arch, 32)
    with triton.knobs.runtime.scope():  # code generation consults the knob (constexpr functions)
        triton.knobs.runtime.interpret = False
        signature, constexprs, attrs, options = _specialize(launch, target)
        names = _constexpr_names(launch.kernel, constexprs)
        for flag in INTERPRETER_FLAGS:
            if native_only and names.get(flag, False):
                raise AssertionError(f"{launch.name}: {flag}=True, an interpreter-only branch, in a native compile")
        compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    usage = cubin_usage(compiled.asm["cubin"])
    return CompiledLaunch(
        name=launch.name, arch=arch, cases=cases or [launch.case], constexprs=names,
        num_warps=options.num_warps, num_stages=options.num_stages, ptx=compiled.asm["ptx"],
        n_regs=usage["regs"], stack_bytes=usage["stack"], spill_stores=usage["stl"], spill_loads=usage["ldl"],
        shared=compiled.metadata.shared + usage["static_shared"], pdl=bool(compiled.metadata.launch_pdl),
        grids=grids or [(launch.case, launch.grid)])


def cubin_usage(cubin: bytes) -> dict:
    """Registers, stack frame, static shared memory of a one-kernel cubin (cuobjdump -res-usage); where there is
    a stack frame, its local store / load instructions in the SASS (the spill code; disassembling costs ~0.5 s)."""
    import triton
    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        usage = {key.lower(): int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res)}
        stack = usage["stack"] + usage["local"]
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout \
            if stack else ""
    return {"regs": usage["reg"], "stack": stack, "static_shared": usage["shared"],
            "stl": len(re.findall(r"\bSTL(\.\w+)*\s", sass)), "ldl": len(re.findall(r"\bLDL(\.\w+)*\s", sass))}


def compile_cases(cases: list[Case], arch: int, mods: SimpleNamespace | None = None) -> list[CompiledLaunch]:
    """Every distinct launch of the cases compiled for sm_<arch> (identical specialisations once)."""
    distinct: dict[str, tuple[Launch, list[str], list]] = {}
    for case in cases:
        for launch in case_launches(case, mods):
            entry = distinct.setdefault(launch_key(launch, arch), (launch, [], []))
            if case.name not in entry[1]:
                entry[1].append(case.name)
            entry[2].append((case.name, tuple(launch.grid)))
    return [compile_launch(launch, arch, names, grids=grids) for launch, names, grids in distinct.values()]


def _compile_set(label: str, arch: int) -> list[CompiledLaunch]:
    return compile_cases(case_sets()[label], arch)


def _without_interpreter() -> None:
    os.environ.pop("TRITON_INTERPRET", None)


# The kernels a decode step launches with programmatic dependent launch when it is on (kernels/pdl.py).
PDL_KERNELS = {"_group_quant_kernel", "_w8a8_block_matmul_kernel", "_w8a8_block_matmul_kernel_bi", "_norm_quant_kernel",
               "_qkv_epilogue_kernel", "_silu_mul_quant_kernel", "_paged_attention_kernel",
               "_paged_attention_kernel_bi", "_combine_kernel", "_write_kv_kernel", "_linear_kernel",
               "_rms_norm_kernel"}


def pdl_cases() -> list[Case]:
    """The decode steps' cases whose launches take PDL: an 8B's FP8 layers, fused kernels and attention (short and
    long contexts), and the batch-invariant set's BF16 linears, RMSNorm and attention."""
    sets = case_sets()
    kinds = ("act_quant", "linear", "dense", "rms_norm", "write_kv", "attention", "fused")
    return [c for label in ("llama-7b", "smollm2-135m-bi") for c in sets[label]
            if c.kind in kinds and c.name.rsplit("/", 1)[1] in ("decode", "decode1", "decode_long")]


def compile_pdl(arch: int = 90) -> list[CompiledLaunch]:
    """compile_cases of pdl_cases() with PDL on (sm_90 and later only: griddepcontrol is Hopper's)."""
    from fp8engine.model_executor.kernels import pdl
    with pdl.forced(True):
        return compile_cases(pdl_cases(), arch)


def tma_cases() -> list[Case]:
    """An 8B's FP8 projections at prefill (the GEMMs of more than 64 rows that FP8ENGINE_TMA_GEMM moves to TMA)."""
    return [c for c in case_sets()["llama-7b"] if c.kind == "linear" and c.name.endswith("/prefill")]


def compile_tma(arch: int = 90, with_pdl: bool = False) -> list[CompiledLaunch]:
    """compile_cases of tma_cases() with the GEMM's TMA tiles on (and PDL, with_pdl)."""
    from fp8engine.model_executor.kernels import pdl
    with pdl.TMA_GEMM.forced(True), pdl.forced(with_pdl):
        return compile_cases(tma_cases(), arch)


def swap_cases() -> list[Case]:
    """An 8B's FP8 projections at decode (13 rows: the GEMMs of at most 16 that FP8ENGINE_SWAP_AB_GEMM swaps)."""
    return [c for c in case_sets()["llama-7b"] if c.kind == "linear" and c.name.endswith("/decode")]


def compile_swap(arch: int = 90) -> tuple[list[CompiledLaunch], list[CompiledLaunch]]:
    """compile_cases of swap_cases() with the GEMM's swapped operands on: (PDL off, PDL on)."""
    from fp8engine.model_executor.kernels import pdl
    with pdl.SWAP_AB_GEMM.forced(True):
        plain = compile_cases(swap_cases(), arch)
        with pdl.forced(True):
            return plain, compile_cases(swap_cases(), arch)


def clean_process_pool(workers: int | None = None):
    """Spawned worker processes that import Triton with TRITON_INTERPRET unset.

    A process that imported triton under TRITON_INTERPRET=1 holds triton.language's own @jit helpers
    (tl.zeros, tl.cdiv, ...) as interpreter objects, and one that imported it without holds them as
    JITFunctions, which the interpreter cannot run: the interpreter tests need the first, native compiles the
    second. Compiling in these workers leaves the calling process (a pytest run mixing both) as it was.
    Triton compiles under the GIL, so more workers also use more cores. Default: the CPU count, at most 4."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    workers = workers or min(4, os.cpu_count() or 1)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_without_interpreter)


def compile_all(archs=TARGETS, labels=None, pool=None) -> dict[tuple[str, int], list[CompiledLaunch]]:
    """compile_cases for every case set and arch, in clean worker processes: {(label, arch): compiled}."""
    labels = list(case_sets()) if labels is None else list(labels)
    jobs = [(label, arch) for arch in archs for label in labels]
    own = pool is None
    pool = clean_process_pool() if own else pool
    try:
        # Longest first: the 7B set and the float32 prefill kernels keep ptxas busiest.
        futures = {job: pool.submit(_compile_set, *job) for job in sorted(jobs, key=lambda j: j[0] != "llama-7b")}
        return {job: futures[job].result() for job in jobs}
    finally:
        if own:
            pool.shutdown()


def report_line(compiled: CompiledLaunch) -> str:
    s = compiled.summary()
    blocks = ",".join(f"{k}={v}" for k, v in s["constexprs"].items() if k in ("BLOCK_M", "BLOCK_N", "BLOCK_D"))
    more = f" (+{len(compiled.cases) - 1})" if len(compiled.cases) > 1 else ""
    return (f"sm_{compiled.arch} {compiled.name:26s} {s['instr']:5s} {','.join(s['wgmma'] + s['mma']) or '-':5s} "
            f"regs {s['regs']:3d}  shared {s['shared']:6d}  stack {s['stack']:3d}  stl {s['spill_stores']:2d}  "
            f"warps {s['num_warps']}  {blocks:24s} {compiled.cases[0]}{more}")


# ------------------------------------------------------------------------------------------ PTX checks


_WGMMA = re.compile(r"wgmma\.mma_async\S*?\.(f32|f16)\.(\w+)\.(\w+)\b")
_MMA = re.compile(r"\bmma\.sync\.aligned\.m\d+n\d+k\d+\S*?\.(?:row|col)\.(?:row|col)\.(\w+)\.(\w+)\.(\w+)\.(\w+)\b")


def mma_instructions(ptx: str) -> dict[str, set[str]]:
    """Operand types of the PTX's tensor-core instructions: {"wgmma": {...}, "mma": {...}}."""
    wgmma = {f"{a}x{b}" if a != b else a for _, a, b in _WGMMA.findall(ptx)}
    mma = {f"{a}x{b}" if a != b else a for _, a, b, _ in _MMA.findall(ptx)}
    return {"wgmma": wgmma, "mma": mma}


def instruction_class(ptx: str) -> str:
    """wgmma, mma (mma.sync) or fma: the best matrix instruction the PTX contains."""
    mma = mma_instructions(ptx)
    return "wgmma" if mma["wgmma"] else "mma" if mma["mma"] else "fma"


def assert_matrix_instruction(compiled: CompiledLaunch, instr: str, operand: str) -> None:
    """The kernel's dots run as `instr` (wgmma / mma) on `operand` (e4m3, bf16) operands, and only so."""
    found = compiled.mma
    if operand not in found.get(instr, set()):
        raise AssertionError(f"{compiled.name} sm_{compiled.arch}: expected {instr} with {operand} operands, "
                             f"found wgmma {sorted(found['wgmma'])}, mma {sorted(found['mma'])} "
                             f"({compiled.cases[0]})")
    others = (found["wgmma"] | found["mma"]) - {operand}
    if others:
        raise AssertionError(f"{compiled.name} sm_{compiled.arch}: other tensor-core operands too: {sorted(others)}")


_GLOBAL_ACCESS = re.compile(r"\b(?:ld|st|atom|red|cp\.async)[.\w]*\.global[.\w]*")  # a whole mnemonic


def assert_pdl(compiled: CompiledLaunch, prefetch: bool = False) -> None:
    """Launched with programmatic dependent launch, and its griddepcontrol.wait comes before its first global load
    or store (kernels/pdl.py); prefetch: L2 prefetches of its weights come before the wait."""
    where = f"{compiled.name} sm_{compiled.arch} ({compiled.cases[0]})"
    ptx = compiled.ptx
    wait = ptx.find("griddepcontrol.wait")
    if not compiled.pdl or wait < 0:
        raise AssertionError(f"{where}: launch_pdl {compiled.pdl}, griddepcontrol.wait {'not ' * (wait < 0)}found")
    first = _GLOBAL_ACCESS.search(ptx)
    if first is not None and first.start() < wait:
        raise AssertionError(f"{where}: {first.group(0)} before griddepcontrol.wait")
    fetch = ptx.find("prefetch.global.L2")
    if prefetch and not 0 <= fetch < wait:
        raise AssertionError(f"{where}: no prefetch.global.L2 before griddepcontrol.wait")


def assert_resources(compiled: CompiledLaunch, spills_allowed: bool = False) -> None:
    """Registers within the hardware's 255, shared memory within the arch's per-block limit, no spills."""
    where = f"{compiled.name} sm_{compiled.arch} ({compiled.cases[0]})"
    if compiled.n_regs > MAX_REGS:
        raise AssertionError(f"{where}: {compiled.n_regs} registers")
    if compiled.shared > SHARED_LIMIT[compiled.arch]:
        raise AssertionError(f"{where}: {compiled.shared} B shared > {SHARED_LIMIT[compiled.arch]}")
    if not spills_allowed and (compiled.spill_stores or compiled.spill_loads or compiled.stack_bytes):
        raise AssertionError(f"{where}: spills ({compiled.stack_bytes} B stack, {compiled.spill_stores} "
                             f"stores, {compiled.spill_loads} loads, {compiled.n_regs} registers)")


# Global loads in PTX, with their bytes: ld.global[.nc][.v2|.v4].<type> and cp.async's copy size.
_LD_GLOBAL = re.compile(r"\bld\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfsu](\d+)\s")
_CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global(?:\.\w+)*\s+\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-f]+|\d+)")


def global_loads(ptx: str) -> dict[int, int]:
    """{bytes a thread moves in one instruction: how many such global loads} over the PTX's ld.global and
    cp.async (global -> shared) instructions."""
    found: dict[int, int] = {}
    for vec, bits in _LD_GLOBAL.findall(ptx):
        size = int(vec or 1) * int(bits) // 8
        found[size] = found.get(size, 0) + 1
    for size in _CP_ASYNC.findall(ptx):
        size = int(size, 0)
        found[size] = found.get(size, 0) + 1
    return found


def occupancy(compiled: CompiledLaunch, grid: tuple) -> dict:
    """A launch's residency on its arch's device, from the compiled resources: blocks per SM and what limits them
    (registers, shared memory, warps, blocks), warps resident per SM, the grid's CTAs per SM and its waves."""
    limits = SM_LIMITS[compiled.arch]
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256
    by = {"registers": limits["regs"] // (regs_per_warp * compiled.num_warps),
          "shared": limits["shared"] // (compiled.shared + 1024),
          "warps": limits["warps"] // compiled.num_warps, "blocks": limits["blocks"]}
    limited_by = min(by, key=by.get)
    blocks = by[limited_by]
    ctas = math.prod(grid)
    return {"blocks_per_sm": blocks, "limited_by": limited_by, "warps_per_sm": blocks * compiled.num_warps,
            "ctas": ctas, "ctas_per_sm": ctas / limits["sms"],
            "waves": -(-ctas // (blocks * limits["sms"])) if blocks else math.inf}


def occupancy_rows(compiled: list[CompiledLaunch], steps: tuple[str, ...] = ("decode", "decode_long")) -> list[dict]:
    """One row a launch of the cases ending in `steps`: kernel, case, grid, resources, global loads by width
    (global_loads) and occupancy."""
    rows = []
    for c in compiled:
        loads = global_loads(c.ptx)
        for case, grid in c.grids:
            if case.rsplit("/", 1)[1] in steps:
                rows.append({"case": case, "kernel": c.name, "grid": grid, "num_warps": c.num_warps, "regs": c.n_regs,
                             "shared": c.shared, "loads": loads, **occupancy(c, grid)})
    return sorted(rows, key=lambda r: (r["case"], r["kernel"]))


def occupancy_table(rows: list[dict]) -> str:
    """occupancy_rows as a markdown table."""
    lines = ["| case | kernel | grid | warps | regs | shared B | global loads (B x count) | blocks / SM (limit) "
             "| CTAs / SM |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        loads = " ".join(f"{size}x{n}" for size, n in sorted(r["loads"].items(), reverse=True))
        lines.append(f"| {r['case'].split('/', 1)[1]} | {r['kernel']} | {'x'.join(map(str, r['grid']))} | "
                     f"{r['num_warps']} | {r['regs']} | {r['shared']} | {loads} | {r['blocks_per_sm']} "
                     f"({r['limited_by']}) | {r['ctas_per_sm']:.2f} |")
    return "\n".join(lines) + "\n"


def _occupancy_report(arch: int) -> str:
    return occupancy_table(occupancy_rows(compile_cases(case_sets()["llama-7b"], arch)))


# Native conversions in PTX. The interpreter-only branches replace them by integer arithmetic.
NATIVE_CVT = {
    "f32->e4m3": re.compile(r"cvt\.rn\.satfinite\.e4m3x2\.f32"),
    "e4m3->f16": re.compile(r"cvt\.rn\.f16x2\.e4m3x2"),
    "f32->bf16": re.compile(r"cvt\.rn\.(?:satfinite\.)?bf16(?:x2)?\.f32"),
}


def assert_native_cvt(compiled: CompiledLaunch, *conversions: str) -> None:
    """The PTX converts with the hardware instructions (the native branch), not integer encoders."""
    missing = [c for c in conversions if not NATIVE_CVT[c].search(compiled.ptx)]
    if missing:
        raise AssertionError(f"{compiled.name} sm_{compiled.arch}: no native {', '.join(missing)} conversion "
                             f"({compiled.cases[0]})")


if __name__ == "__main__":  # python -m tests.triton_launch: the 8B decode launches' occupancy table (docs/gpu.md)
    with clean_process_pool(1) as pool:
        print(pool.submit(_occupancy_report, int(sys.argv[1]) if len(sys.argv) > 1 else 90).result(), end="")
