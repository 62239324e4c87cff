"""Qwen3-MoE: the grouped expert compute (C++ on CPU, FP8 experts) against its torch reference, the model
against Hugging Face, FP8 expert updates in place, pre-quantized FP8 checkpoints, routed-expert return
(against HF's router top-k, through prefix hits, forks and preemption, in RolloutBatch) and batch invariance."""

import dataclasses
import json
import random

import pytest
import torch

from fp8engine import EngineConfig, SamplingParams
from fp8engine.model_executor.kernels.moe_ref import fused_moe_ref
from fp8engine.model_executor.layers.moe import FusedMoE, route
from fp8engine.rl import RolloutEngine
from fp8engine.weights import layout
from fp8engine.weights.quant import quantize_weight_blockwise
from tests.checkpoints import perturbed_state, prequantized_items, write_checkpoint
from tests.conftest import cpu_kernels, make_engine, require_cpu_op
from tests.hf_reference import load_hf
from tests.prompts import CHATS, PROMPTS, RAW
from tests.tiny_models import load_random_experts, tiny_dir  # noqa: F401 (a fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, logprobs_mode="raw")
ROUTED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3, logprobs=0,
                        return_routed_experts=True)
EXPERT = "model.layers.1.mlp.experts.7.up_proj.weight"


def rollout(engine, params=GREEDY, prompts=PROMPTS[::4]):
    outs = engine.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def pointers(engine) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in engine.named_parameters()}


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Every parameter's bytes (E4M3 compared by bit pattern)."""
    return {name: p.detach().clone().view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p.detach().clone()
            for name, p in engine.named_parameters()}


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("inter", [64, 256])  # gate / up shards off and on the 128-row scale grid
@pytest.mark.parametrize("fp8", [False, True])
def test_cpp_experts_match_the_torch_reference(inter, fp8):
    require_cpu_op("fp8_block_linear" if fp8 else "bf16_linear")
    kernels = cpu_kernels(quantization="fp8" if fp8 else None)
    layer = FusedMoE(8, 256, inter, torch.bfloat16, kernels, fp8)
    load_random_experts(layer)
    rows = layer.gate_up_proj.detach().clone(), layer.down_proj.detach().clone()
    if fp8 and kernels.fp8_nt16:  # as the runner stores them for these kernels: each expert's matrix in the layout
        for stacked in (layer.gate_up_proj, layer.down_proj):
            for matrix in stacked.data:
                layout.to_nt16_(matrix)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 256, generator=gen).bfloat16()
    ids, weights = route(torch.randn(37, 8, generator=gen).bfloat16(), 3, normalize=True)
    got = layer(x, ids, weights)
    scales = (layer.gate_up_proj_scale_inv, layer.down_proj_scale_inv, layer.scale_rows) if fp8 else ()
    want = fused_moe_ref(x, ids, weights, *rows, *scales)
    assert got.shape == (37, 256) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-2)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers(tiny_dir):
    engine = make_engine(tiny_dir("qwen3_moe-sparse"), dtype="float32")
    kinds = [type(layer.mlp).__name__ for layer in engine.runner.model.model.layers]
    assert kinds == ["MLP", "MLP", "MLP", "SparseMoeBlock", "MLP", "SparseMoeBlock"]
    assert engine.runner.routed_experts.shape[1:] == (2, 4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe-sparse"])
def test_routed_experts_equal_hf_router_top_k(arch, tiny_dir):
    engine = make_engine(tiny_dir(arch), dtype="float32")
    hf = load_hf(tiny_dir(arch), torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, return_routed_experts=True)
    for out in engine.generate(PROMPTS[::6], params):
        sample = out.outputs[0]
        fed = out.prompt_token_ids + sample.token_ids[:-1]
        with torch.inference_mode():
            router_logits = hf(torch.tensor([fed]), output_router_logits=True).router_logits
        want = torch.stack([torch.topk(r.float().softmax(-1), 4).indices for r in router_logits], dim=1)
        assert sample.routed_experts.dtype == torch.int32
        assert sample.routed_experts.shape == (len(fed), len(router_logits), 4)
        assert torch.equal(sample.routed_experts, want.int())


def test_routed_experts_survive_prefix_hits_forks_and_preemption(tiny_dir):
    engine = make_engine(tiny_dir("qwen3_moe"), batch_invariant=True, num_kv_blocks=64)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True, seed=3,
                            return_routed_experts=True)
    alone = engine.generate([CHATS[0]], params)[0]
    prompt_len = len(alone.prompt_token_ids)
    a, b = alone.outputs
    assert a.routed_experts.shape == (prompt_len + 23, 3, 4) and a.token_ids != b.token_ids
    assert torch.equal(a.routed_experts[:prompt_len], b.routed_experts[:prompt_len])  # one prefill, forked
    hit = engine.generate([CHATS[0]], params)[0]
    assert hit.num_cached_tokens >= 16
    assert all(torch.equal(x.routed_experts, y.routed_experts) for x, y in zip(alone.outputs, hit.outputs))
    tight = make_engine(tiny_dir("qwen3_moe"), batch_invariant=True, num_kv_blocks=9)
    filler = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=9)
    outs = tight.generate(RAW[4:8] + [CHATS[0]], [filler] * 4 + [params])
    assert outs[-1].outputs[0].num_preemptions + outs[-1].outputs[1].num_preemptions > 0
    assert all(torch.equal(x.routed_experts, y.routed_experts) for x, y in zip(alone.outputs, outs[-1].outputs))


def test_streamed_and_aborted_outputs_carry_the_positions_fed_so_far(tiny_dir):
    engine = make_engine(tiny_dir("qwen3_moe"), dtype="float32")
    rid = engine.add_request(RAW[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                    return_routed_experts=True))
    first = next(o for o in engine.step() if o.request_id == rid).outputs[0]
    prompt_len = first.routed_experts.shape[0]
    engine.step()
    aborted = engine.abort_request(rid).outputs[0]
    assert len(aborted.token_ids) == 2 and aborted.routed_experts.shape[0] == prompt_len + 1
    assert torch.equal(aborted.routed_experts[:prompt_len], first.routed_experts)


def test_rollout_batch_carries_routed_experts_aligned_with_input_ids(tiny_dir):
    rollouts = RolloutEngine(EngineConfig(model=tiny_dir("qwen3_moe"), dtype="float32"))
    prompts = [RAW[0], CHATS[1]]
    batch = rollouts.rollout(prompts, n=2, sampling_params=ROUTED)
    outs = rollouts.engine.generate(prompts, dataclasses.replace(ROUTED, n=2))  # same seed: the same samples
    assert batch.routed_experts.shape == (*batch.input_ids.shape, 3, 4)
    width = batch.prompt_ids.shape[1]
    for row, (out, sample) in enumerate((o, s) for o in outs for s in o.outputs):
        start = width - len(out.prompt_token_ids)
        fed = len(out.prompt_token_ids) + len(sample.token_ids) - 1
        assert torch.equal(batch.routed_experts[row, start:start + fed], sample.routed_experts)
        assert not batch.routed_experts[row, :start].any() and not batch.routed_experts[row, start + fed:].any()
    assert rollouts.rollout(prompts, n=1, sampling_params=GREEDY).routed_experts is None


def test_replay_routing_routes_the_policy_through_the_rollouts_experts(tiny_dir):
    from fp8engine.rl.routing import moe_routers, replay_routing
    from fp8engine.rl.trainer import response_logprobs
    rollouts = RolloutEngine(EngineConfig(model=tiny_dir("qwen3_moe"), dtype="float32"))
    params = dataclasses.replace(ROUTED, logprobs_mode="raw")
    batch = rollouts.rollout([RAW[0], CHATS[1]], n=1, sampling_params=params)
    policy = load_hf(tiny_dir("qwen3_moe"), torch.float32)
    seen = []
    hooks = [r.register_forward_hook(lambda m, args, out: seen.append(out[2])) for r in moe_routers(policy)]
    own = response_logprobs(policy, batch, params)
    with replay_routing(policy, batch.routed_experts):
        replayed = response_logprobs(policy, batch, params)
    mask = batch.attention_mask.bool()
    replay_ids = torch.stack(seen[3:], dim=1).view(*mask.shape, 3, 4)
    assert torch.equal(replay_ids[:, :-1][mask[:, :-1]], batch.routed_experts[:, :-1][mask[:, :-1]].long())
    torch.testing.assert_close(replayed, own, atol=1e-5, rtol=0)  # float32: the engine routed as HF does
    with replay_routing(policy, (batch.routed_experts + 1) % 16):  # someone else's routing changes the policy
        other = response_logprobs(policy, batch, params)
    assert (other - own).abs().max() > 1e-3
    for hook in hooks:
        hook.remove()
    assert all("forward" not in vars(r) for r in moe_routers(policy))


def test_server_returns_routed_experts_as_an_extension_field(tiny_dir):
    from starlette.testclient import TestClient

    from fp8engine.entrypoints.server import ServerSettings, create_app
    engine = make_engine(tiny_dir("qwen3_moe"), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, return_routed_experts=True)
    want = engine.generate([RAW[2]], params)[0].outputs[0].routed_experts
    body = {"prompt": RAW[2], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with TestClient(create_app(engine, ServerSettings())) as client:
        choice = client.post("/v1/completions", json=body | {"return_routed_experts": True}).json()["choices"][0]
        plain = client.post("/v1/completions", json=body).json()["choices"][0]
        chunks = [json.loads(line[6:]) for line in client.post(
            "/v1/completions", json=body | {"return_routed_experts": True, "stream": True}).iter_lines()
            if line.startswith("data: {")]
    assert torch.equal(torch.tensor(choice["routed_experts"], dtype=torch.int32), want)
    assert "routed_experts" not in plain
    streamed = [c["choices"][0]["routed_experts"] for c in chunks if "routed_experts" in c["choices"][0]]
    assert len(streamed) == 1 and streamed[0] == want.tolist()


def test_routed_experts_need_a_moe_model(tiny_dir):
    engine = make_engine(tiny_dir("qwen2"), dtype="float32")
    with pytest.raises(ValueError, match="return_routed_experts=True needs a MoE model; 'qwen2'"):
        engine.generate(["hi"], SamplingParams(max_tokens=2, return_routed_experts=True))


# ------------------------------------------------------------------------------------- FP8 experts
@pytest.fixture(scope="module")
def state_b(tiny_dir) -> dict[str, torch.Tensor]:
    return perturbed_state(tiny_dir("qwen3_moe"), seed=7, scale=0.3)


@pytest.fixture(scope="module")
def fresh_b(tiny_dir, state_b, tmp_path_factory):
    """Greedy rollouts of a fresh FP8 engine on the perturbed weights, and the engine."""
    engine = make_engine(write_checkpoint(tiny_dir("qwen3_moe"), tmp_path_factory.mktemp("moe_b"), state_b),
                         quantization="fp8")
    return rollout(engine), engine


@pytest.fixture()
def engine_a(tiny_dir):
    return make_engine(tiny_dir("qwen3_moe"), quantization="fp8")


def test_fp8_experts_update_in_place_equals_a_fresh_engine(engine_a, state_b, fresh_b):
    before = pointers(engine_a)
    assert rollout(engine_a) != fresh_b[0]
    items = list(state_b.items())
    random.Random(0).shuffle(items)
    report = engine_a.update_weights(iter(items), weight_version=2)
    num_experts = sum(".experts." in n for n in state_b)
    assert report.num_quantized == num_experts + 3 * 4 and num_experts == 3 * 16 * 3  # + q, k, v, o
    assert pointers(engine_a) == before
    assert same_tensors(snapshot(engine_a), snapshot(fresh_b[1]))
    assert rollout(engine_a) == fresh_b[0]


def test_stacked_transformers5_names_update_like_per_expert_ones(engine_a, state_b, fresh_b, tiny_dir, tmp_path):
    hf = load_hf(write_checkpoint(tiny_dir("qwen3_moe"), tmp_path / "b", state_b), torch.bfloat16)
    state = hf.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (16, 128, 128)
    before = pointers(engine_a)
    engine_a.update_weights(state)
    assert pointers(engine_a) == before and same_tensors(snapshot(engine_a), snapshot(fresh_b[1]))
    got = engine_a.get_weights_by_name("model.layers.0.mlp.experts.gate_up_proj")
    assert torch.equal(got[3, 64:], engine_a.get_weights_by_name("model.layers.0.mlp.experts.3.up_proj.weight"))


def test_prequantized_expert_pairs_are_copied_as_they_are(engine_a, state_b, fresh_b):
    report = engine_a.update_weights(prequantized_items(state_b))
    assert report.num_quantized == 0 and same_tensors(snapshot(engine_a), snapshot(fresh_b[1]))


def _with_nan(t: torch.Tensor, index) -> torch.Tensor:
    t = t.clone()
    t[index] = float("nan")
    return t


@pytest.mark.parametrize("case,match", [
    ("nan", f"weight '{EXPERT}': contains NaN"),
    ("stacked-nan", f"weight '{EXPERT}': contains NaN"),
    ("shape", f"weight '{EXPERT}': shape \\(64, 64\\)"),
    ("unknown", "unknown weight name 'model.layers.1.mlp.experts.16.up_proj.weight'"),
    ("scale-alone", f"{EXPERT}_scale_inv given without its float8_e4m3fn weight"),
])
def test_bad_expert_updates_raise_and_change_nothing(engine_a, state_b, case, match):
    items = dict(state_b)
    if case == "nan":
        items[EXPERT] = _with_nan(items[EXPERT], (3, 5))
    elif case == "stacked-nan":
        stacked = torch.randn(16, 128, 128).bfloat16()
        items["model.layers.1.mlp.experts.gate_up_proj"] = _with_nan(stacked, (7, 64 + 3, 5))
    elif case == "shape":
        items[EXPERT] = torch.zeros(64, 64)
    elif case == "unknown":
        items["model.layers.1.mlp.experts.16.up_proj.weight"] = items[EXPERT]
    else:
        items[EXPERT + "_scale_inv"] = torch.ones(1, 1)
    before, outputs = snapshot(engine_a), rollout(engine_a)
    with pytest.raises(ValueError, match=match):
        engine_a.update_weights(items)
    assert same_tensors(snapshot(engine_a), before) and rollout(engine_a) == outputs


def test_prequantized_fp8_moe_checkpoint_loads_as_is(tiny_dir, state_b, fresh_b, tmp_path):
    state = {}
    for name, tensor in state_b.items():  # every projection and expert; the router and the head stay BF16
        if name.endswith("proj.weight"):
            state[name], state[name + "_scale_inv"] = quantize_weight_blockwise(tensor)
        else:
            state[name] = tensor
    path = tmp_path / "fp8"
    write_checkpoint(tiny_dir("qwen3_moe"), path, state)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    engine = make_engine(str(path), quantization="fp8")
    experts = engine.runner.model.model.layers[1].mlp.experts
    _, scale = experts.shard_views(7, "up_proj")
    weight = layout.rows_of(*experts.fp8_matrix(7, "up_proj"), state[EXPERT].shape[0])  # (nt16 where the kernels say)
    assert torch.equal(weight.view(torch.uint8), state[EXPERT].view(torch.uint8))
    assert torch.equal(scale, state[EXPERT + "_scale_inv"])
    assert same_tensors(snapshot(engine), snapshot(fresh_b[1])) and rollout(engine) == fresh_b[0]
    with pytest.raises(ValueError, match="is FP8-quantized \\(quantization_config\\); use EngineConfig"):
        make_engine(str(path))
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported checkpoint quantization.*weight_block_size=\\[64, 64\\]"):
        make_engine(str(path), quantization="fp8")


# ------------------------------------------------------------------------------------- batch invariance
def test_a_token_does_not_depend_on_how_many_share_its_expert():
    """batch_invariant: each expert GEMM takes the kernels' one path, so a row's result is the same whatever
    other rows (and how many) its experts see."""
    require_cpu_op("fp8_block_linear")
    for fp8 in (False, True):
        kernels = cpu_kernels(quantization="fp8" if fp8 else None, batch_invariant=True)
        layer = FusedMoE(8, 256, 128, torch.bfloat16, kernels, fp8)
        load_random_experts(layer, seed=2)
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(64, 256, generator=gen).bfloat16()
        ids, weights = route(torch.randn(64, 8, generator=gen).bfloat16(), 2, normalize=False)
        full = layer(x, ids, weights)
        for rows in (slice(0, 1), slice(5, 8), slice(10, 40)):
            assert torch.equal(layer(x[rows], ids[rows], weights[rows]), full[rows])


@pytest.mark.parametrize("options", [dict(), dict(quantization="fp8")], ids=["bf16", "fp8"])
def test_moe_requests_do_not_depend_on_their_batch(options, tiny_dir):
    engine = make_engine(tiny_dir("qwen3_moe"), batch_invariant=True, **options)
    targets = [CHATS[0], RAW[1], RAW[6]]

    def result(out):
        sample = out.outputs[0]
        return sample.token_ids, sample.logprobs, sample.routed_experts.tolist()
    alone = [result(engine.generate([p], ROUTED)[0]) for p in targets]
    filler = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=9)
    outs = engine.generate(targets + CHATS[2:10] + RAW[:8], [ROUTED] * 3 + [filler] * 16)
    assert [result(o) for o in outs[:3]] == alone
    chunked = make_engine(tiny_dir("qwen3_moe"), batch_invariant=True, max_num_batched_tokens=16, **options)
    assert [result(o) for o in chunked.generate(targets, ROUTED)] == alone


def test_bench_runs_any_supported_directory_side_by_side(tiny_dir, tmp_path):
    from fp8engine.bench import throughput
    report = throughput.run("quick", ["bf16", "fp8-linear"], model=tiny_dir("qwen3_moe"), progress=False)
    assert [r["mode"] for r in report["results"]] == ["bf16", "fp8-linear"]
    assert all(r["output_tokens"] == 8 * 2 * 32 for r in report["results"])
    assert report["model"] == tiny_dir("qwen3_moe")
    assert throughput.workload_model(throughput.WORKLOADS["moe"], "/a/dir") == "/a/dir"
    no_template = type("Tok", (), {"chat_template": None})()
    assert throughput.prompts_for(no_template, 2) == [p[0]["content"] for p in throughput.rl_prompts(2)]
