"""The Triton kernels of EngineConfig(batch_invariant=True) on the interpreter: a row's result is bitwise the
same alone, at any position of any batch, and (attention) whether its query comes in a prefill chunk or as a
decode step. test_triton_compile.py checks the native side: one binary per kernel for every batch size.
"""

import os

# The interpreter is chosen when the kernels are decorated, so this must precede importing triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from attention_batches import Q_SCALE, make_batch  # noqa: E402
from fp8engine.model_executor.kernels import attention_triton as at  # noqa: E402
from fp8engine.model_executor.kernels import dense_triton as dt  # noqa: E402
from fp8engine.model_executor.kernels import fp8_triton as ft  # noqa: E402
from fp8engine.model_executor.kernels.attention_ref import FP8_DTYPE  # noqa: E402
from fp8engine.model_executor.layers.norm import RMSNorm  # noqa: E402
from fp8engine.weights import quant  # noqa: E402
from tests.conftest import cpu_kernels  # noqa: E402

# Rows: alone, a few, more than one 64-row tile; the probe rows land at other tile positions in each.
BATCHES = (1, 5, 70)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


def _assert_rows_invariant(fn, x: torch.Tensor) -> torch.Tensor:
    """fn's rows for the first rows of x, computed in batches of each size in BATCHES with the probe rows
    placed last: bitwise equal to fn over all of x. Returns fn(x)."""
    full = fn(x)
    for size in BATCHES:
        for row in range(min(3, x.shape[0])):
            others = torch.cat([x[:row], x[row + 1:]])[:size - 1]
            got = fn(torch.cat([others, x[row:row + 1]]))[-1]
            assert torch.equal(_bits(got), _bits(full[row])), f"row {row} in a batch of {size}"
    return full


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["bf16", "fp32-logits"])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear(out_dtype, bias):
    x, w = _x(80, 200, 1), (_x(150, 200, 2) * 0.05).to(torch.bfloat16)
    b = _x(1, 150, 3)[0] if bias else None
    got = _assert_rows_invariant(lambda rows: dt.linear_triton(rows, w, b, out_dtype=out_dtype), x)
    want = x.float() @ w.float().T + (b.float() if bias else 0)
    assert got.dtype == (out_dtype or torch.bfloat16)
    if out_dtype is None:  # one bf16 rounding apart at most
        torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-6)
    else:  # float32 sums in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_linear():
    x, w = _x(80, 576, 4), (_x(200, 576, 5) * 0.05).to(torch.bfloat16)
    w_q, w_s = quant.quantize_weight_blockwise(w)

    def fp8(rows):
        return ft.fp8_block_linear_triton(rows, w_q, w_s, batch_invariant=True)
    got = _assert_rows_invariant(fp8, x)
    want = quant.fp8_block_linear_ref(x, w_q, w_s, None)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-3)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(residual):
    x, r = _x(80, 576, 6), _x(80, 576, 7)
    norm = RMSNorm(576, 1e-5, torch.bfloat16, cpu_kernels())
    norm.weight.data = (1 + 0.1 * _x(1, 576, 8)[0].float()).to(torch.bfloat16)
    r = r if residual else None

    def run(rows):
        extra = None if r is None else torch.cat([r[:0], r])[:rows.shape[0]]
        return dt.rms_norm_triton(rows, extra, norm.weight, norm.eps)[0]
    if r is None:
        got = _assert_rows_invariant(run, x)
        want, _ = norm(x)
    else:  # the residual rows travel with their x rows
        both = torch.cat([x, r], dim=1)
        got = _assert_rows_invariant(lambda rows: dt.rms_norm_triton(rows[:, :576], rows[:, 576:], norm.weight,
                                                                     norm.eps)[0], both)
        want, summed = norm(x, r)
        _, got_sum = dt.rms_norm_triton(x, r, norm.weight, norm.eps)
        assert torch.equal(_bits(got_sum), _bits(summed))  # x + residual rounded to bf16, as torch adds
    # 1 / sqrt against torch's rsqrt: a bf16 ulp apart where the product sits on a rounding boundary.
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_add(dtype):
    """A fused layer's adapter (three shards; ranks 5, 8 of 8 and none): rows independent of their batch, the
    reference's sums up to order, and nothing read outside the segments (NaN there changes nothing)."""
    from fp8engine.model_executor.kernels.layer_ops_ref import lora_add_ref
    g = torch.Generator().manual_seed(9)
    k, r, n = 200, 24, 150
    segments = torch.tensor([[0, 5, 0, 64], [8, 16, 64, 107], [16, 16, 107, 150]])
    x, a, bt, y = (torch.randn(*shape, generator=g).to(dtype) for shape in ((80, k), (r, k), (r, n), (80, n)))
    inside = torch.zeros(r, n, dtype=torch.bool)
    for j0, j1, o0, o1 in segments.tolist():
        inside[j0:j1, o0:o1] = True
    nan = torch.tensor(float("nan"), dtype=dtype)
    a_nan, bt_nan = torch.where(inside.any(1, keepdim=True), a, nan), torch.where(inside, bt, nan)
    both = torch.cat([x, y], dim=1)  # y's rows travel with their x rows

    def run(rows):
        return dt.lora_add_triton(rows[:, k:].contiguous(), rows[:, :k], a_nan, bt_nan, segments)
    got = _assert_rows_invariant(run, both)
    zero = torch.zeros((), dtype=dtype)
    want = lora_add_ref(y.clone(), x, torch.where(a_nan.isnan(), zero, a), torch.where(bt_nan.isnan(), zero, bt))
    assert got.dtype == dtype and not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # one rounding of float32 sums that differ in order only
        tol = want.float().abs() * 2 ** -7 + 1e-4 * want.float().abs().max()
        assert ((got.float() - want.float()).abs() <= tol).all()
    assert torch.equal(got[:, 107:], y[:, 107:])  # the shard without an adapter: untouched


SEQS = [(40, 1), (57, 20), (33, 1), (90, 30)]  # (context incl. new tokens, new tokens): decodes and chunks
PROBE = 1  # the sequence whose rows are recomputed alone, as a decode step and as another chunk


def _sub_batch(batch: dict, picks: list[tuple[int, int, int]], seqs: list[tuple[int, int]] = SEQS) -> dict:
    """The same cache, other query rows: (sequence, its context length, new tokens) per picked sequence."""
    starts = batch["query_start_loc"].tolist()
    qs, tables, lens, qsl = [], [], [], [0]
    for seq, seq_len, new in picks:
        end = starts[seq + 1] - (seqs[seq][0] - seq_len)
        qs.append(batch["q"][end - new:end])
        tables.append(batch["block_tables"][seq])
        lens.append(seq_len)
        qsl.append(qsl[-1] + new)
    return dict(batch, q=torch.cat(qs), block_tables=torch.stack(tables),
                seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=torch.tensor(qsl, dtype=torch.int32))


def _attend(batch: dict, full_fp8: bool) -> torch.Tensor:
    return at.paged_attention_triton(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"],
                                     batch["query_start_loc"], batch["seq_lens"], batch["scale"],
                                     batch["k_scale"], batch["v_scale"], Q_SCALE if full_fp8 else None,
                                     batch_invariant=True)


@pytest.mark.parametrize("kv", ["bf16", "fp8", "full-fp8"])
def test_attention_rows_do_not_depend_on_the_batch_or_the_chunking(kv):
    cache_dtype = torch.bfloat16 if kv == "bf16" else FP8_DTYPE
    batch = make_batch(SEQS, 9, 3, 64, 16, cache_dtype, q_dtype=torch.bfloat16, seed=11)
    full_fp8 = kv == "full-fp8"
    everything = _attend(batch, full_fp8)
    start = batch["query_start_loc"][PROBE].item()
    seq_len, new = SEQS[PROBE]
    probe = everything[start:start + new]
    # Alone, the whole chunk.
    alone = _attend(_sub_batch(batch, [(PROBE, seq_len, new)]), full_fp8)
    assert torch.equal(_bits(alone), _bits(probe))
    # Its last 7 tokens as their own chunk, next to another sequence's decode.
    chunk = _attend(_sub_batch(batch, [(2, 33, 1), (PROBE, seq_len, 7)]), full_fp8)[1:]
    assert torch.equal(_bits(chunk), _bits(probe[-7:]))
    # Its 5th token as a decode step (the context up to it), alone and among decodes.
    decode = _attend(_sub_batch(batch, [(0, 40, 1), (PROBE, seq_len - new + 5, 1), (2, 33, 1)]), full_fp8)[1]
    assert torch.equal(_bits(decode), _bits(probe[4]))
    alone_decode = _attend(_sub_batch(batch, [(PROBE, seq_len - new + 5, 1)]), full_fp8)[0]
    assert torch.equal(_bits(alone_decode), _bits(probe[4]))


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_long_contexts_fold_the_same_runs_whether_the_decode_splits_or_not(kv, monkeypatch):
    """Contexts over SPLIT_KEYS keys (64 here: 2-3 runs): a prefill chunk folds its runs in registers, a decode
    step that leaves SMs idle splits them over programs and the combine folds them, a decode among many sequences
    walks them in one program. All three give a row the same bits, and the reference's values."""
    from fp8engine.model_executor.kernels.attention_ref import paged_attention_ref
    monkeypatch.setattr(at, "SPLIT_KEYS", 64)
    seqs = [(150, 1), (170, 40), (90, 1)]
    batch = make_batch(seqs, 4, 2, 64, 16, torch.bfloat16 if kv == "bf16" else FP8_DTYPE, q_dtype=torch.bfloat16,
                       seed=5)
    everything = _attend(batch, False)
    args = [batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens", "scale",
                               "k_scale", "v_scale")]
    want = paged_attention_ref(*args).float()
    assert ((everything.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-3).all()
    probe = everything[1:41]  # sequence 1's chunk: its rows see 131..170 keys, 3 runs each
    assert at.decode_splits(3, 2, batch["block_tables"].shape[1] * 16) == 4
    for token in (0, 2, 39):  # 131, 133 and 170 keys: the third run holds 3, 5 and 42 of them
        picks = [(0, 150, 1), (1, 131 + token, 1), (2, 90, 1)]
        split = _attend(_sub_batch(batch, picks, seqs), False)[1]
        assert torch.equal(_bits(split), _bits(probe[token])), token
        with monkeypatch.context() as busy:  # as many sequences as fill the device: one program walks all runs
            busy.setattr(at, "SPLIT_TARGET_PROGRAMS", 1)
            unsplit = _attend(_sub_batch(batch, picks, seqs), False)[1]
        assert torch.equal(_bits(unsplit), _bits(probe[token])), token
    assert torch.equal(_bits(_attend(_sub_batch(batch, [(0, 150, 1)], seqs), False)[0]), _bits(everything[0]))


def test_gdn_recurrent_kernel_matches_the_reference_and_is_bitwise_however_split():
    """dense_triton's gated delta rule on the interpreter: within float32 rounding of the torch reference; a
    sequence's outputs and state bit for bit alone vs in a batch, in any slot, and split into calls."""
    from fp8engine.model_executor.kernels.gated_delta_ref import kernel_inputs, recurrent_gated_delta_ref
    gen = torch.Generator().manual_seed(0)
    lens, hk, hv, dk, dv = [5, 1, 9], 2, 4, 16, 32
    t = sum(lens)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v, g = torch.randn(t, hv, dv, generator=gen), -torch.rand(t, hv, generator=gen) * 2
    beta, states = torch.rand(t, hv, generator=gen), torch.randn(3, hv, dk, dv, generator=gen) * 0.1
    ref_out, ref_states = recurrent_gated_delta_ref(q, k, v, g, beta, states, lens)

    def run(rows, pool, slots, seq_lens):
        inputs = kernel_inputs(q[rows], k[rows], v[rows], g[rows], beta[rows])
        return dt.gdn_recurrent_triton(*inputs, pool, torch.tensor(slots), torch.tensor([0, *seq_lens]).cumsum(0))

    pool = torch.zeros(4, hv, dk, dv)
    pool[[2, 0, 3]] = states
    out = run(slice(0, t), pool, [2, 0, 3], lens)
    assert (out - ref_out).abs().max() < 1e-5 and (pool[[2, 0, 3]] - ref_states).abs().max() < 1e-5
    alone = states[2:].clone()
    split = torch.cat([run(slice(6, 10), alone, [0], [4]), run(slice(10, 15), alone, [0], [5])])
    assert torch.equal(split, out[6:]) and torch.equal(alone[0], pool[3])
