#!/usr/bin/env bash
# Create (or confirm) the onnxruntime-training reference virtual environment.
#
# onnxruntime-training-cpu ships a module named `onnxruntime`, like stock onnxruntime, so it
# lives in its own venv; tests/test_ort_training.py runs tools/ort_training_worker.py there.
#
#   tools/setup_ort_training.sh            # -> <repo>/.venv-ort-training
#   GRADGRAPH_ORT_TRAINING_VENV=/some/dir tools/setup_ort_training.sh
#   GRADGRAPH_ORT_TRAINING_PYTHON=python3.11 ...   # interpreter for the venv (must be < 3.12)
#
# Pins: torch==2.13.0 (CPU; installed first, because `import onnxruntime` in the training build
# imports torch), then onnxruntime-training-cpu==1.19.2, onnx==1.17.0 (newer onnx writes IR
# versions that ORT 1.19 cannot load), numpy. Idempotent: a venv whose recorded pins match and
# whose imports work is left alone.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GRADGRAPH_ORT_TRAINING_VENV:-$repo_root/.venv-ort-training}"
pins=(torch==2.13.0 onnxruntime-training-cpu==1.19.2 onnx==1.17.0 numpy)
stamp="$venv/.gradgraph-ort-training-pins"
wanted="${pins[*]}"

log() { echo "[setup_ort_training] $*"; }

check_venv() {
    # The packages import, torch is a CPU build, and the reference GradientGraphBuilder exists.
    "$venv/bin/python" - <<'EOF'
import sys
import onnx
import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as C

assert sys.version_info < (3, 12), f"onnxruntime-training 1.19.2 needs Python < 3.12, got {sys.version}"
assert onnxruntime.__version__ == "1.19.2", onnxruntime.__version__
assert onnx.__version__ == "1.17.0", onnx.__version__
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
assert hasattr(C, "GradientGraphBuilder"), "not a training build of onnxruntime"
print(f"python {sys.version.split()[0]}, onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}, "
      f"torch {torch.__version__}")
EOF
}

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]]; then
    if info="$(check_venv 2>&1)"; then
        log "up to date: $venv ($info); nothing to do"
        exit 0
    fi
    log "existing venv $venv fails its check, reinstalling the pins:"
    echo "$info" | tail -n 3
fi

python_bin="${GRADGRAPH_ORT_TRAINING_PYTHON:-}"
if [[ -z "$python_bin" ]]; then
    for cand in python3.11 python3.10 python3; do
        if command -v "$cand" >/dev/null 2>&1 \
            && "$cand" -c 'import sys; sys.exit(not ((3, 8) <= sys.version_info < (3, 12)))' 2>/dev/null; then
            python_bin="$cand"
            break
        fi
    done
fi
if [[ -z "$python_bin" ]]; then
    log "error: no Python 3.8-3.11 found (onnxruntime-training-cpu 1.19.2 has no wheels for 3.12+);"
    log "       set GRADGRAPH_ORT_TRAINING_PYTHON to one"
    exit 1
fi

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating venv $venv with $python_bin ($("$python_bin" --version 2>&1))"
    "$python_bin" -m venv "$venv"
else
    log "reusing venv $venv"
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check --no-input)

# torch first and on its own, so that the CPU wheel is the one chosen; onnxruntime-training does
# not depend on torch, so the second install never touches it.
log "installing torch==2.13.0 (CPU)"
"${pip[@]}" "torch==2.13.0"
if ! "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
    log "error: pip installed a CUDA build of torch; point pip at the CPU wheel (e.g. --index-url https://download.pytorch.org/whl/cpu) and re-run"
    exit 1
fi
log "installing onnxruntime-training-cpu==1.19.2 onnx==1.17.0 numpy"
"${pip[@]}" "onnxruntime-training-cpu==1.19.2" "onnx==1.17.0" numpy

info="$(check_venv)"
echo "$wanted" > "$stamp"
log "ready: $venv ($info)"
log "run: pytest -m ort_training tests/test_ort_training.py"
