"""update_weights: in place, validated before writing, equal to a fresh engine on the new weights."""

import random

import pytest
import torch

from fp8engine import SamplingParams
from fp8engine.weights.quant import quantize_weight_blockwise
from tests.checkpoints import perturbed_state, prequantized_items, write_checkpoint
from tests.conftest import make_engine
from tests.prompts import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, logprobs_mode="raw")
PROMPT_SET = PROMPTS[::3]


def rollout(engine):
    outs = engine.generate(PROMPT_SET, GREEDY)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_same(a, b, tol=1e-5):
    assert a[0] == b[0]
    diffs = [abs(x - y) for la, lb in zip(a[1], b[1]) for x, y in zip(la, lb)]
    assert max(diffs) <= tol


def buckets(items, size):
    for i in range(0, len(items), size):
        yield from items[i:i + size]


def pointers(engine):
    return {name: p.data_ptr() for name, p in engine.named_parameters()}


@pytest.fixture(scope="module")
def state_b(default_dir):
    return perturbed_state(default_dir, seed=7)


@pytest.fixture(scope="module")
def dir_b(default_dir, state_b, tmp_path_factory):
    return write_checkpoint(default_dir, tmp_path_factory.mktemp("ckpt_b"), state_b)


@pytest.fixture(scope="module")
def fresh_b(dir_b):
    return rollout(make_engine(dir_b, quantization="fp8"))


@pytest.fixture()
def engine_a():
    return make_engine("default", quantization="fp8")


def test_bf16_update_in_small_shuffled_buckets_equals_fresh_engine(engine_a, state_b, fresh_b):
    before = pointers(engine_a)
    items = list(state_b.items())
    random.Random(0).shuffle(items)
    report = engine_a.update_weights(buckets(items, 5), weight_version=3)
    assert pointers(engine_a) == before
    assert report.weight_version == 3 and report.num_tensors == len(items)
    assert report.num_quantized == 30 * 7
    assert report.num_bytes == sum(t.numel() * t.element_size() for _, t in items)
    assert_same(rollout(engine_a), fresh_b)
    assert engine_a.generate(["hi"], GREEDY)[0].weight_version == 3


def test_prequantized_update_equals_fresh_engine(engine_a, state_b, fresh_b):
    before = pointers(engine_a)
    report = engine_a.update_weights(prequantized_items(state_b))
    assert report.num_quantized == 0 and pointers(engine_a) == before
    assert_same(rollout(engine_a), fresh_b)


def test_partial_update_equals_fresh_engine_on_mixed_checkpoint(engine_a, default_dir, state_b, tmp_path):
    from fp8engine.weights.loader import iter_safetensors
    partial = {k: v for k, v in state_b.items() if k.startswith(tuple(f"model.layers.{i}." for i in range(10)))}
    mixed = dict(iter_safetensors(default_dir)) | partial
    expected = rollout(make_engine(write_checkpoint(default_dir, tmp_path / "mixed", mixed), quantization="fp8"))
    engine_a.update_weights(partial)
    assert_same(rollout(engine_a), expected)


def test_get_weights_by_name_returns_dequantized_hf_shape(engine_a, state_b):
    name = "model.layers.3.self_attn.k_proj.weight"
    engine_a.update_weights({name: state_b[name], "model.norm.weight": state_b["model.norm.weight"]})
    got = engine_a.get_weights_by_name(name)
    assert got.shape == (192, 576) and got.dtype == torch.bfloat16
    from fp8engine.weights.quant import dequantize_weight_blockwise
    q, s = quantize_weight_blockwise(state_b[name])
    assert torch.equal(got, dequantize_weight_blockwise(q, s, torch.bfloat16))
    assert torch.equal(engine_a.get_weights_by_name("model.norm.weight"), state_b["model.norm.weight"])


def _with(t: torch.Tensor, index: tuple[int, int], value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _raising_generator(items):
    yield from items[:20]
    raise RuntimeError("trainer died halfway")


@pytest.mark.parametrize("case,error,match", [
    ("unknown", ValueError, "unknown weight name 'model.layers.0.self_attn.z_proj.weight'"),
    ("shape", ValueError, "'model.layers.2.mlp.up_proj.weight': shape"),
    ("dtype", ValueError, "'model.layers.2.mlp.up_proj.weight': dtype torch.int32"),
    ("nan", ValueError, "'model.layers.5.self_attn.o_proj.weight': contains NaN"),
    ("generator", RuntimeError, "trainer died halfway"),
    ("fp8_without_scale", ValueError, "_scale_inv is missing"),
    ("inf", ValueError, "'model.layers.7.mlp.down_proj.weight': contains NaN or Inf"),
    ("scale_not_positive", ValueError, "'model.layers.2.mlp.up_proj.weight_scale_inv': scales must be positive"),
    ("scale_without_weight", ValueError, "up_proj.weight_scale_inv given without its float8_e4m3fn weight"),
])
def test_bad_update_raises_and_changes_nothing(engine_a, state_b, case, error, match):
    before_out = rollout(engine_a)
    before = {n: p.detach().clone() for n, p in engine_a.named_parameters()}
    items = list(state_b.items())
    up = "model.layers.2.mlp.up_proj.weight"
    bad = {
        "unknown": items + [("model.layers.0.self_attn.z_proj.weight", torch.zeros(4, 4))],
        "shape": items + [(up, torch.zeros(1536, 575, dtype=torch.bfloat16))],
        "dtype": items + [(up, torch.zeros(1536, 576, dtype=torch.int32))],
        "nan": items + [("model.layers.5.self_attn.o_proj.weight",
                         torch.full((576, 576), float("nan"), dtype=torch.bfloat16))],
        "generator": _raising_generator(items),
        "fp8_without_scale": items + [(up, quantize_weight_blockwise(state_b[up])[0])],
        "inf": items + [("model.layers.7.mlp.down_proj.weight", _with(state_b["model.layers.7.mlp.down_proj.weight"],
                                                                      (300, 1000), float("-inf")))],
        "scale_not_positive": items + [(up, quantize_weight_blockwise(state_b[up])[0]),
                                       (up + "_scale_inv", _with(quantize_weight_blockwise(state_b[up])[1], (3, 2), 0.0))],
        "scale_without_weight": items + [(up + "_scale_inv", quantize_weight_blockwise(state_b[up])[1])],
    }[case]
    with pytest.raises(error, match=match):
        engine_a.update_weights(bad, weight_version=99)
    assert engine_a.weight_version == 0
    for name, p in engine_a.named_parameters():
        assert torch.equal(p.detach().view(torch.uint8), before[name].view(torch.uint8)), name
    assert rollout(engine_a) == before_out


def test_in_flight_requests_wait_or_abort(engine_a, state_b):
    rid = engine_a.add_request("Count to ten:", SamplingParams(max_tokens=30, ignore_eos=True))
    engine_a.step()
    engine_a.update_weights(state_b, in_flight="wait")
    finished = [o for o in engine_a.step() if o.request_id == rid]
    assert finished[0].finished and finished[0].weight_version == 0
    assert len(finished[0].outputs[0].token_ids) == 30
    rid = engine_a.add_request("Count to ten:", SamplingParams(max_tokens=30, ignore_eos=True))
    engine_a.step()
    report = engine_a.update_weights(state_b, in_flight="abort")
    assert report.num_aborted == 1
    aborted = [o for o in engine_a.step() if o.request_id == rid]
    assert aborted[0].outputs[0].finish_reason == "abort" and aborted[0].weight_version == 1
    stats = engine_a.get_stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total and stats.weight_version == 2


def test_prequantized_checkpoint_loads_as_is(default_dir, state_b, fresh_b, tmp_path):
    state = {}
    for name, tensor in state_b.items():
        if name.endswith("proj.weight"):
            state[name], state[name + "_scale_inv"] = quantize_weight_blockwise(tensor)
        else:
            state[name] = tensor
    engine = make_engine(write_checkpoint(default_dir, tmp_path / "fp8_ckpt", state), quantization="fp8")
    assert_same(rollout(engine), fresh_b)
    with pytest.raises(ValueError, match="use EngineConfig\\(quantization='fp8'\\)"):
        make_engine(str(tmp_path / "fp8_ckpt"))


def test_a_broadcast_update_is_quantized_as_it_arrives_and_equals_update_weights(engine_a, state_b, monkeypatch):
    """The weight-update group's receive hands each tensor to the engine's Prequantizer: FP8-bound weights are kept
    as E4M3 codes and scales from the moment they arrive (not the BF16 model until the commit), and the update
    writes every byte update_weights writes; a NaN is still refused by its own name, with nothing changed. The
    broadcast is stood in for by a copy from the trainer's tensors (tests/test_cluster.py runs real gloo groups)."""
    from torch import distributed as dist

    from fp8engine.weights import dist_update
    items = sorted(state_b.items())[:40]
    sent = iter([])

    def broadcast(tensor, src, group):
        tensor.copy_(next(sent))
    monkeypatch.setattr(dist, "broadcast", broadcast)
    engine_a.weights_update_group = dist_update.WeightsUpdateGroup.__new__(dist_update.WeightsUpdateGroup)
    engine_a.weights_update_group.device = "cpu"
    engine_a.weights_update_group.group = None

    held = []
    receive = dist_update.WeightsUpdateGroup.receive

    def watched(self, names, dtypes, shapes, transform=None):
        out = receive(self, names, dtypes, shapes, transform)
        held.extend(out)
        return out
    monkeypatch.setattr(dist_update.WeightsUpdateGroup, "receive", watched)
    names, dtypes, shapes = [n for n, _ in items], [str(t.dtype).removeprefix("torch.") for _, t in items], \
        [list(t.shape) for _, t in items]
    sent = (dist_update._wire(t) for _, t in items)
    report = engine_a.update_weights_from_distributed(names, dtypes, shapes, weight_version=5)
    fp8_bound = [n for n, t in items if n.endswith("proj.weight")]
    assert fp8_bound and report.num_tensors == len(items) and report.num_quantized == len(fp8_bound)
    assert report.num_bytes == sum(t.numel() * t.element_size() for _, t in items)
    assert {n: t.dtype for n, t in held if n in fp8_bound} == {n: torch.float8_e4m3fn for n in fp8_bound}
    held_fp8 = sum(t.numel() * t.element_size() for n, t in held if n.removesuffix("_scale_inv") in fp8_bound)
    assert held_fp8 < 0.52 * sum(t.numel() * t.element_size() for n, t in items if n in fp8_bound)
    via_group = {n: engine_a.get_weights_by_name(n) for n, _ in items}
    codes = [p.detach().clone() for _, p in engine_a.named_parameters()]

    other = make_engine("default", quantization="fp8")
    other.update_weights(dict(items), weight_version=5)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               for a, (_, b) in zip(codes, other.named_parameters()))
    assert all(torch.equal(via_group[n], other.get_weights_by_name(n)) for n in via_group)

    bad = [(n, t.clone()) for n, t in items]
    bad[3][1].view(-1)[0] = float("nan")
    sent = (dist_update._wire(t) for _, t in bad)
    with pytest.raises(ValueError, match=f"weight '{bad[3][0]}': contains NaN or Inf"):
        engine_a.update_weights_from_distributed(names, dtypes, shapes, weight_version=6)
    assert engine_a.weight_version == 5
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               for a, (_, b) in zip(codes, engine_a.named_parameters()))
