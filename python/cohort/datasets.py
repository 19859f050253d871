"""Real data sets shipped with Cohort, and Cohort's partitioners, as NumPy arrays."""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import numpy as np

from . import _rust

__all__ = ["Dataset", "load", "partition"]

# The published split of mnist10k: the first 8,000 rows train, the last 2,000 test.
_MNIST10K_TRAIN = 8000


class Dataset(NamedTuple):
    """A shipped data set, split into train and test parts.

    Attributes:
        x_train: Training features, float32, one row per example (mnist10k: 784
            pixels 0-255, row by row; reshape to ``(-1, 1, 28, 28)`` for a CNN).
        y_train: Training labels, int64 class indices.
        x_test: Test features.
        y_test: Test labels.
        classes: Class names in index order.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: List[str]


def load(name: str, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Loads a data set shipped inside Cohort (no download).

    Args:
        name: ``"mnist10k"`` (10,000 MNIST images, 28x28), ``"digits"`` (1,797 UCI
            digits, 8x8) or ``"breast_cancer"`` (569 samples, 30 features).
        test_fraction: For digits and breast_cancer, the fraction held out for testing
            (a seeded shuffle). mnist10k always uses its published split: the first
            8,000 rows train, the last 2,000 test.
        seed: Seed of that shuffle.

    Returns:
        A :class:`Dataset` with unscaled features (as in the files).

    Raises:
        cohort.ConfigError: An unknown name.
    """
    x, y, classes = _rust.load_dataset(name)
    if name == "mnist10k":
        cut = _MNIST10K_TRAIN
        return Dataset(x[:cut], y[:cut], x[cut:], y[cut:], list(classes))
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset(x[train], y[train], x[test], y[test], list(classes))


def partition(
    labels: np.ndarray,
    partition: str = "dirichlet:0.5",
    clients: int = 10,
    seed: int = 0,
) -> List[np.ndarray]:
    """Splits examples over clients with Cohort's partitioners (the same Rust code as
    ``cohort simulate`` and ``cohort partition``).

    Args:
        labels: Class index of every example (integers >= 0).
        partition: ``iid``, ``dirichlet:ALPHA`` (label skew; smaller is more skewed),
            ``shards:K`` (each client gets K label-sorted shards), and the other schemes
            ``cohort partition --help`` lists.
        clients: Number of clients.
        seed: Seed of the split.

    Returns:
        One int64 index array per client, into ``labels``; every example is in exactly
        one of them.

    Raises:
        cohort.ConfigError: An unknown or invalid scheme, or labels that are not class
            indices.
    """
    arr = np.ascontiguousarray(np.asarray(labels), dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {arr.shape}")
    return list(_rust.partition(arr, int(clients), str(partition), int(seed)))
