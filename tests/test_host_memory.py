"""The weights of a CPU engine live on one mapping of its own, advised for transparent huge pages when they are
big enough (model_executor/host_memory.py): values, ties and in-place updates are what they are on small pages,
where FP8ENGINE_HUGE_PAGES=0 keeps them."""

import glob

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fp8engine import SamplingParams
from fp8engine.model_executor import host_memory
from tests.conftest import make_engine
from tests.tiny_models import tiny_dir  # noqa: F401 (fixture)

needs_thp = pytest.mark.skipif(not host_memory.available(), reason="no transparent huge pages on this machine")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_arena_is_zeroed_aligned_and_advised():
    memory = host_memory.arena(3 * host_memory.HUGE_PAGE + 5)
    assert memory.numel() == 3 * host_memory.HUGE_PAGE + 5 and memory.dtype == torch.uint8
    assert memory.data_ptr() % host_memory.HUGE_PAGE == 0 and int(memory.sum()) == 0
    assert "hg" in vm_flags(memory.data_ptr())  # MADV_HUGEPAGE


@needs_thp
def test_rehome_moves_whole_tensors_and_keeps_shared_storage_shared():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=True), nn.LayerNorm(3))
    model[1].weight = model[0].weight  # tied
    model.register_buffer("table", torch.arange(12, dtype=torch.int16))
    model.register_buffer("head", model.table[:6])  # a view of another buffer's storage
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ptrs = {name: t.data_ptr() for name, t in model.state_dict().items()}

    assert host_memory.rehome(model, min_bytes=449) is None  # less than that to move: nothing moves
    home = host_memory.rehome(model, min_bytes=448)
    moved = home.moved

    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) and before[name].dtype == after[name].dtype for name in before)
    assert model[1].weight is model[0].weight
    # the tied weight, the bias and the norm's two tensors move, each on a 64-byte boundary of one arena; the
    # buffer and the view of it that shares its storage stay where they were
    homed = [model[0].weight, model[1].bias, model[2].weight, model[2].bias]
    assert moved == 64 * (4 + 1 + 1 + 1)  # 240 bytes of weight: 4 lines; 40 of bias, 12 and 12 of the norm: 1 each
    assert len({t.untyped_storage().data_ptr() for t in homed}) == 1
    assert all(t.data_ptr() % 64 == 0 for t in homed)
    assert after["table"].data_ptr() == ptrs["table"] and after["head"].data_ptr() == ptrs["head"]
    model[1].weight.data.add_(1)  # an in-place write lands in the arena, seen through the tie
    assert torch.equal(model[0].weight, before["0.weight"] + 1)


@needs_thp
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_engine_outputs_and_updates_are_those_of_small_pages(tiny_dir, monkeypatch,  # noqa: F811
                                                                     quantization):
    """Tokens and logprobs bit for bit with and without huge pages, before and after an in-place update that
    keeps every weight where it is."""
    model = tiny_dir("llama-yarn")
    prompts = [list(range(100, 131)), [5, 6, 7]]
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3, logprobs=2)
    gen = torch.Generator().manual_seed(5)
    state = {}
    for path in glob.glob(f"{model}/*.safetensors"):
        state |= load_file(path)
    update = {name: t + torch.randn(t.shape, generator=gen).to(t.dtype) * 0.05
              for name, t in state.items() if t.dim() == 2}

    monkeypatch.setattr(host_memory, "MIN_BYTES", 0)  # the tiny model's 26 MB move too

    def outputs(huge: str):
        monkeypatch.setenv("FP8ENGINE_HUGE_PAGES", huge)
        engine = make_engine(model, quantization=quantization)
        assert engine.get_stats().kernels["host_memory"] == ("huge-pages" if huge == "1" else "mapping")
        weights = dict(engine.runner.model.named_parameters())
        where = {name: p.data_ptr() for name, p in weights.items()}
        first = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.generate(prompts, params)]
        engine.update_weights(update)
        assert {name: p.data_ptr() for name, p in weights.items()} == where
        second = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.generate(prompts, params)]
        return engine, first, second

    huge, *with_huge = outputs("1")
    plain, *without = outputs("0")
    assert with_huge == without and with_huge[0] != with_huge[1]
    proj = huge.runner.model.model.layers[0].mlp.down_proj.weight
    assert "hg" in vm_flags(proj.data_ptr())
    assert "hg" not in vm_flags(plain.runner.model.model.layers[0].mlp.down_proj.weight.data_ptr())
