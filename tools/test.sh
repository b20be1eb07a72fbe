#!/usr/bin/env bash
# Set everything up, lint and type-check, and run the test suite (what CI runs).
#   bash tools/test.sh              # full suite, slow real-model tests included
#   bash tools/test.sh -m "not slow"   # skip the slow real-model tests locally
# Arguments go to pytest only. ruff and mypy (configured in pyproject.toml) must be clean:
# any finding fails the script before the tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
if [ -f tools/setup_ort_training.sh ] && [ "${GRADGRAPH_SKIP_ORT_TRAINING:-0}" != "1" ]; then
  bash tools/setup_ort_training.sh
fi
VENV="${GRADGRAPH_VENV:-.venv}"
echo "[test] ruff check"
"$VENV/bin/ruff" check gradgraph passes tests tools
echo "[test] mypy"
"$VENV/bin/python" -m mypy
# pytest exits 5 when it collects no test; the script exits with pytest's status, so that
# fails too. Tests run in one worker per core (pytest-xdist), a test file per worker at a time
# (its module fixtures, such as the exported models, built once); GRADGRAPH_TEST_WORKERS=0 runs
# them in this process.
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  -n "${GRADGRAPH_TEST_WORKERS:-auto}" --dist loadfile "$@"
