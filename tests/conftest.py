import gc
import importlib.util
import os
import random
import shutil
import sys
import zlib

import pytest
import torch

from fp8engine.model_executor.kernels.cpu_ops import cpu_flags  # noqa: F401 (tests import it from here)


def _sibling(name: str):
    """This directory's module `name`, loaded by its path: `from tests import ...` finds whichever `tests` package
    comes first on sys.path, and veRL's wheel installs one into site-packages (test-integrations runs this conftest
    in veRL's venv, from /tmp). Loaded once: the tests that import this file as tests.conftest run it again."""
    key = f"fp8engine_tests_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(os.path.dirname(__file__), f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[key] = module
    return sys.modules[key]


interpreter = _sibling("interpreter")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_sessionstart(session):
    """With FP8ENGINE_REQUIRE_CPP=1 (`make test`, CI) a C++ build that fails stops the run at once, with the
    compiler's error, instead of failing every test that needs a kernel one build attempt at a time."""
    from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops, require_cpp
    if require_cpp():
        try:
            load_cpu_ops()
        except RuntimeError as exc:
            pytest.exit(str(exc), returncode=3)


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module():
    """What a module's engines held goes back to the OS when it ends: the engines themselves are freed (nothing
    in the engine or the server keeps one alive), but glibc keeps freed heap pages mapped until trimmed, so the
    suite's RSS would grow by the peak of each module in turn."""
    yield
    from fp8engine.entrypoints.server import trim_heap
    gc.collect()
    trim_heap()


@pytest.fixture(autouse=True)
def _fast_interpreter_helpers():
    """Once a test module has imported Triton (each sets TRITON_INTERPRET first where it wants the interpreter), its
    helpers skip the interpreter's redundant re-patching (tests/interpreter.py)."""
    if "triton" in sys.modules:
        interpreter.install()


@pytest.fixture(autouse=True)
def _seed_each_test(request):
    """Each test draws from generators seeded by its own id, so its data does not depend on which tests
    ran before it (or in which order)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


def cpu_can_build(op: str) -> bool:
    """Whether this machine can build and run csrc/'s op: a C++ compiler, plus the instruction sets the
    op is compiled under (csrc/*.cpp register it only inside those #if blocks)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return False
    flags = cpu_flags()
    avx2 = {"avx2", "fma", "f16c"} <= flags
    if op in ("bf16_linear", "paged_attention", "write_kv_cache", "sample_rows") and avx2:  # AVX2 kernels where AVX-512 falls short
        return True
    needs = {"bf16_linear": {"avx512_bf16"}, "fp8_block_linear": set(), "fp8_quantize_weight_": set(),
             "fp8_block_scales_": set(), "fp8_linear_isa": set(), "amx_usable": set(), "gdn_recurrent_": set()}.get(
        op, {"avx512f", "avx512bw", "avx512vl"})
    return needs <= flags


def require_cpu_op(op: str):
    """torch.ops.fp8engine.<op>. Skips only where this machine cannot build it; where it can, a missing op
    fails the test instead of letting the torch fallback pass (FP8ENGINE_REQUIRE_CPP=1 also fails the build)."""
    from fp8engine.model_executor.kernels.cpu_ops import cpu_kernel
    kernel = cpu_kernel(op)
    if kernel is None:
        if cpu_can_build(op):
            pytest.fail(f"this machine can build the C++ op {op!r} but it did not load: is csrc/ broken?")
        pytest.skip(f"this machine cannot build the C++ op {op!r}")
    return kernel


class _OpsWithout:
    """torch.ops.fp8engine without some ops, as on a CPU or a build that lacks them."""

    def __init__(self, ops, missing: tuple[str, ...]):
        self._ops, self._missing = ops, set(missing)

    def __getattr__(self, name: str):
        if name in self._missing:
            raise AttributeError(name)
        return getattr(self._ops, name)


def ops_without(*missing: str):
    """A stand-in for cpu_ops.load_cpu_ops whose ops lack `missing` (monkeypatch it into kernel_set.cpu_ops)."""
    from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops
    ops = _OpsWithout(load_cpu_ops(), missing)
    return lambda: ops


def cpu_kernels(**options):
    """The kernel set an engine with these EngineConfig options chooses on this machine (layers built in tests
    are given it)."""
    from fp8engine import EngineConfig
    from fp8engine.model_executor import kernel_set
    return kernel_set.select(EngineConfig(**options))


@pytest.fixture(scope="session")
def default_dir() -> str:
    from fp8engine import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_dir)


def make_engine(model: str = "default", **kwargs):
    from fp8engine import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(model=model, **kwargs))


@pytest.fixture(scope="session")
def _shared_bf16():
    return make_engine(dtype="bfloat16")


@pytest.fixture(scope="session")
def _shared_fp32():
    return make_engine(dtype="float32")


def fresh_state(engine):
    """A shared engine as a test should find it: nothing queued and an empty prefix cache, so what a test
    computes does not depend on what ran before it."""
    assert not engine.has_unfinished_requests()
    engine.flush_prefix_cache()
    return engine


@pytest.fixture()
def engine_bf16(_shared_bf16):
    yield fresh_state(_shared_bf16)
    for request_id in list(_shared_bf16.requests):  # a failed test may leave requests behind
        _shared_bf16.abort_request(request_id)


@pytest.fixture()
def engine_fp32(_shared_fp32):
    yield fresh_state(_shared_fp32)
    for request_id in list(_shared_fp32.requests):
        _shared_fp32.abort_request(request_id)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, default_dir, tokenizer) -> str:
    """A tiny random-initialised Qwen3 (fixed seed) with the default model's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(1234)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
