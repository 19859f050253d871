"""Weights as the engine receives them: named arrays turned into a description and
raw bytes. The engine (Rust) checks them; nothing here decides what is valid."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np


def _to_numpy_dict(weights: Any, what: str) -> Dict[str, np.ndarray]:
    if hasattr(weights, "state_dict") and callable(weights.state_dict):
        weights = weights.state_dict()
    if not isinstance(weights, dict):
        raise TypeError(f"{what} must be a dict of name to array, got {type(weights).__name__}")
    out = {}
    for name, value in weights.items():
        if not isinstance(name, str):
            raise TypeError(f"{what}: tensor names must be strings, got {name!r}")
        if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
            value = value.detach().cpu().numpy()
        out[name] = np.asarray(value)
    return out


def _describe(weights: Dict[str, np.ndarray]) -> Tuple[list, Tuple[Any, ...]]:
    tensors = []
    parts = []
    for name, arr in weights.items():
        if arr.dtype.kind == "f" and arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if arr.dtype.kind == "f" and arr.dtype.itemsize == 2:
            arr = arr.astype(np.float32)
        arr = np.ascontiguousarray(arr)
        tensors.append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape)})
        if arr.dtype.kind in "fiub":
            parts.append(arr)
    return tensors, tuple(parts)
