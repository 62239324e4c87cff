"""Programmatic dependent launch (PDL) of the decode path's Triton kernels (issue 64, item 4), Hopper and later.

A kernel launched with PDL may start while the kernel before it in the stream is still finishing, instead of after
it has ended and the launch latency has passed. For that to be safe each such kernel takes `PDL=True` and makes
`griddepcontrol.wait` (fp8_triton._pdl_wait: until the kernel before has completed and its writes are visible) its
first access to memory, so it never reads what the one before still writes nor writes what it still reads. Before
the wait a GEMM fetches the first K blocks of its weight rows into L2 (fp8_triton._prefetch_l2): weights change only
between steps, never inside one. No kernel signals its dependents early (griddepcontrol.launch_dependents): the next
one is released as the last program of this one ends, so a kernel's waiting programs never hold an SM that its own
later programs need. A kernel that does not take PDL (torch's, cuBLAS's) keeps the stream's full ordering.

Which kernels: the fused decoder-layer kernels (norm_quant, qkv_epilogue, silu_mul_quant), the activation quant and
FP8 GEMM, paged attention with its combine and the KV write, and the batch-invariant BF16 linear and RMSNorm.

`FP8ENGINE_PDL=1` turns it on for CUDA engines on sm_90 and later (process-wide: the CUDA kernel set calls
`configure` when an engine starts); it is off by default until a device run has checked it (benchmarks/gpu_perf.py
and `make gpu-check` run it on and off), and always off under the Triton interpreter, which has no griddepcontrol.
This module holds only the switch (no Triton): the kernel modules read it at each launch (`launch_options`). It also
holds the same kind of switch for the FP8 GEMM's TMA tiles (`TMA_GEMM`: FP8ENGINE_TMA_GEMM, kernels/fp8_triton.py) and
for its swapped operands at decode sizes (`SWAP_AB_GEMM`: FP8ENGINE_SWAP_AB_GEMM).
"""

import contextlib
from collections.abc import Iterator

import torch

from fp8engine import envs

_OPTIONS = {"PDL": True, "launch_pdl": True}  # the kernels' constexpr, and Triton's launch option


class Switch:
    """A process-wide switch of a Hopper code path, off until a device run has checked it: `on` where its FP8ENGINE_*
    flag is 1, the device is sm_90 or later and Triton compiles natively (`configure`, when a CUDA engine starts)."""

    def __init__(self, env: str):
        self.env, self.on = env, False

    def configure(self, device: torch.device) -> bool:
        import triton
        self.on = (envs.flag(self.env) and not triton.knobs.runtime.interpret
                   and torch.cuda.get_device_capability(device)[0] >= 9)
        return self.on

    @contextlib.contextmanager
    def forced(self, on: bool) -> Iterator[None]:
        """On or off within the block, whatever the device (the compile tests capture launches on meta tensors, the
        interpreter tests run them on the CPU)."""
        saved, self.on = self.on, on
        try:
            yield
        finally:
            self.on = saved


PDL = Switch("FP8ENGINE_PDL")
TMA_GEMM = Switch("FP8ENGINE_TMA_GEMM")  # GEMMs of more than 64 rows copy their tiles with TMA (fp8_triton.py)
SWAP_AB_GEMM = Switch("FP8ENGINE_SWAP_AB_GEMM")  # GEMMs of at most 16 rows with the weights as wgmma's 64-row side
configure, forced = PDL.configure, PDL.forced


def launch_options() -> dict:
    """The keyword arguments that launch a PDL kernel with it (none while it is off)."""
    return _OPTIONS if PDL.on else {}
