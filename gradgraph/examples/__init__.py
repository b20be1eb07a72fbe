"""The bundled example: ``mlp.onnx``, a 3-layer MLP classifier whose graph computes its loss
(output ``loss``, also ``logits``; inputs ``x`` float[batch, 16] and ``labels`` int64[batch]),
``mlp_data.npz`` (512 rows to train on) and ``mlp_batch.npz`` (one batch, for ``check``).
``tools/make_example.py`` writes them.

    python -m gradgraph.examples [DIR]     # copy the three files into DIR (default: .)
"""

from __future__ import annotations

import shutil
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
FILES = ("mlp.onnx", "mlp_data.npz", "mlp_batch.npz")


def path(name: str = "mlp.onnx") -> Path:
    """The installed path of one of :data:`FILES`."""
    if name not in FILES:
        raise ValueError(f"{name!r} is not a bundled example file; they are {list(FILES)}")
    return FOLDER / name


def copy_to(folder: str | Path = ".") -> list[Path]:
    """Copy the example files into ``folder`` (made if missing); returns the paths written."""
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(path(name), target / name)) for name in FILES]
