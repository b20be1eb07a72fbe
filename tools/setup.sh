#!/usr/bin/env bash
# Create .venv (or $GRADGRAPH_VENV) with gradgraph and its test dependencies.
#   bash tools/setup.sh
# One line per step, then a "ready" line. pip's own output goes to a log file whose path is
# printed only when a step fails. torch is installed first, pinned, so pip never pulls a CUDA
# build. A venv already set up for this clone and the same pyproject.toml (recorded in
# $VENV/.gradgraph-setup) is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GRADGRAPH_VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
LOG="$(mktemp "${TMPDIR:-/tmp}/gradgraph-setup.XXXXXX.log")"

# step "what it does" command...: one line; the command's output to the log; on failure the
# log's path and its last lines, and the script stops.
step() {
  local what="$1"
  shift
  echo "[setup] $what"
  if ! "$@" >>"$LOG" 2>&1; then
    echo "[setup] failed: $what; the whole output is in $LOG; its end:" >&2
    tail -n 15 "$LOG" >&2
    exit 1
  fi
}

stamp_file="$VENV/.gradgraph-setup"
wanted="$(cat pyproject.toml "$0" | cksum | cut -d' ' -f1) $TORCH_PIN $(pwd)"
if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV" "$PY" -m venv "$VENV"
fi
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$wanted" ] \
    || ! "$VENV/bin/python" -c "import gradgraph, onnxruntime" >/dev/null 2>&1; then
  step "upgrading pip" "$VENV/bin/python" -m pip install --upgrade pip
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    step "installing $TORCH_PIN (CPU)" "$VENV/bin/python" -m pip install "$TORCH_PIN"
  fi
  step "installing gradgraph with its torch and test extras" \
    "$VENV/bin/python" -m pip install -e ".[test,torch]"
  echo "$wanted" >"$stamp_file"
fi
rm -f "$LOG"
echo "[setup] ready: $VENV ($("$VENV/bin/python" -c 'import onnxruntime, onnx; print("onnx", onnx.__version__, "onnxruntime", onnxruntime.__version__)'))"
