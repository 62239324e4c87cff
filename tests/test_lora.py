"""LoRA rollouts: an adapter unmerged beside the base (BF16, float32 or FP8), written in place by update_lora,
validated before anything is written; batch invariant and replayed bit for bit; synced alone from a PEFT model."""

import pytest
import torch
from safetensors.torch import load_file

from fp8engine import EngineConfig, LLMEngine, SamplingParams
from tests.test_speculative import every_lookup
from tests.tiny_models import tiny_dir  # noqa: F401 (a fixture)

PROMPTS = [[5, 6, 7], list(range(100, 120)), [40, 41, 42, 43], list(range(2000, 2011))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, logprobs_mode="raw")
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, logprobs=2, seed=3)
MODULES = {"self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"),
           "self_attn.v_proj": ("hidden", "kv"), "self_attn.o_proj": ("q", "hidden"),
           "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
           "mlp.down_proj": ("inter", "hidden")}
SIZES = {"hidden": 128, "q": 128, "kv": 64, "inter": 256}  # tests/tiny_models.py SHAPE: 4 heads, 2 KV heads


@pytest.fixture(scope="module")
def model(tiny_dir):  # noqa: F811
    return tiny_dir("llama-llama3")


def adapter(rank: int, seed: int, modules=MODULES, layers=(0, 1), std: float = 0.08) -> dict[str, torch.Tensor]:
    """A PEFT-named adapter (get_peft_model_state_dict's names) of random A and B."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        for module in modules:
            k, n = (SIZES[s] for s in MODULES[module])
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=g) * std
            out[f"{prefix}.lora_B.weight"] = torch.randn(n, rank, generator=g) * std
    return out


def merged(model_dir: str, lora: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The checkpoint's projections with the adapter merged in (float32), as PEFT's merge_adapter does."""
    base = load_file(f"{model_dir}/model.safetensors")
    out = {}
    for name, a in lora.items():
        if ".lora_A." in name:
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = lora[name.replace("lora_A", "lora_B")]
            w = base[f"{module}.weight"].float()
            out[f"{module}.weight"] = w + scaling * b.float() @ a.float()
    return out


def engine_of(model_dir: str, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=96, **options))


def run(engine: LLMEngine, params=GREEDY) -> tuple[list[list[int]], list[list[float]]]:
    outs = [o.outputs[0] for o in engine.generate(PROMPTS, params)]
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


def scored(engine: LLMEngine, tokens: list[list[int]]) -> torch.Tensor:
    return torch.tensor(engine.score(PROMPTS, tokens, GREEDY))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 0.02)])
def test_an_unmerged_adapter_gives_what_the_merged_weights_give(model, dtype, tol):
    """Teacher-forced on the unmerged engine's greedy tokens, the merged engine's logprobs differ by at most
    what the suite allows between float32 and BF16 (mean 0.02, tests/test_models.py); float32 to rounding."""
    lora, scaling = adapter(8, seed=1), 2.0
    plain = engine_of(model, dtype=dtype)
    before_tokens, _ = run(plain)
    unmerged = engine_of(model, dtype=dtype, max_lora_rank=8)
    report = unmerged.update_lora(lora, scaling, weight_version=3)
    assert (report.num_tensors, report.num_quantized, report.weight_version) == (28, 0, 3)
    assert report.num_bytes == sum(t.numel() * 4 for t in lora.values())
    tokens, _ = run(unmerged)
    plain.update_weights(merged(model, lora, scaling))
    ours, theirs = scored(unmerged, tokens), scored(plain, tokens)
    assert (ours - theirs).abs().mean() <= tol
    if dtype == "float32":
        assert run(plain)[0] == tokens and (ours - theirs).abs().max() <= tol
    # the adapter moves the model by far more than the tolerance
    assert tokens != before_tokens and (ours - scored(engine_of(model, dtype=dtype), tokens)).abs().mean() > 10 * tol


def test_the_adapter_adds_what_the_torch_reference_adds(model):
    engine = engine_of(model, dtype="float32", max_lora_rank=8)
    lora = adapter(5, seed=2, modules=["self_attn.k_proj", "self_attn.v_proj"], layers=(1,))
    engine.update_lora(lora, 0.5)
    qkv = engine.runner.model.model.layers[1].self_attn.qkv_proj
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    delta = qkv(x) - qkv._base(x)
    a, b = (lora[f"base_model.model.model.layers.1.self_attn.v_proj.lora_{h}.weight"] for h in "AB")
    assert torch.allclose(delta[:, 192:], 0.5 * (x @ a.T) @ b.T, atol=1e-5)  # PEFT's scaling * B(A x)
    assert delta[:, :128].abs().max() == 0  # q has no adapter: exact zeros


def test_on_fp8_the_base_bytes_stay_and_a_second_update_equals_a_fresh_engine(model):
    options = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", max_lora_rank=16)
    engine = engine_of(model, **options)
    base = {name: t.clone() for name, t in engine.named_parameters()}
    ptrs = {name: t.data_ptr() for name, t in engine.named_parameters()}
    buffers = {name: t.data_ptr() for name, t in engine.runner.model.named_buffers() if "lora" in name}
    engine.update_lora(adapter(16, seed=1), 2.0)
    first = run(engine, SEEDED)
    second_adapter = adapter(4, seed=7, modules=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"])
    engine.update_lora(second_adapter, 4.0)
    for name, t in engine.named_parameters():
        assert t.data_ptr() == ptrs[name] and t.dtype == base[name].dtype
        assert torch.equal(t.view(torch.uint8), base[name].view(torch.uint8)), name
    assert {n: t.data_ptr() for n, t in engine.runner.model.named_buffers() if "lora" in n} == buffers
    fresh = engine_of(model, **options)
    fresh.update_lora(second_adapter, 4.0)
    assert run(engine, SEEDED) == run(fresh, SEEDED) != first
    assert engine.get_stats().kv_scales == fresh.get_stats().kv_scales  # recalibrated for the new adapter


def test_an_empty_update_removes_the_adapter(model):
    engine = engine_of(model, max_lora_rank=8)
    plain = run(engine)
    engine.update_lora(adapter(8, seed=1), 2.0)
    assert engine.get_stats().lora_active and run(engine) != plain
    engine.update_lora({})
    assert not engine.get_stats().lora_active and run(engine) == plain


A_Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_Q = A_Q.replace("lora_A", "lora_B")


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": d[A_Q]}), "layers.9"),
    (lambda d: d.update({"model.layers.0.self_attn.q_proj.weight": d[A_Q]}), "not a PEFT LoRA name"),
    (lambda d: d.update({A_Q: d[A_Q][:, :64]}), r"shape \(8, 64\), expected \(rank, 128\)"),
    (lambda d: d.update({B_Q: d[B_Q][:, :4]}), r"lora_B.weight.*shape \(128, 4\), expected \(128, 8\)"),
    (lambda d: d.update({A_Q: torch.zeros(12, 128), B_Q: torch.zeros(128, 12)}), "rank 12 is over.*max_lora_rank=8"),
    (lambda d: d.pop(B_Q), "lora_B.weight is missing"),
    (lambda d: d[B_Q].__setitem__((3, 1), float("nan")), "q_proj.lora_B.weight.*NaN"),
    (lambda d: d.update({A_Q: d[A_Q].to(torch.int32)}), "dtype torch.int32"),
    (lambda d: d.update({"base_model.model.lm_head.lora_A.weight": d[A_Q]}), "lm_head.*no linear"),
])
def test_a_bad_adapter_is_refused_by_name_and_changes_nothing(model, change, match):
    engine = engine_of(model, max_lora_rank=8)
    engine.update_lora(adapter(8, seed=1), 2.0, weight_version=1)
    before = run(engine, SEEDED)
    bad = adapter(8, seed=5)
    change(bad)
    with pytest.raises(ValueError, match=match):
        engine.update_lora(bad, 2.0, weight_version=2)
    assert engine.weight_version == 1 and run(engine, SEEDED) == before


@pytest.mark.parametrize("scaling, match", [(float("inf"), "finite"), ({}, "no value for LoRA module"),
                                             ("2", "finite number")])
def test_bad_scaling_and_an_engine_without_buffers_are_refused(model, scaling, match):
    engine = engine_of(model, max_lora_rank=8)
    with pytest.raises(ValueError, match=match):
        engine.update_lora(adapter(8, seed=1), scaling)
    assert not engine.runner.lora_active and engine.weight_version == 0
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine_of(model).update_lora(adapter(8, seed=1), 1.0)
    with pytest.raises(ValueError, match="max_lora_rank must be"):
        EngineConfig(model=model, max_lora_rank=-1)


@pytest.mark.parametrize("mode", [dict(), dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")], ids=["bf16", "fp8"])
def test_with_an_adapter_rollouts_stay_batch_invariant_and_replay_bitwise(model, mode):
    engine = engine_of(model, batch_invariant=True, max_lora_rank=8, max_num_batched_tokens=16, **mode)
    engine.update_lora(adapter(8, seed=1), 2.0)
    batched = [o.outputs[0] for o in engine.generate(PROMPTS, SEEDED)]
    for prompt, together in zip(PROMPTS, batched):
        alone = engine.generate([prompt], SEEDED)[0].outputs[0]
        assert alone.token_ids == together.token_ids and alone.logprobs == together.logprobs
    assert engine.score(PROMPTS, [o.token_ids for o in batched], SEEDED) == [o.logprobs for o in batched]


def _peft_model(model_dir: str, seed: int):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                             init_lora_weights=False)
    return peft.get_peft_model(base, config)


def test_a_peft_model_syncs_its_adapter_alone_and_exact_logprobs_replay_it(model):
    from fp8engine.rl import RolloutEngine, response_logprobs
    rollouts = RolloutEngine(EngineConfig(model=model, num_kv_blocks=96, batch_invariant=True, max_lora_rank=8))
    policy = _peft_model(model, seed=0)
    report = rollouts.sync_weights(policy, weight_version=1)
    lora_bytes = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
    assert (report.num_bytes, report.num_tensors, report.weight_version) == (lora_bytes, 16, 1)
    batch = rollouts.rollout(PROMPTS[:2], n=2, sampling_params=SEEDED)
    assert batch.token_weight_versions[batch.response_mask.bool()].eq(1).all()
    exact = response_logprobs(policy, batch, SEEDED, exact=True)
    assert torch.equal(exact.detach(), batch.rollout_logprobs)
    with torch.no_grad():
        plain = response_logprobs(policy, batch, SEEDED)
    mask = batch.response_mask.bool()
    assert (plain - batch.rollout_logprobs)[mask].abs().mean() <= 0.02  # float32 trainer vs the BF16 engine


def test_over_http_a_peft_model_syncs_its_adapter_alone_and_samples_as_in_process(model):
    from fp8engine.bench.serve_load import serving
    from fp8engine.rl import RolloutClient, RolloutEngine
    policy = _peft_model(model, seed=0)
    local = RolloutEngine(EngineConfig(model=model, num_kv_blocks=96, batch_invariant=True, max_lora_rank=8))
    local.sync_weights(policy, weight_version=4)
    expected = local.rollout(PROMPTS[:2], n=2, sampling_params=SEEDED)
    flags = ["--model", model, "--num-kv-blocks", "96", "--batch-invariant", "--max-lora-rank", "8"]
    with serving(flags, startup_timeout=600) as url:
        client = RolloutClient(url, tokenizer=model, sync_dtype=None)
        report = client.sync_weights(policy, weight_version=4)
        lora_bytes = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
        assert (report.num_bytes, report.num_tensors, report.num_buckets) == (lora_bytes, 16, 1)
        got = client.rollout(PROMPTS[:2], n=2, sampling_params=SEEDED)
        stats = client.get_stats()
        assert (stats.weight_version, stats.max_lora_rank, stats.lora_active) == (4, 8, True)
        bad = adapter(8, seed=1)
        bad[B_Q] = bad[B_Q][:, :4]
        with pytest.raises(RuntimeError, match=r"HTTP 400.*q_proj.lora_B.weight.*shape \(128, 4\)"):
            client.update_lora(bad, 2.0, weight_version=5)
        assert client.get_stats().weight_version == 4
        client.close()
    assert got.response_ids.tolist() == expected.response_ids.tolist()
    assert torch.allclose(got.rollout_logprobs, expected.rollout_logprobs, rtol=0, atol=1e-6)


def test_speculation_and_an_in_flight_adapter_update_keep_their_guarantees(model):
    """With an adapter, exact speculative decoding still gives the plain run's bits; an update_lora with
    in_flight="keep" lets samples go on, their later tokens tagged with the new version."""
    options = dict(batch_invariant=True, max_lora_rank=8)
    plain, spec = engine_of(model, **options), engine_of(model, speculative="ngram", **options)
    spec.speculator.source = every_lookup(spec.speculator)
    for engine in (plain, spec):
        engine.update_lora(adapter(8, seed=1), 2.0)
    prompt = [7, 8, 9, 10] * 6
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    a, b = (e.generate([prompt], params)[0].outputs[0] for e in (plain, spec))
    assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs) and spec.get_stats().spec_draft_tokens > 0
    plain.add_request(prompt, params, request_id="r")
    for _ in range(4):
        plain.step()
    plain.update_lora(adapter(8, seed=2), 2.0, weight_version=7, in_flight="keep")
    outs = []
    while plain.has_unfinished_requests():
        outs += plain.step()
    versions = next(o for o in outs if o.finished).outputs[0].token_weight_versions
    assert len(versions) == 24 and versions[0] == 1 and versions[-1] == 7 and versions == sorted(versions)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cpu_kernel_adds_what_its_reference_adds_and_rows_do_not_depend_on_the_batch(dtype):
    """Whole adapters (one segment) and block-diagonal ones (a fused layer's shards, ranks under the maximum: the
    kernel skips what lies outside the segments, which the reference multiplies as zeros); 1 to 64 rows, so both
    the row-parallel and the column-parallel split run; a row alone gives the bits it gives in the batch."""
    from fp8engine.model_executor.kernels.layer_ops_ref import lora_add_ref
    from tests.conftest import require_cpu_op
    require_cpu_op("lora_add_")
    g = torch.Generator().manual_seed(0)
    cases = [(1, 576, 24, 960, [[0, 5, 0, 576], [8, 16, 576, 768], [16, 16, 768, 960]]), (37, 100, 13, 33, None),
             (5, 16, 1, 1, None), (64, 1536, 64, 576, None), (3, 128, 16, 512, [[0, 3, 0, 256], [8, 16, 256, 512]])]
    for rows, k, r, n, segments in cases:
        x, a, bt, y = (torch.randn(*shape, generator=g).to(dtype) for shape in ((rows, k), (r, k), (r, n), (rows, n)))
        segments = torch.tensor(segments or [[0, r, 0, n]])
        inside = torch.zeros(r, n, dtype=torch.bool)
        for j0, j1, o0, o1 in segments.tolist():
            inside[j0:j1, o0:o1] = True
        bt = torch.where(inside, bt, torch.zeros((), dtype=dtype))
        a = torch.where(inside.any(dim=1, keepdim=True), a, torch.zeros((), dtype=dtype))
        got = y.clone()
        torch.ops.fp8engine.lora_add_(got, x, a, bt, segments)
        want = lora_add_ref(y.clone(), x, a, bt)
        if dtype == torch.float32:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        else:  # one rounding of fp32 sums that differ in order only: a bf16 ulp apart, or less than the order's noise
            tol = want.float().abs() * 2 ** -7 + 1e-4 * want.float().abs().max()
            assert ((got.float() - want.float()).abs() <= tol).all()
        for i in (0, rows - 1):  # a row alone: the same bits as in the batch
            alone = y[i:i + 1].clone()
            torch.ops.fp8engine.lora_add_(alone, x[i:i + 1].contiguous(), a, bt, segments)
            assert torch.equal(alone, got[i:i + 1])
    zeros = [torch.zeros(*shape, dtype=dtype) for shape in ((2, 4), (2, 8), (3, 8), (3, 5))]
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.fp8engine.lora_add_(*zeros, torch.tensor([[0, 3, 0, 4]]))
    zeros[-1] = torch.zeros(3, 4, dtype=dtype)
    with pytest.raises(RuntimeError, match="segment 0 is out of range"):
        torch.ops.fp8engine.lora_add_(*zeros, torch.tensor([[0, 4, 0, 4]]))


def test_without_the_kernel_two_dense_linears_add_what_the_reference_adds():
    from torch.nn import functional as F

    from fp8engine.model_executor.kernels.layer_ops_ref import lora_add_dense, lora_add_ref
    g = torch.Generator().manual_seed(1)
    x, a, bt, y = (torch.randn(*shape, generator=g) for shape in ((7, 96), (12, 96), (12, 40), (7, 40)))
    assert torch.allclose(lora_add_dense(F.linear, y.clone(), x, a, bt), lora_add_ref(y.clone(), x, a, bt), atol=1e-4)
