"""Qwen2 (q/k/v bias, tied or untied head), Llama with rope scaling (llama3, linear, yarn) and Qwen3-MoE against
Hugging Face: tiny random models from `transformers` configs (tests/tiny_models.py), float32 equal to HF (greedy tokens,
teacher-forced logprobs), BF16 close; the RoPE tables bit for bit; unsupported configs refused by name.

Measured over the 8 prompts x 16 tokens: float32 8/8 identical and mean |dlogprob| 1.0-1.3e-6 for every
architecture; BF16 (its own rounding against HF's, on near-flat random logits) 2-7/8 and 0.009-0.017: how many
greedy continuations survive follows the summation order of the linears (which kernel takes which row count), on
these logits a near-tie every few tokens; llama-yarn went from 3/8 to 2/8 when BF16 calls of up to 32 rows moved
from torch's GEMM to the C++ kernels, its mean |dlogprob| 0.0102 -> 0.0107."""

import pytest
import torch
import transformers

from fp8engine import SamplingParams
from fp8engine.model_executor.layers.rotary import RotaryEmbedding, rope_config
from tests.conftest import cpu_kernels, make_engine
from tests.hf_reference import hf_greedy, hf_logprobs, load_hf
from tests.prompts import PROMPTS
from tests.tiny_models import ARCHS, ROPE, hf_config, tiny_dir  # noqa: F401 (a fixture)

ARCH_NAMES = list(ARCHS)  # qwen2 (tied, untied), llama (llama3, linear, yarn rope), qwen3_moe (two layouts), hybrid
HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # their BF16 bound: test_hybrid_models.py
PROMPT_SET = PROMPTS[::3]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, logprobs_mode="raw")


def compare_with_hf(engine, hf_model, prompts=PROMPT_SET) -> tuple[int, float, list]:
    """(greedy continuations identical to HF's, mean |engine - HF teacher-forced logprob|, the outputs)."""
    outs = engine.generate(prompts, GREEDY)
    same, diffs = 0, []
    for out in outs:
        tokens = out.outputs[0].token_ids
        same += tokens == hf_greedy(hf_model, out.prompt_token_ids, MAX_TOKENS, engine.eos_token_ids)
        ref = hf_logprobs(hf_model, out.prompt_token_ids, tokens)
        diffs += [abs(a - b) for a, b in zip(out.outputs[0].logprobs, ref)]
    return same, sum(diffs) / len(diffs), outs


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_float32_equals_hf(arch, tiny_dir):
    engine = make_engine(tiny_dir(arch), dtype="float32")
    same, mean_diff, _ = compare_with_hf(engine, load_hf(tiny_dir(arch), torch.float32))
    assert same == len(PROMPT_SET), f"{same}/{len(PROMPT_SET)} greedy continuations identical"
    assert mean_diff <= 1e-3, mean_diff


@pytest.mark.parametrize("arch", [a for a in ARCH_NAMES if a not in HYBRID])
def test_bfloat16_close_to_hf(arch, tiny_dir):
    engine = make_engine(tiny_dir(arch), dtype="bfloat16")
    same, mean_diff, _ = compare_with_hf(engine, load_hf(tiny_dir(arch), torch.bfloat16))
    assert same >= 2, f"{same}/{len(PROMPT_SET)} greedy continuations identical"
    assert mean_diff <= 0.02, mean_diff


def test_qwen2_biases_and_tied_head_load_as_hf_holds_them(tiny_dir):
    hf = load_hf(tiny_dir("qwen2-tied"), torch.float32)
    engine = make_engine(tiny_dir("qwen2-tied"), dtype="float32")
    attn = hf.model.layers[1].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        got = engine.get_weights_by_name(f"model.layers.1.self_attn.{name}.bias")
        assert torch.equal(got, getattr(attn, name).bias) and got.abs().max() > 0.05
    assert attn.o_proj.bias is None
    head = engine.runner.model.lm_head.weight
    assert head.data_ptr() == engine.runner.model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(head, hf.lm_head.weight)


@pytest.mark.parametrize("rope", ["default", *ROPE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_equal_transformers(rope, dtype, tokenizer):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = hf_config("llama-llama3", tokenizer, **({} if rope == "default" else {"rope_parameters": ROPE[rope]}))
    if rope == "default":
        cfg = hf_config("qwen2", tokenizer)
    positions = torch.arange(cfg.max_position_embeddings)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=dtype), positions)
    theta, scaling = rope_config(cfg)
    ours = RotaryEmbedding(cfg.hidden_size // cfg.num_attention_heads, cfg.max_position_embeddings, theta, dtype,
                           cpu_kernels(), scaling)
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])
    if rope == "yarn":  # the attention factor scales the tables
        assert ours.cos[0, 0].item() == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1, rel=1e-2)


def _config_only_dir(path, tokenizer, cfg) -> str:
    cfg.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("make_cfg,match", [
    (lambda tok: transformers.MixtralConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=1),
     "unsupported model_type 'mixtral'"),
    (lambda tok: hf_config("llama-linear", tok, rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
     "unsupported rope_type 'dynamic'"),
    (lambda tok: hf_config("qwen2", tok, use_sliding_window=True, sliding_window=64, max_window_layers=0),
     "unsupported: 'qwen2' config with sliding-window attention"),
])
def test_unsupported_configs_raise_by_name(make_cfg, match, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=match):
        make_engine(_config_only_dir(tmp_path, tokenizer, make_cfg(tokenizer)), dtype="float32")
