"""The model and the data reading shared by train.py and init_model.py.

The CNN's state_dict names (conv1.weight, conv1.bias, conv2.weight, conv2.bias,
fc.weight, fc.bias) are the tensor names in the safetensors files the coordinator
averages, so changing the architecture here means starting a new experiment with a new
initial model (init_model.py).
"""

import csv
import gzip
import io

import numpy as np
import torch
from torch import nn


class SmallCNN(nn.Module):
    """conv(C->8, 3x3, pad 1) - ReLU - conv(8->16, 3x3, pad 1) - ReLU - flatten - Linear."""

    def __init__(self, channels, height, width, classes, widths=(8, 16)):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, widths[0], kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(widths[0], widths[1], kernel_size=3, padding=1)
        # For larger images (e.g. 64x64 and up), add nn.MaxPool2d(2) after each ReLU in
        # forward() and divide height and width by 4 here: a smaller fc layer, a smaller update.
        self.fc = nn.Linear(widths[1] * height * width, classes)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(torch.flatten(x, 1))

    @classmethod
    def from_state_dict(cls, state, image_shape):
        """Builds the model whose tensors are `state` (names and shapes are checked)."""
        channels, height, width = image_shape
        try:
            w1, w2, fc = state["conv1.weight"], state["conv2.weight"], state["fc.weight"]
        except KeyError as e:
            raise ValueError(f"the model lacks tensor {e}; this trainer expects conv1, conv2, fc") from None
        if w1.ndim != 4 or w2.ndim != 4 or fc.ndim != 2:
            raise ValueError("conv1.weight, conv2.weight must be 4-D and fc.weight 2-D")
        if w1.shape[1] != channels:
            raise ValueError(f"conv1 takes {w1.shape[1]} channels, --image-shape says {channels}")
        model = cls(channels, height, width, fc.shape[0], widths=(w1.shape[0], w2.shape[0]))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in state.items()}
        if got != expected:
            raise ValueError(
                f"the model's tensors {got} do not fit a SmallCNN for images {channels}x{height}x{width}: "
                f"expected {expected} (is --image-shape right?)"
            )
        model.load_state_dict({k: v.float() for k, v in state.items()})
        return model


def parse_image_shape(text):
    """'C,H,W' -> (C, H, W)."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--image-shape {text!r}: expected C,H,W, e.g. 1,28,28")
    return shape


def read_csv(path, pixels, classes):
    """Reads a CSV (or gzip-compressed CSV) with a header row, `pixels` pixel columns and
    a 'label' column of class numbers 0..classes-1; returns (x float32 [n, pixels], y int64)."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: broken gzip data: {e}") from None
    rows = csv.reader(io.StringIO(raw.decode("utf-8-sig")))
    header = [h.strip() for h in next(rows, [])]
    if header.count("label") != 1:
        raise ValueError(f"{path}: the header must have exactly one 'label' column")
    if len(header) - 1 != pixels:
        raise ValueError(f"{path}: {len(header) - 1} pixel columns, --image-shape gives {pixels}")
    label_col = header.index("label")
    values = []
    for line, row in enumerate(rows, start=2):
        if not any(v.strip() for v in row):
            continue
        if len(row) != len(header):
            raise ValueError(f"{path}:{line}: {len(row)} columns, the header has {len(header)}")
        try:
            values.append([float(v) for v in row])
        except ValueError:
            raise ValueError(f"{path}:{line}: a value is not a number") from None
    if not values:
        raise ValueError(f"{path}: no data rows")
    data = np.array(values)
    if not np.isfinite(data).all():
        raise ValueError(f"{path}: NaN or infinite values")
    labels = data[:, label_col]
    if ((labels != np.round(labels)) | (labels < 0) | (labels >= classes)).any():
        raise ValueError(f"{path}: labels must be class numbers 0..{classes - 1}")
    return np.delete(data, label_col, axis=1).astype(np.float32), labels.astype(np.int64)
