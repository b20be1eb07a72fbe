#!/usr/bin/env bash
# Set up, then run the main job on the bundled example model (no download):
# build its gradient graph, save every stage, check it against finite differences, run the
# training pipeline offline (stages + summary.txt), and train it.
#   bash tools/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
VENV="${GRADGRAPH_VENV:-.venv}"
GG="$VENV/bin/gradgraph"
EX=gradgraph/examples
mkdir -p out
"$GG" grad "$EX/mlp.onnx" --loss loss -o out/mlp_grad.onnx --save-stages out/stages
"$GG" check "$EX/mlp.onnx" --loss loss --inputs "$EX/mlp_batch.npz"
# the training pipeline stage by stage; the recompute planner asked to keep half of the
# activations (12 KiB at batch 64) keeps 16 KiB and says why it cannot do better
"$GG" build "$EX/mlp.onnx" --loss loss --save-stages out/build --cleanup --dim batch=64 \
  --memory-budget 12288
if "$GG" train -h >/dev/null 2>&1; then
  "$GG" train "$EX/mlp.onnx" --loss loss --data "$EX/mlp_data.npz" --optimizer adamw --lr 1e-2 \
    --steps 200 --batch-size 64 --checkpoint-dir out/checkpoints --overwrite
fi
