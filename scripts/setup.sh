#!/usr/bin/env bash
# Create .venv and install the project (CPU stack) with its test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch first, so the dependency range below is already met and no CUDA build
# (several GB) is pulled. On a GPU host install the CUDA torch instead and `pip install -e .[gpu]`.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>/dev/null \
    || .venv/bin/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import server.rpc"  # compile the .proto files (server/rpc/codegen.py)
