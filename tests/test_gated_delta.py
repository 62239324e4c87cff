"""The Gated DeltaNet reference (kernels/gated_delta_ref.py, layers/gated_delta.py) against transformers' GDN layers
of tiny random Qwen3.5, Qwen3.5-MoE and Qwen3-Next configs (float32, prefill and decode from HF's cache), and the
properties exact rollouts need: the recurrent form bit for bit however tokens are split into calls or batched, the
chunked form bit for bit for splits on its grid.

Measured: our layer vs HF in float32 within 2.9e-6 on outputs up to ~4.7 (prefill, both forms, all three models);
recurrent vs chunked within 2.3e-6 over 150 tokens (states 1.6e-7). The file runs in ~4 s on one thread."""

import pytest
import torch
from torch.nn import functional as F
from transformers import (
    DynamicCache,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from fp8engine.model_executor.kernels.gated_delta_ref import (
    chunked_gated_delta_ref,
    recurrent_gated_delta_ref,
    sigmoid,
    silu,
    softplus,
)
from fp8engine.model_executor.layers.gated_delta import (
    GatedDeltaState,
    GatedDeltaWeights,
    gated_delta_layer,
    weights_from_hf,
)

C = 16  # chunk length in these tests: divides a block of 16 or more
HIDDEN = 32
TINY = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "intermediate_size": 64, "vocab_size": 64}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}
ARCHS = {
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet, {}),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeGatedDeltaNet, MOE),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextGatedDeltaNet, MOE),
}
TOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_layer(arch: str):
    """(HF's GDN layer of a tiny random config, its config): every parameter drawn, decays that remember over
    tens of tokens."""
    config_cls, layer_cls, extra = ARCHS[arch]
    config = config_cls(**TINY, **extra)
    torch.manual_seed(0)
    layer = layer_cls(config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.A_log.uniform_(-3, 0.5)
    return layer, config


def random_weights(hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 8, k: int = 4) -> GatedDeltaWeights:
    """Random weights whose projections run row by row, as the engine's batch-invariant linears: a row's bits do
    not depend on how many rows share the call."""
    conv_dim = 2 * hk * dk + hv * dv
    def rowwise(n_out, n_in):
        w = torch.randn(n_out, n_in) * n_in ** -0.5
        return lambda x: torch.cat([F.linear(row[None], w) for row in x])
    return GatedDeltaWeights(rowwise(conv_dim, HIDDEN), rowwise(hv * dv, HIDDEN), rowwise(hv, HIDDEN),
                             rowwise(hv, HIDDEN), rowwise(HIDDEN, hv * dv), torch.randn(conv_dim, k) * 0.5,
                             torch.randn(hv) * 0.5, torch.empty(hv).uniform_(-3, 0.5), 1 + 0.1 * torch.randn(dv),
                             hk, hv, dk, dv, 1e-6)


def run(w, x, state, mode, pieces=None):
    """The layer over x [T, hidden] of one sequence in calls of the given lengths (one call by default)."""
    outs = []
    for part in x.split(pieces or [x.shape[0]]):
        out, (state,) = gated_delta_layer(part, w, [state], [part.shape[0]], mode, C)
        outs.append(out)
    return torch.cat(outs), state


def assert_bitwise(a: tuple[torch.Tensor, GatedDeltaState], b: tuple[torch.Tensor, GatedDeltaState]):
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1].recurrent, b[1].recurrent) and torch.equal(a[1].conv, b[1].conv)
    assert a[1].num_tokens == b[1].num_tokens


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.no_grad()
def test_prefill_and_decode_match_hf(arch):
    layer, config = hf_layer(arch)
    w = weights_from_hf(layer)
    for length in (5, 37, 70):
        x = torch.randn(1, length + 3, HIDDEN)
        cache = DynamicCache(config=config)
        ref = layer(x[:, :length], cache=cache)[0]
        hf_state = cache.layers[0]
        for mode in ("recurrent", "chunked"):
            out, state = run(w, x[0, :length], w.new_state(), mode)
            torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
            torch.testing.assert_close(state.recurrent, hf_state.recurrent_states[0][0], rtol=TOL, atol=TOL)
            assert torch.equal(state.conv, hf_state.conv_states[0][0][:, 1:])
        # decode from HF's own state, converted: HF keeps K conv inputs, we keep the K-1 the next token needs
        state = GatedDeltaState(hf_state.conv_states[0][0][:, 1:].clone(), hf_state.recurrent_states[0][0].clone(),
                                length)
        for i in range(length, length + 3):
            ref = layer(x[:, i:i + 1], cache=cache)[0]
            out, (state,) = gated_delta_layer(x[0, i:i + 1], w, [state], [1], "recurrent", C)
            torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
        torch.testing.assert_close(state.recurrent, hf_state.recurrent_states[0][0], rtol=TOL, atol=TOL)


@torch.no_grad()
def test_recurrent_and_chunked_close():
    w = random_weights()
    x = torch.randn(150, HIDDEN)
    _, start = run(w, torch.randn(9, HIDDEN), w.new_state(), "recurrent")  # off the grid, nonzero state
    rec, rec_state = run(w, x, start, "recurrent")
    chk, chk_state = run(w, x, start, "chunked")
    torch.testing.assert_close(chk, rec, rtol=TOL, atol=TOL)
    torch.testing.assert_close(chk_state.recurrent, rec_state.recurrent, rtol=TOL, atol=TOL)
    assert torch.equal(chk_state.conv, rec_state.conv) and chk_state.num_tokens == rec_state.num_tokens == 159


@torch.no_grad()
def test_recurrent_is_bitwise_however_split():
    w = random_weights()
    x = torch.randn(40, HIDDEN)
    whole = run(w, x, w.new_state(), "recurrent")
    assert_bitwise(run(w, x, w.new_state(), "recurrent", [1] * 40), whole)
    assert_bitwise(run(w, x, w.new_state(), "recurrent", [3, 17, 1, 19]), whole)


@torch.no_grad()
def test_chunked_split_on_grid_is_bitwise():
    """Prefill in pieces at grid boundaries, then decode, gives the bits of one prefill call then decode; and a
    call that starts off the grid (a prefill after decode steps) runs its tokens up to the grid as decode steps."""
    w = random_weights()
    x = torch.randn(75, HIDDEN)
    decode = [1] * 5
    whole = run(w, x, w.new_state(), "chunked", [70] + decode)
    assert_bitwise(run(w, x, w.new_state(), "chunked", [16, 32, 22] + decode), whole)
    assert_bitwise(run(w, x, w.new_state(), "chunked", [48, 22] + decode), whole)
    off_grid = run(w, x, w.new_state(), "chunked", [20, 1, 1, 1, 1, 51])
    by_steps = run(w, x, w.new_state(), "chunked", [20] + [1] * 12 + [43])
    assert_bitwise(off_grid, by_steps)
    off = run(w, x, w.new_state(), "chunked", [20, 55])  # off-grid end: the partial chunk [16, 20) is not extended
    assert not torch.equal(off[1].recurrent, whole[1].recurrent)
    torch.testing.assert_close(off[1].recurrent, whole[1].recurrent, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
@torch.no_grad()
def test_sequences_in_a_batch_are_independent(mode):
    """Three sequences of different lengths, one fresh and two continuing (on and off the grid), in one call equal
    each alone bit for bit: the recurrent form steps them together, the chunked form runs them one by one."""
    w = random_weights()
    starts = [w.new_state(), run(w, torch.randn(16, HIDDEN), w.new_state(), mode)[1],
              run(w, torch.randn(7, HIDDEN), w.new_state(), mode)[1]]
    lens = [5, 23, 40]
    xs = [torch.randn(n, HIDDEN) for n in lens]
    out, states = gated_delta_layer(torch.cat(xs), w, starts, lens, mode, C)
    for x, start, got, state in zip(xs, starts, out.split(lens), states):
        assert_bitwise((got, state), run(w, x, start, mode))


@torch.no_grad()
def test_delta_rule_forms_on_their_own():
    """The kernel references directly: GQA heads (2 key heads for 6 value heads), a nonzero initial state, the
    recurrent form batched vs alone bitwise and the chunked form close to it, from a start on and off the grid."""
    t, hk, hv, dk, dv = 45, 2, 6, 8, 4
    q, k = torch.randn(t, hk, dk), torch.randn(t, hk, dk)
    v, g, beta = torch.randn(t, hv, dv), -torch.rand(t, hv), torch.rand(t, hv)
    s0 = torch.randn(2, hv, dk, dv) * 0.1
    both, states = recurrent_gated_delta_ref(q, k, v, g, beta, s0, [20, 25])
    first, state0 = recurrent_gated_delta_ref(q[:20], k[:20], v[:20], g[:20], beta[:20], s0[:1], [20])
    assert torch.equal(both[:20], first) and torch.equal(states[0], state0[0])
    for start in (0, 5, 32):
        out, state = chunked_gated_delta_ref(q[20:], k[20:], v[20:], g[20:], beta[20:], s0[1], start, C)
        torch.testing.assert_close(out, both[20:], rtol=TOL, atol=TOL)
        torch.testing.assert_close(state, states[1], rtol=TOL, atol=TOL)


def test_bad_arguments_are_refused():
    w = random_weights()
    with pytest.raises(ValueError, match="mode"):
        gated_delta_layer(torch.randn(2, HIDDEN), w, [w.new_state()], [2], "parallel")
    with pytest.raises(ValueError, match="seq_lens"):
        gated_delta_layer(torch.randn(3, HIDDEN), w, [w.new_state()], [2])
    with pytest.raises(ValueError, match="num_k_heads"):
        random_weights(hk=3, hv=4)


def test_elementwise_functions_do_not_depend_on_position():
    """sigmoid, silu and softplus give an element the same bits wherever it sits in a tensor (vector body, scalar
    tail, a tensor of one), and stay within a few ulps of torch's."""
    x = torch.cat([torch.randn(500) * 8, torch.tensor([-100.0, -30.0, -20.0, 0.0, 19.9, 20.0, 20.1, 50.0])])
    for ours, torchs in ((sigmoid, torch.sigmoid), (silu, F.silu), (softplus, F.softplus)):
        full = ours(x)
        for start, n in ((0, 1), (3, 1), (1, 7), (5, 17), (100, 33), (0, 500), (501, 7)):
            assert torch.equal(ours(x[start:start + n]), full[start:start + n])
        assert torch.equal(ours(x.view(-1, 4).t()).t().flatten(), full)
        torch.testing.assert_close(full, torchs(x), rtol=1e-6, atol=1e-30)


def _kernel_case(seq_lens, hk=2, hv=4, dk=16, dv=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(seq_lens)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 2
    beta = torch.rand(t, hv, generator=gen)
    states = torch.randn(len(seq_lens), hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, states


def _kernel(kernel, q, k, v, g, beta, pool, slots, seq_lens):
    from fp8engine.model_executor.kernels.gated_delta_ref import kernel_inputs
    bounds = torch.tensor([0, *seq_lens]).cumsum(0)
    return kernel(*kernel_inputs(q, k, v, g, beta), pool, torch.tensor(slots), bounds)


def test_cpp_recurrent_kernel_matches_the_reference_and_is_bitwise_however_split():
    """csrc/gated_delta.cpp: within float32 rounding of recurrent_gated_delta_ref (dv = 24: a vector and a tail);
    bit for bit alone vs in a batch, in any slot, and with its tokens split into calls."""
    from tests.conftest import require_cpu_op
    ops = require_cpu_op("gdn_recurrent_")  # the op itself
    lens = [7, 1, 12]
    q, k, v, g, beta, states = _kernel_case(lens)
    ref_out, ref_states = recurrent_gated_delta_ref(q, k, v, g, beta, states, lens)
    pool = torch.zeros(5, *states.shape[1:])
    pool[[3, 0, 4]] = states
    out = _kernel(ops, q, k, v, g, beta, pool, [3, 0, 4], lens)
    assert (out - ref_out).abs().max() < 1e-5 and (pool[[3, 0, 4]] - ref_states).abs().max() < 1e-5
    assert pool[[1, 2]].eq(0).all()  # the other slots untouched
    alone = torch.zeros(1, *states.shape[1:])
    alone[0] = states[2]
    rows = slice(8, 20)
    first = _kernel(ops, q[8:13], k[8:13], v[8:13], g[8:13], beta[8:13], alone, [0], [5])
    rest = _kernel(ops, q[13:20], k[13:20], v[13:20], g[13:20], beta[13:20], alone, [0], [7])
    assert torch.equal(torch.cat([first, rest]), out[rows]) and torch.equal(alone[0], pool[4])
