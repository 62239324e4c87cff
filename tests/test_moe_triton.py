"""The fused-MoE Triton kernel on the Triton CPU interpreter against the torch reference (kernels/moe_ref.py):
bf16 / float32 experts and FP8 block-quantized ones, gate/up shards on and off the 128-row scale grid."""

import os

# The interpreter is chosen when the kernels are decorated, so this must precede importing triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from fp8engine.model_executor.kernels import moe_triton as mt  # noqa: E402
from fp8engine.model_executor.kernels.moe_ref import fused_moe_ref  # noqa: E402
from fp8engine.model_executor.layers.moe import FusedMoE, route  # noqa: E402
from tests.tiny_models import load_random_experts  # noqa: E402

E, H, T, K = 4, 256, 11, 2


def experts(inter: int, dtype: torch.dtype, fp8: bool) -> FusedMoE:
    """Random experts in the engine's stacked layout (the layer's kernels are never called here)."""
    layer = FusedMoE(E, H, inter, dtype, None, fp8)
    load_random_experts(layer, seed=inter)
    return layer


def inputs(dtype: torch.dtype, tokens: int = T):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    ids, weights = route(torch.randn(tokens, E, generator=gen).to(dtype), K, normalize=True)
    return x, ids, weights


def test_align_rows_gives_every_row_once_and_one_expert_per_tile():
    """A fixed tile count for the row count (ceil(9 / 4) + 4 = 7, nothing read back for a CUDA graph), the tiles
    past the last expert's marked -1 and empty; experts without rows get no tile."""
    flat = torch.tensor([3, 0, 3, 1, 3, 3, 0, 2, 3])
    rows, tile_expert = mt.align_rows(flat, E, 4)
    assert len(rows) == 4 * len(tile_expert) and tile_expert.tolist() == [0, 1, 2, 3, 3, -1, -1]
    real = rows[rows < len(flat)]
    assert sorted(real.tolist()) == list(range(len(flat)))
    tiles = rows.view(-1, 4)
    for tile, e in zip(tiles, tile_expert):
        assert all(flat[r] == e for r in tile.tolist() if r < len(flat))
    assert (tiles[5:] == len(flat)).all()
    rows, tile_expert = mt.align_rows(torch.tensor([2, 2]), E, 4)
    assert tile_expert.tolist() == [2, -1, -1] and rows[:4].tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize("inter", [64, 128])  # gate / up shards off and on the 128-row scale grid
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                                       (torch.bfloat16, True)])
def test_fused_moe_matches_the_reference(inter, dtype, fp8):
    layer = experts(inter, dtype, fp8)
    scales = (layer.gate_up_proj_scale_inv, layer.down_proj_scale_inv, layer.scale_rows) if fp8 else ()
    x, ids, weights = inputs(dtype)
    got = mt.fused_moe_triton(x, ids, weights, layer.gate_up_proj, layer.down_proj, *scales)
    want = fused_moe_ref(x, ids, weights, layer.gate_up_proj, layer.down_proj, *scales)
    assert got.shape == (T, H) and got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("fp8", [False, True])
def test_batch_invariant_rows_do_not_depend_on_the_batch(fp8):
    layer = experts(128, torch.float32, fp8)
    scales = (layer.gate_up_proj_scale_inv, layer.down_proj_scale_inv, layer.scale_rows) if fp8 else ()
    x, ids, weights = inputs(torch.float32, tokens=24)
    full = mt.fused_moe_triton(x, ids, weights, layer.gate_up_proj, layer.down_proj, *scales, batch_invariant=True)
    for rows in (slice(0, 1), slice(3, 9)):
        part = mt.fused_moe_triton(x[rows], ids[rows], weights[rows], layer.gate_up_proj, layer.down_proj, *scales,
                                   batch_invariant=True)
        assert torch.equal(part, full[rows])
