#!/usr/bin/env bash
# veRL's environment for tests/integrations (make test-integrations): a venv at $1 (default
# ~/.cache/fp8engine/verl-venv), reused when it already imports verl and fp8engine. CPU torch first, from pip's
# find-links (a bare `pip install verl` would pull CUDA torch); then verl[verl-core] (it pins
# transformers>=5.5.3,<5.11, hence an environment of its own); then this checkout, editable and without its
# dependencies, plus those of fp8engine's own that veRL did not bring.
set -euo pipefail
VENV="${1:-$HOME/.cache/fp8engine/verl-venv}"
CHECKOUT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PY:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VERL_VERSION="${VERL_VERSION:-0.9.1}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -P - "$CHECKOUT" <<'PY' 2>/dev/null; then
import sys, pathlib, verl, fp8engine
assert verl.__version__ == "0.9.1"
assert pathlib.Path(fp8engine.__file__).resolve().parents[1] == pathlib.Path(sys.argv[1]).resolve()
PY
    echo "verl-venv: $VENV (reused)"
    exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q "verl[verl-core]==$VERL_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q --no-deps -e "$CHECKOUT"
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION" xgrammar ninja jinja2 filelock pytest
"$VENV/bin/python" -c "import torch, verl, fp8engine; print('verl-venv:', '$VENV', 'torch', torch.__version__, 'verl', verl.__version__)"
