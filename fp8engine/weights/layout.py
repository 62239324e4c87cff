"""The nt16 layout: how a CPU engine on the AVX-512 BF16 kernels (and a batch-invariant one on AMX tiles) stores its
linears' weights.

The small-batch linears put 16 weight rows in the lanes of a vector and walk K one bf16 pair at a time
(csrc/linear_common.h, "nt"); batch invariance takes them at every M up to 64. Read from rows, every K block of
16 rows needs a transposition, which cost a batch-1 decode step a quarter of its time. In the nt16 layout each whole
group of 16 rows of a [N, K] weight is stored as K / 4 lines of 64 bytes, line c holding columns 4c .. 4c+3 of the
16 rows in the order the kernel's E4M3 -> bf16 conversion turns into pair 2c and pair 2c+1 of rows 0..15 (byte
16 L + 8 h + 2 i + b of line c is row 4 L + i, column 4 c + 2 h + b): the transposition is gone, and the group occupies
the same 16 K bytes it did as rows. Rows past the last whole group stay rows, and so does a whole weight whose K is
not a multiple of 4 (the kernels treat it as rows too). Only the codes move; scale grids are unchanged.

A BF16 weight (a BF16 linear's, the LM head's; csrc/bf16_linear.cpp) has the same layout one level simpler: line
q of a group is bf16 pair q (columns 2q, 2q+1) of its 16 rows, row r in 32-bit lane r, which the kernel feeds to
its dot products as it loads them (K even; a tied embedding looks its rows up with `embedding`).

On AMX tiles the same lines are the tiles' B operand as they lie (csrc/bf16_linear.cpp; FP8 lines convert straight
into them), and at a few rows the nt kernels reproduce the tiles' summation order (csrc/linear_common.h), so a
batch-invariant engine there stores its weights in the layout too; a plain one keeps rows for the gemv at 1-2 rows.

Plain engines on the AVX-512 kernels store their weights so too (model_executor/kernel_set.py): nt16 weights never take the gemv, which
reads rows, and nt reads them as fast at 1-4 rows and faster from 4 on (docs/exact-rollouts.md). A parameter in
the layout is marked (`mark`, model_executor/model_runner.py, as the kernel set says). The loader's
targets name the matrix a linear reads (the layer's weight, one expert of a stacked tensor, a 2-D parameter) and
their rows in it: writers take those rows back to rows around their write (`as_rows`), readers read a row-major
copy (`rows_of`), so that loads, weight updates and `get_weights_by_name` see rows as everywhere else.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

GROUP = 16
_MARK = "fp8_nt16"


def mark(param: torch.Tensor) -> None:
    """Declare that `param` (a weight [N, K], or stacked [E, N, K]: each expert's matrix) is in the nt16 layout."""
    setattr(param, _MARK, True)


def is_marked(t: torch.Tensor) -> bool:
    """Whether `t` is a marked weight or a view of one."""
    root = t if t._base is None else t._base
    return bool(getattr(root, _MARK, False))


def applies(matrix: torch.Tensor) -> bool:
    """Whether a weight of this shape and dtype is stored in the layout (else as rows): E4M3 with K a multiple of
    4, bf16 with K even."""
    return matrix.shape[-1] % (4 if matrix.element_size() == 1 else 2) == 0


def _permute_groups(matrix: torch.Tensor, g0: int, g1: int, to_nt16: bool) -> None:
    """Groups g0..g1 of a [N, K] matrix (in place) from rows into the layout, or back: with the C++ op
    (csrc/layout.cpp: a group's worth of buffer a thread, ~3x faster) where the extension is loaded, else in torch
    (`_permute_groups_torch`, which clones the span it moves)."""
    if g1 <= g0:
        return
    if matrix.is_contiguous() and matrix.device.type == "cpu" and _has_op():
        torch.ops.fp8engine.nt16_permute_(matrix, g0, g1, to_nt16)
        return
    _permute_groups_torch(matrix, g0, g1, to_nt16)


def _has_op() -> bool:
    return hasattr(torch.ops.fp8engine, "nt16_permute_")


def _permute_groups_torch(matrix: torch.Tensor, g0: int, g1: int, to_nt16: bool) -> None:
    n, k = g1 - g0, matrix.shape[1]
    rows = matrix[g0 * GROUP:g1 * GROUP]
    if matrix.element_size() == 2:  # bf16: line q of a group is pair q of its 16 rows, [g, r, q] -> [g, q, r]
        block = rows.view(torch.int32)
        shape = (n, GROUP, k // 2) if to_nt16 else (n, k // 2, GROUP)
        moved = block.view(shape).transpose(1, 2).clone(memory_format=torch.contiguous_format)
        block.copy_(moved.view(n * GROUP, k // 2))
        return
    block = rows.view(torch.int16)  # E4M3 bytes b stay in pairs: moved as 16-bit elements (3x faster than bytes)
    if to_nt16:  # [g, L, i, c, h, (b)] -> [g, c, L, h, i, (b)]
        moved = block.view(n, 4, 4, k // 4, 2).permute(0, 3, 1, 4, 2)
    else:  # [g, c, L, h, i, (b)] -> [g, L, i, c, h, (b)]
        moved = block.view(n, k // 4, 4, 2, 4).permute(0, 2, 4, 1, 3)
    block.copy_(moved.clone(memory_format=torch.contiguous_format).view(n * GROUP, k // 2))


def _groups(matrix: torch.Tensor, row0: int, rows: int) -> tuple[int, int]:
    """The whole groups of the matrix that rows row0 .. row0 + rows touch."""
    return row0 // GROUP, min((row0 + rows + GROUP - 1) // GROUP, matrix.shape[0] // GROUP)


def _in_layout(matrix: torch.Tensor | None) -> bool:
    return matrix is not None and is_marked(matrix) and applies(matrix)


def to_nt16_(matrix: torch.Tensor) -> torch.Tensor:
    """A row-major [N, K] matrix into the layout, in place (returns it)."""
    if applies(matrix):
        _permute_groups(matrix, 0, matrix.shape[0] // GROUP, True)
    return matrix


@contextmanager
def as_rows(matrix: torch.Tensor | None, row0: int, rows: int) -> Iterator[None]:
    """Rows row0 .. row0 + rows of a [N, K] matrix that a linear reads (and the rows they share groups with) as
    rows for the duration, in the layout again after: write them inside. A no-op unless the matrix is a marked
    weight (or a view of one, an expert of a stacked tensor) in the layout. Rows that are whole groups are not
    taken back first (the write replaces every byte of them: the loader writes validated tensors whole), which
    halves an update's permuting."""
    if not _in_layout(matrix):
        yield
        return
    g0, g1 = _groups(matrix, row0, rows)
    if row0 % GROUP or row0 + rows < g1 * GROUP:
        _permute_groups(matrix, g0, g1, False)
    try:
        yield
    finally:
        _permute_groups(matrix, g0, g1, True)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, weight) for a weight in the layout (a tied LM head's): each row gathered from its group's
    lines, rows past the groups read as rows."""
    if not _in_layout(weight):
        return torch.nn.functional.embedding(ids, weight)
    n, k = weight.shape
    groups = n // GROUP
    flat = ids.reshape(-1)
    out = torch.empty(flat.shape[0], k, dtype=weight.dtype, device=weight.device)
    lines = weight[:groups * GROUP].view(torch.int32).view(groups, k // 2, GROUP)
    inside = flat < groups * GROUP
    picked = flat[inside]
    out[inside] = lines[picked // GROUP, :, picked % GROUP].view(weight.dtype)
    if not bool(inside.all()):
        out[~inside] = weight[flat[~inside]]
    return out.view(*ids.shape, k)


def rows_of(matrix: torch.Tensor, row0: int, rows: int) -> torch.Tensor:
    """Rows row0 .. row0 + rows of a [N, K] matrix as rows: a copy for a marked weight in the layout, a view
    otherwise."""
    if not _in_layout(matrix):
        return matrix[row0:row0 + rows]
    g0, g1 = _groups(matrix, row0, rows)
    span = matrix[g0 * GROUP:max(g1 * GROUP, row0 + rows)].clone()
    _permute_groups(span, 0, g1 - g0, False)
    start = row0 - g0 * GROUP
    return span[start:start + rows]
