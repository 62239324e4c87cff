"""Helpers that write variant Hugging Face checkpoints for weight-update tests."""

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from fp8engine.weights.loader import iter_safetensors


def perturbed_state(model_dir: str, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with seeded relative noise on every weight matrix and norm."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in iter_safetensors(model_dir):
        noise = torch.randn(tensor.shape, generator=gen) * tensor.float().std() * scale
        state[name] = (tensor.float() + noise).to(tensor.dtype)
    return state


def write_checkpoint(src_dir: str, out_dir: Path, state: dict[str, torch.Tensor]) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(src_dir).iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return str(out_dir)


def prequantized_items(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The state as an FP8 checkpoint holds it: every projection weight as E4M3 blocks plus its
    `_scale_inv`, everything else as is."""
    from fp8engine.weights.quant import quantize_weight_blockwise
    items = []
    for name, tensor in state.items():
        if name.endswith("proj.weight"):
            q, s = quantize_weight_blockwise(tensor)
            items += [(name, q), (name + "_scale_inv", s)]
        else:
            items.append((name, tensor))
    return items
