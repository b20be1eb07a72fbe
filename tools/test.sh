#!/usr/bin/env bash
# Set everything up and run the test suite (what CI runs).
#   bash tools/test.sh              # full suite, slow real-model tests included
#   bash tools/test.sh -m "not slow"   # skip the slow real-model tests locally
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
if [ -f tools/setup_ort_training.sh ] && [ "${GRADGRAPH_SKIP_ORT_TRAINING:-0}" != "1" ]; then
  bash tools/setup_ort_training.sh
fi
VENV="${GRADGRAPH_VENV:-.venv}"
# pytest exits 5 when it collects no test: that is a failure here too.
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
