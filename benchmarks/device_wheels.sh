#!/usr/bin/env bash
# Wheels for a GPU machine without network (docs/gpu.md, "Running it on a lent device"): the server's packages and
# the openai client, which that machine's image lacks, at the versions installed here, for its Python (3.12 by
# default), into .whl/ (git-ignored). Its own torch, Triton and transformers are used as they are.
# Usage: bash benchmarks/device_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=${1:-3.12}
packages=(fastapi starlette pydantic pydantic-core typing-inspection annotated-types annotated-doc uvicorn openai
          httpx2 httpcore2 truststore jiter distro sniffio anyio httpx httpcore h11 opentelemetry-api
          typing-extensions idna certifi)
pins=()
for name in "${packages[@]}"; do
    version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    pins+=("$name${version:+==$version}")
done
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl
