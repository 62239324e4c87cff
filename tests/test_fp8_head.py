"""EngineConfig(lm_head_fp8=True): the LM head as a block-FP8 linear. Its codes are the engine's quantizer's of the
(tied) embedding, written again by every weight update in place; its logits are the FP8 linear's; a bad update
leaves it as it was; an untied head loads and updates under lm_head.weight; batch invariance holds with it. Its
mismatch against BF16 is measured in tests/test_fp8_mismatch.py."""

import glob

import pytest
import torch
from safetensors.torch import load_file

from fp8engine import EngineConfig, SamplingParams
from fp8engine.weights import layout, quant
from tests.conftest import make_engine

EMBED = "model.embed_tokens.weight"
PROMPTS = [[1, 504, 3458, 314, 260, 1789, 28, 1234], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42] * 20]


@pytest.fixture(scope="module")
def engine():
    return make_engine(quantization="fp8", lm_head_fp8=True, num_kv_blocks=128)


def head_of(engine):
    return engine.runner.model.lm_head


def codes_of(head) -> torch.Tensor:
    """The head's E4M3 codes as rows (stored in the nt16 layout where the kernel set reads it), as bytes."""
    return layout.rows_of(head.weight, 0, head.weight.shape[0]).view(torch.uint8)


def test_options_that_cannot_hold_are_refused_by_name():
    with pytest.raises(ValueError, match="lm_head_fp8=True needs quantization='fp8'"):
        EngineConfig(lm_head_fp8=True)
    with pytest.raises(ValueError, match="lm_head_fp8=True and lm_head_fp32=True exclude each other"):
        EngineConfig(quantization="fp8", lm_head_fp8=True, lm_head_fp32=True)


def test_the_head_holds_the_quantized_embedding_and_runs_the_fp8_linear(engine):
    head, embedding = head_of(engine), engine.runner.model.model.embed_tokens.weight
    assert head.weight.dtype == torch.float8_e4m3fn and embedding.dtype == torch.bfloat16
    # 576 = 4.5 x 128: the last column of blocks is partial
    assert tuple(head.weight.shape) == (49152, 576) and tuple(head.weight_scale_inv.shape) == (384, 5)
    codes, scales = quant.quantize_weight_blockwise(embedding)
    assert torch.equal(codes_of(head), codes.view(torch.uint8))
    assert torch.equal(head.weight_scale_inv, scales)
    assert engine.runner.kernels.names["lm_head"] == "fp8:" + engine.runner.kernels.names["fp8_linear"]
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits = engine.runner.model.compute_logits(hidden)
    expected = engine.runner.kernels.fp8_linear(hidden, head.weight, head.weight_scale_inv, None, None)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, expected)
    # close to the BF16 head, not equal to it
    bf16 = (hidden.float() @ embedding.float().T)
    error = ((logits.float() - bf16).norm() / bf16.norm()).item()
    assert 1e-3 < error < 0.08, error


def test_an_update_requantizes_the_head_in_place_and_equals_a_fresh_load(engine, tmp_path):
    head = head_of(engine)
    pointers = head.weight.data_ptr(), head.weight_scale_inv.data_ptr()
    embedding = engine.get_weights_by_name(EMBED)
    new = embedding * 1.5
    new[7] = -new[7]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    original = engine.generate(PROMPTS, greedy)
    try:
        engine.update_weights({EMBED: new})
        assert (head.weight.data_ptr(), head.weight_scale_inv.data_ptr()) == pointers
        codes, scales = quant.quantize_weight_blockwise(new)
        assert torch.equal(codes_of(head), codes.view(torch.uint8))
        assert torch.equal(head.weight_scale_inv, scales)
        updated = engine.generate(PROMPTS, greedy)
        # a bad update (a NaN in the embedding) writes neither the embedding nor the head
        broken = new.clone()
        broken[3, 5] = float("nan")
        before = head.weight.clone(), head.weight_scale_inv.clone()
        with pytest.raises(ValueError, match="model.embed_tokens.weight.*NaN"):
            engine.update_weights({EMBED: broken})
        assert torch.equal(head.weight.view(torch.uint8), before[0].view(torch.uint8))
        assert torch.equal(head.weight_scale_inv, before[1])
        assert torch.equal(engine.get_weights_by_name(EMBED), new)
    finally:
        engine.update_weights({EMBED: embedding})
    restored = engine.generate(PROMPTS, greedy)
    fresh = make_engine(quantization="fp8", lm_head_fp8=True, num_kv_blocks=128)
    fresh.update_weights({"lm_head.weight": new})  # tied: the same tensor as the embedding
    again = fresh.generate(PROMPTS, greedy)
    for a, b in zip(updated, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert [o.outputs[0].token_ids for o in restored] == [o.outputs[0].token_ids for o in original]
    assert [o.outputs[0].token_ids for o in updated] != [o.outputs[0].token_ids for o in original]


def test_an_untied_head_loads_and_updates_under_its_own_name(tiny_qwen3_dir):
    state = {}
    for path in glob.glob(f"{tiny_qwen3_dir}/*.safetensors"):
        state.update(load_file(path))
    engine = make_engine(tiny_qwen3_dir, quantization="fp8", lm_head_fp8=True, num_kv_blocks=32)
    head, embedding = head_of(engine), engine.runner.model.model.embed_tokens.weight
    codes, scales = quant.quantize_weight_blockwise(state["lm_head.weight"])
    assert torch.equal(codes_of(head), codes.view(torch.uint8))
    assert torch.equal(head.weight_scale_inv, scales)
    assert torch.equal(embedding, state[EMBED]) and not torch.equal(state[EMBED], state["lm_head.weight"])
    new = state["lm_head.weight"].flip(0).contiguous()
    engine.update_weights({"lm_head.weight": new})
    codes, scales = quant.quantize_weight_blockwise(new)
    assert torch.equal(codes_of(head), codes.view(torch.uint8))
    assert torch.equal(embedding, state[EMBED])  # the embedding is not the head's here
    assert torch.equal(engine.get_weights_by_name("lm_head.weight"),
                       quant.dequantize_weight_blockwise(codes, scales, torch.bfloat16))


def test_batch_invariance_holds_with_the_fp8_head():
    engine = make_engine(quantization="fp8", lm_head_fp8=True, batch_invariant=True, num_kv_blocks=128)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=2)
    alone = [engine.generate(p, params)[0].outputs[0] for p in PROMPTS]
    together = [o.outputs[0] for o in engine.generate(PROMPTS, params)]
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
    assert len({tuple(a.token_ids) for a in alone}) == 3
