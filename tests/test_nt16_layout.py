"""The nt16 layout (weights/layout.py): a batch-invariant engine on the AVX-512 BF16 kernels stores its FP8 codes
and its BF16 LM head (here tied to the embedding) with whole groups of 16 rows interleaved, so that its small-batch
kernels read them without transposing. It is a storage layout only: the engine decodes the bits of the same engine
with its weights as rows, through loads, BF16 and pre-quantized updates, and reads its weights back
(`get_weights_by_name`) as rows."""

import pytest
import torch

from fp8engine import SamplingParams
from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops
from fp8engine.weights import layout
from tests.checkpoints import perturbed_state, prequantized_items, write_checkpoint
from tests.conftest import make_engine, require_cpu_op
from tests.hf_reference import load_hf
from tests.prompts import PROMPTS
from tests.tiny_models import tiny_dir  # noqa: F401 (a fixture)

PARAMS = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, logprobs_mode="raw"),
          SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, ignore_eos=True, seed=5, n=2, logprobs=1)]
NAMES = ["model.layers.0.self_attn.k_proj.weight", "model.layers.7.mlp.down_proj.weight",
         "model.layers.29.self_attn.q_proj.weight", "model.embed_tokens.weight", "lm_head.weight"]


@pytest.fixture(scope="module")
def engines():
    require_cpu_op("fp8_block_linear")
    if load_cpu_ops().fp8_linear_isa() != "avx512bf16":
        pytest.skip("the nt16 layout is read by the AVX-512 BF16 kernels")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FP8ENGINE_FP8_GEMM", "avx512")  # on an AMX machine too: batch invariant on AVX-512, not tiles
        mp.setenv("FP8ENGINE_BF16_GEMM", "avx512")
        built = {}
        for flag in ("1", "0"):
            mp.setenv("FP8ENGINE_NT16", flag)
            built[flag] = make_engine(quantization="fp8", batch_invariant=True, num_kv_blocks=96)
    return built["1"], built["0"]


def _decode(engine):
    out = []
    for params in PARAMS:
        for request in engine.generate(PROMPTS[:3], params):
            out += [(o.token_ids, o.logprobs, o.top_logprobs) for o in request.outputs]
    return out


def test_nt16_engine_decodes_the_bits_of_rows(engines):
    nt16, rows = engines
    assert nt16.runner.kernel_names["fp8_weights"] == "nt16" and rows.runner.kernel_names["fp8_weights"] == "rows"
    assert nt16.runner.kernel_names["lm_head_weights"] == "nt16" and "lm_head_weights" not in rows.runner.kernel_names
    heads = [e.runner.model.lm_head.weight for e in engines]
    assert heads[0] is nt16.runner.model.model.embed_tokens.weight and layout.is_marked(heads[0])
    assert not torch.equal(heads[0], heads[1]) and torch.equal(layout.rows_of(heads[0], 0, heads[0].shape[0]), heads[1])
    ids = torch.tensor([[0, 5, 49151], [17, 16, 32]])
    assert torch.equal(nt16.runner.model.model.embed_tokens(ids), rows.runner.model.model.embed_tokens(ids))
    gate_up = [e.runner.model.model.layers[3].mlp.gate_up_proj.weight for e in engines]
    assert layout.is_marked(gate_up[0]) and not layout.is_marked(gate_up[1])
    assert not torch.equal(gate_up[0].view(torch.uint8), gate_up[1].view(torch.uint8))  # stored differently
    assert torch.equal(layout.rows_of(gate_up[0], 0, gate_up[0].shape[0]).view(torch.uint8), gate_up[1].view(torch.uint8))
    for name in NAMES:
        assert torch.equal(nt16.get_weights_by_name(name), rows.get_weights_by_name(name)), name
    assert _decode(nt16) == _decode(rows)


@pytest.mark.parametrize("how", ["bf16", "prequantized"])
def test_nt16_engine_updates_to_the_bits_of_rows(engines, default_dir, how):
    state = perturbed_state(default_dir, seed=11)
    items = list(state.items()) if how == "bf16" else list(prequantized_items(state))
    for engine in engines:
        engine.update_weights(items)
    nt16, rows = engines
    for name in NAMES:
        assert torch.equal(nt16.get_weights_by_name(name), rows.get_weights_by_name(name)), name
    assert _decode(nt16) == _decode(rows)
    q = state["model.layers.29.self_attn.q_proj.weight"].float()
    assert (nt16.get_weights_by_name("model.layers.29.self_attn.q_proj.weight").float() - q).abs().max() < 0.05 * q.abs().max()


def test_nt16_bf16_engine_decodes_the_bits_of_rows(monkeypatch):
    """A BF16 engine: its linears and LM head in the layout, through the Python layers and the decoder plan."""
    require_cpu_op("bf16_linear")
    if load_cpu_ops().fp8_linear_isa() != "avx512bf16":
        pytest.skip("the nt16 layout is read by the AVX-512 BF16 kernels")
    monkeypatch.setenv("FP8ENGINE_BF16_GEMM", "avx512")
    out = {}
    for flag, fused in (("1", "1"), ("1", "0"), ("0", "1")):
        monkeypatch.setenv("FP8ENGINE_NT16", flag)
        monkeypatch.setenv("FP8ENGINE_FUSED_DECODER", fused)
        engine = make_engine(batch_invariant=True, num_kv_blocks=64)
        assert engine.runner.kernel_names.get("lm_head_weights") == ("nt16" if flag == "1" else None)
        assert engine.runner.kernel_names.get("dense_weights") == ("nt16" if flag == "1" else None)
        assert layout.is_marked(engine.runner.model.model.layers[4].mlp.down_proj.weight) == (flag == "1")
        out[flag, fused] = _decode(engine)
    assert out["1", "1"] == out["0", "1"] == out["1", "0"]


def test_nt16_moe_experts_decode_and_update_to_the_bits_of_rows(tiny_dir, monkeypatch, tmp_path):
    """Qwen3-MoE: each expert's matrices are in the layout on their own (the kernel reads one expert at a time);
    per-expert and transformers-5 stacked names load, update and read back as rows."""
    require_cpu_op("fp8_block_linear")
    if load_cpu_ops().fp8_linear_isa() != "avx512bf16":
        pytest.skip("the nt16 layout is read by the AVX-512 BF16 kernels")
    monkeypatch.setenv("FP8ENGINE_FP8_GEMM", "avx512")
    model = tiny_dir("qwen3_moe")
    built = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FP8ENGINE_NT16", flag)
        built.append(make_engine(model, quantization="fp8", batch_invariant=True, num_kv_blocks=64))
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3, logprobs=0,
                            return_routed_experts=True)

    def decode(engine):
        outs = engine.generate(PROMPTS[:3], params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].routed_experts.tolist()) for o in outs]
    experts = built[0].runner.model.model.layers[0].mlp.experts
    assert layout.is_marked(experts.gate_up_proj) and built[0].runner.kernel_names["fp8_weights"] == "nt16"
    assert decode(built[0]) == decode(built[1])
    state = perturbed_state(model, seed=5, scale=0.3)
    stacked = load_hf(write_checkpoint(model, tmp_path, state), torch.bfloat16).state_dict()
    for engine in built:
        engine.update_weights(stacked)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(built[0].get_weights_by_name(name), built[1].get_weights_by_name(name))
    assert decode(built[0]) == decode(built[1])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16])
def test_writes_through_the_layout_keep_every_other_row(dtype):
    """as_rows around a write of some rows (whole groups, rows inside groups, the row-major tail past the last
    group) leaves the matrix, read back as rows, with those rows new and every other row as it was."""
    gen = torch.Generator().manual_seed(2)

    def draw():
        return (torch.randint(0, 255, (40, 24), generator=gen, dtype=torch.uint8) if dtype == torch.uint8
                else torch.randn(40, 24, generator=gen).bfloat16())
    ref = draw()
    weight = torch.nn.Parameter(ref.clone(), requires_grad=False)
    layout.to_nt16_(weight.data)
    layout.mark(weight)
    assert torch.equal(layout.rows_of(weight, 0, 40), ref) and torch.equal(layout.rows_of(weight, 8, 30), ref[8:38])
    new = draw()
    for row0, rows in ((16, 16), (8, 12), (32, 8), (0, 40)):
        with layout.as_rows(weight, row0, rows):
            weight.data[row0:row0 + rows].copy_(new[row0:row0 + rows])
        ref[row0:row0 + rows] = new[row0:row0 + rows]
        assert torch.equal(layout.rows_of(weight, 0, 40), ref), (row0, rows)


@pytest.mark.parametrize("dtype, shape", [(torch.uint8, (3 * 16 + 5, 24)), (torch.uint8, (64, 1536)),
                                          (torch.bfloat16, (2 * 16 + 3, 6)), (torch.bfloat16, (48, 576))])
def test_the_permutation_op_moves_the_bytes_torch_moves(dtype, shape):
    """csrc/layout.cpp (in place, a group's buffer a thread) against the torch permutation: every group range, into
    the layout and back; rows past the groups untouched."""
    require_cpu_op("nt16_permute_")
    gen = torch.Generator().manual_seed(4)
    ref = (torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8) if dtype == torch.uint8
           else torch.randn(shape, generator=gen).bfloat16())
    groups = shape[0] // 16
    for g0, g1 in ((0, groups), (1, groups), (0, 1), (1, 1)):
        op, torch_way = ref.clone(), ref.clone()
        torch.ops.fp8engine.nt16_permute_(op, g0, g1, True)
        layout._permute_groups_torch(torch_way, g0, g1, True)
        assert torch.equal(op, torch_way), (g0, g1)
        assert torch.equal(op[:g0 * 16], ref[:g0 * 16]) and torch.equal(op[g1 * 16:], ref[g1 * 16:])
        if g1 > g0:
            assert not torch.equal(op, ref)
        torch.ops.fp8engine.nt16_permute_(op, g0, g1, False)
        assert torch.equal(op, ref), (g0, g1)


def test_the_permutation_op_names_what_it_cannot_move():
    require_cpu_op("nt16_permute_")
    with pytest.raises(RuntimeError, match="K = 6 is not a multiple of 4"):
        torch.ops.fp8engine.nt16_permute_(torch.zeros(16, 6, dtype=torch.uint8), 0, 1, True)
    with pytest.raises(RuntimeError, match="outside a matrix of 16 rows"):
        torch.ops.fp8engine.nt16_permute_(torch.zeros(16, 8, dtype=torch.uint8), 0, 2, True)
    with pytest.raises(RuntimeError, match="1- or 2-byte elements"):
        torch.ops.fp8engine.nt16_permute_(torch.zeros(16, 8), 0, 1, True)
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        torch.ops.fp8engine.nt16_permute_(torch.zeros(16, 8, dtype=torch.uint8)[:, :4], 0, 1, True)


def test_a_plain_engine_is_in_the_layout_and_decodes_the_rows_bits_past_the_gemv(monkeypatch):
    """A plain (not batch-invariant) engine on the AVX-512 BF16 kernels stores its weights in the layout too and so
    gives up the gemv at 1-4 rows for nt: from 5 rows, where the rows engine takes nt as well, the same bits."""
    require_cpu_op("fp8_block_linear")
    if load_cpu_ops().fp8_linear_isa() != "avx512bf16":
        pytest.skip("the nt16 layout is read by the AVX-512 BF16 kernels")
    monkeypatch.setenv("FP8ENGINE_FP8_GEMM", "avx512")
    monkeypatch.setenv("FP8ENGINE_BF16_GEMM", "avx512")
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=6, ignore_eos=True, seed=9, logprobs=2)
    out, names = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("FP8ENGINE_NT16", flag)
        engine = make_engine(quantization="fp8", num_kv_blocks=96)
        names[flag] = engine.runner.kernel_names
        requests = engine.generate(PROMPTS[:6], params)  # 6 rows to sample in every step, the first included
        out[flag] = [(o.token_ids, o.logprobs, o.top_logprobs) for r in requests for o in r.outputs]
        del engine
    assert names["1"]["fp8_weights"] == names["1"]["lm_head_weights"] == "nt16"
    assert names["0"]["fp8_weights"] == "rows" and "lm_head_weights" not in names["0"]
    assert len(out["1"]) == 6 and out["1"] == out["0"]


def test_a_plain_prefill_sized_call_on_nt16_bf16_weights_is_torchs_gemm_on_the_rows():
    """Without batch invariance, from 512 rows the BF16 kernel gives torch's GEMM a rows copy of an nt16 weight
    (csrc/bf16_linear.cpp: oneDNN is faster there); below, and batch invariant at any M, it reads the groups."""
    require_cpu_op("bf16_linear")
    if load_cpu_ops().fp8_linear_isa() != "avx512bf16":
        pytest.skip("the nt16 layout is read by the AVX-512 BF16 kernels")
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(3 * 16 + 5, 96, generator=gen).bfloat16()
    bias = torch.randn(3 * 16 + 5, generator=gen).bfloat16()
    grouped = layout.to_nt16_(w.clone())
    kernel = torch.ops.fp8engine.bf16_linear
    for m in (511, 512, 600):
        x = torch.randn(m, 96, generator=gen).bfloat16()
        plain, invariant = (kernel(x, grouped, bias, bi, False, "avx512", True) for bi in (False, True))
        assert torch.equal(invariant, kernel(x, w, bias, True, False, "avx512", False)), m
        assert torch.equal(plain, torch.nn.functional.linear(x, w, bias) if m >= 512 else invariant), m
    assert torch.equal(grouped, layout.to_nt16_(w.clone()))  # the weight itself untouched
