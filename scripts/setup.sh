#!/usr/bin/env bash
# Create .venv and install the project (CPU stack) with its test tools. Idempotent.
# Everything comes from the default package registry (or whichever your own pip configuration
# names); nothing is downloaded at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned to a CPU-only build where one is available, so the project's torch range is
# already met and pip does not pull a CUDA build (several GB) for a CPU machine. On a GPU host
# install the CUDA torch that matches the driver instead, then `pip install -e .[gpu]`.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>/dev/null \
    || .venv/bin/python -m pip install -q "torch>=2.2"
fi
.venv/bin/python -m pip install -q -e ".[test]"
# the gRPC modules are generated at development time and committed: check they match proto/
.venv/bin/python -m server.rpc.codegen --check
