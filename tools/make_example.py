"""Write the bundled example: a small MLP classifier whose graph computes its loss.

    python tools/make_example.py    # -> gradgraph/examples/mlp.onnx, mlp_data.npz

The model is written as ONNX text (the same text the tests use), its weights are
random (seed 0) and the data set is two Gaussian blobs per class, so training
visibly lowers the loss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper, parser

FEATURES, HIDDEN, CLASSES, SAMPLES = 16, 32, 4, 512
OUT = Path(__file__).resolve().parent.parent / "gradgraph" / "examples"

TEXT = f"""
<ir_version: 9, opset_import: ["" : 18]>
mlp (float[batch, {FEATURES}] x, int64[batch] labels) => (float loss, float[batch, {CLASSES}] logits) {{
  h1 = Gemm<transB=1>(x, fc1_weight, fc1_bias)
  a1 = Relu(h1)
  h2 = Gemm<transB=1>(a1, fc2_weight, fc2_bias)
  a2 = Tanh(h2)
  logits = Gemm<transB=1>(a2, fc3_weight, fc3_bias)
  loss = SoftmaxCrossEntropyLoss<reduction="mean">(logits, labels)
}}
"""


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    model = parser.parse_model(TEXT)
    shapes = {"fc1": (HIDDEN, FEATURES), "fc2": (HIDDEN, HIDDEN), "fc3": (CLASSES, HIDDEN)}
    for layer, (out_dim, in_dim) in shapes.items():
        bound = 1.0 / np.sqrt(in_dim)
        weight = rng.uniform(-bound, bound, (out_dim, in_dim)).astype(np.float32)
        bias = rng.uniform(-bound, bound, out_dim).astype(np.float32)
        model.graph.initializer.extend([numpy_helper.from_array(weight, f"{layer}_weight"),
                                        numpy_helper.from_array(bias, f"{layer}_bias")])
    onnx.checker.check_model(model, full_check=True)
    return model


def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    centers = rng.normal(0, 2.0, (CLASSES, FEATURES))
    labels = rng.integers(0, CLASSES, SAMPLES)
    x = centers[labels] + rng.normal(0, 1.0, (SAMPLES, FEATURES))
    return {"x": x.astype(np.float32), "labels": labels.astype(np.int64)}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), OUT / "mlp.onnx")
    np.savez(OUT / "mlp_data.npz", **data())
    first = {k: v[:8] for k, v in data().items()}
    np.savez(OUT / "mlp_batch.npz", **first)
    print(f"wrote {OUT / 'mlp.onnx'}, {OUT / 'mlp_data.npz'}, {OUT / 'mlp_batch.npz'}")


if __name__ == "__main__":
    main()
