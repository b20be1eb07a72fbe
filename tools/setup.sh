#!/usr/bin/env bash
# Create .venv (or $GRADGRAPH_VENV) with gradgraph and its test dependencies.
#   bash tools/setup.sh
# torch is installed first, pinned, so pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GRADGRAPH_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  "$VENV/bin/pip" install -q torch==2.13.0
fi
echo "[setup] installing gradgraph with test extras"
"$VENV/bin/pip" install -q -e ".[test,torch]"
echo "[setup] ready: $VENV ($("$VENV/bin/python" -c 'import onnxruntime, onnx; print("onnx", onnx.__version__, "onnxruntime", onnxruntime.__version__)'))"
