"""A wheel (and an sdist) carries the C++ sources; installed outside the checkout, the package builds them on first
use exactly as a checkout does (same cache key, hence the same build) and its engine runs the C++ kernels; without
the sources it warns and runs the torch reference, or fails under FP8ENGINE_REQUIRE_CPP=1."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from fp8engine.model_executor.kernels import cpu_ops
from tests.conftest import cpu_can_build

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p.name for p in cpu_ops.CSRC_DIR.iterdir() if p.suffix in (".cpp", ".h"))

# Run in the installed copy: an FP8 engine on the default model, its kernel names and where it built from.
ENGINE = """
import json, fp8engine
from fp8engine import EngineConfig, LLMEngine, SamplingParams
from fp8engine.model_executor.kernels import cpu_ops
engine = LLMEngine(EngineConfig(quantization="fp8", num_kv_blocks=16))
out = engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
sources = sorted(cpu_ops.CSRC_DIR.glob("*.cpp")) + sorted(cpu_ops.CSRC_DIR.glob("*.h"))
print(json.dumps({"package": fp8engine.__file__, "csrc": str(cpu_ops.CSRC_DIR), "kernels": engine.get_stats().kernels,
                  "tokens": out[0].outputs[0].token_ids,
                  "build_dir": str(cpu_ops.build_dir(sources)) if sources else None}))
"""


def _run(site: Path, cwd: Path, require_cpp: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site), FP8ENGINE_REQUIRE_CPP=require_cpp, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", ENGINE], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project built as a wheel and installed (without dependencies) into a fresh directory."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    (wheel,) = out.glob("fp8engine-*.whl")
    site = out / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    return site


def test_the_wheel_and_the_sdist_carry_the_sources(installed, tmp_path):
    assert sorted(p.name for p in (installed / "fp8engine" / "csrc").iterdir()) == SOURCES
    build = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"
    sdist = subprocess.run([sys.executable, "-c", build], cwd=ROOT, check=True, capture_output=True, text=True,
                           timeout=600).stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / sdist) as tar:
        names = sorted(Path(n).name for n in tar.getnames() if "/fp8engine/csrc/" in n)
    assert names == SOURCES


def test_an_installed_engine_runs_the_cpp_kernels_it_built_as_a_checkout_does(installed, tmp_path):
    if cpu_ops.load_cpu_ops() is None:
        pytest.skip("this machine cannot build the C++ kernels")
    got = _run(installed, tmp_path, "1")
    assert got.returncode == 0, got.stderr[-3000:]
    report = json.loads(got.stdout.strip().splitlines()[-1])
    assert Path(report["package"]).is_relative_to(installed) and Path(report["csrc"]).is_relative_to(installed)
    here = sorted(cpu_ops.CSRC_DIR.glob("*.cpp")) + sorted(cpu_ops.CSRC_DIR.glob("*.h"))
    assert report["build_dir"] == str(cpu_ops.build_dir(here))  # the same key: the checkout's build is reused
    kernels = report["kernels"]
    assert kernels["fp8_linear"].startswith("cpp-") and kernels["attention"] == "cpp", kernels
    sampler = "cpp+torch" if cpu_can_build("sample_rows") else "torch"  # the fused sampler needs AVX-512 or AVX2
    assert kernels["layer_ops"] == "cpp" and kernels["sampler"] == sampler, kernels
    assert len(report["tokens"]) == 3


def test_without_the_sources_it_warns_or_fails_when_required(installed, tmp_path):
    site = shutil.copytree(installed, tmp_path / "site")
    for src in (site / "fp8engine" / "csrc").iterdir():
        src.unlink()
    failed = _run(site, tmp_path, "1")
    assert failed.returncode != 0
    assert "failed to build and FP8ENGINE_REQUIRE_CPP=1: no C++ sources in" in failed.stderr
    warned = _run(site, tmp_path, "0")
    assert warned.returncode == 0, warned.stderr[-3000:]
    assert "C++ CPU kernels unavailable (no C++ sources in" in warned.stderr
    assert warned.stderr.count("C++ CPU kernels unavailable") == 1  # once
    report = json.loads(warned.stdout.strip().splitlines()[-1])
    assert report["kernels"]["fp8_linear"] == "torch-reference" and report["kernels"]["attention"] == "torch"
    assert len(report["tokens"]) == 3
