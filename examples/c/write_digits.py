"""Write the digits data set for examples/c/train_digits.c, which reads it
without Python:

    python examples/c/write_digits.py digits.bin

needs scikit-learn. The split and the scaling are examples/digits_mlp.py's
load_data (pixels in [0, 1], 20% test, shuffled with seed 0). The file,
every number little-endian:

    8 bytes   "SBPDIGIT"
    4 int64   training rows, test rows, pixels (64), classes (10)
    float64   training images, row by row; int64 training labels
    float64   test images, row by row; int64 test labels
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

MAGIC = b"SBPDIGIT"


def load_model_file():
    """examples/digits_mlp.py, imported by path (examples/ is no package)."""
    path = Path(__file__).resolve().parent.parent / "digits_mlp.py"
    spec = importlib.util.spec_from_file_location("digits_mlp", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, seed: int = 0) -> dict:
    """Write the data set to `path`; returns load_data's arrays."""
    digits = load_model_file()
    data = digits.load_data(seed)
    sizes = [len(data["y_train"]), len(data["y_test"]), digits.PIXELS, digits.CLASSES]
    with open(path, "wb") as out:
        out.write(MAGIC)
        out.write(np.array(sizes, dtype="<i8").tobytes())
        for images, labels in ((data["X_train"], data["y_train"]), (data["X_test"], data["y_test"])):
            out.write(np.ascontiguousarray(images, dtype="<f8").tobytes())
            out.write(np.ascontiguousarray(labels, dtype="<i8").tobytes())
    return data


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python examples/c/write_digits.py OUTPUT_FILE", file=sys.stderr)
        return 2
    data = write(Path(argv[0]))
    print(f"wrote {argv[0]}: {len(data['y_train'])} training and {len(data['y_test'])} test images")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
