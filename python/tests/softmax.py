"""A NumPy softmax regression for the tests: the smallest real model a researcher would
bring, with the training function written once for simulation and deployment."""

from __future__ import annotations

import numpy as np

import cohort

_DIGITS = None


def digits():
    """The shipped digits, standardised with the training part's statistics."""
    global _DIGITS
    if _DIGITS is None:
        ds = cohort.datasets.load("digits")
        mean = ds.x_train.mean(axis=0)
        std = ds.x_train.std(axis=0) + 1e-6
        _DIGITS = (
            ((ds.x_train - mean) / std).astype(np.float32),
            ds.y_train,
            ((ds.x_test - mean) / std).astype(np.float32),
            ds.y_test,
        )
    return _DIGITS


def initial_weights():
    return {"w": np.zeros((64, 10), np.float32), "b": np.zeros(10, np.float32)}


def _logits(weights, x):
    return x @ weights["w"] + weights["b"]


def _loss_and_grads(w, b, x, y):
    z = x @ w + b
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return loss, x.T @ p, p.sum(axis=0)


def train(weights, task):
    x, y = task.data
    w = weights["w"].copy()
    b = weights["b"].copy()
    rng = np.random.default_rng(task.seed)
    loss = 0.0
    for _ in range(task.local_epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), task.batch_size):
            idx = order[start : start + task.batch_size]
            loss, gw, gb = _loss_and_grads(w, b, x[idx], y[idx])
            w -= task.lr * gw
            b -= task.lr * gb
    return cohort.TrainResult({"w": w, "b": b}, len(y), {"loss": loss})


def evaluate(weights, task):
    x, y = task.data
    z = _logits(weights, x)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = float(-logp[np.arange(len(y)), y].mean())
    accuracy = float((z.argmax(axis=1) == y).mean())
    return cohort.EvalResult(loss, len(y), {"accuracy": accuracy})


# --- functions that go wrong, one way each -------------------------------------------


def train_raises(weights, task):
    raise RuntimeError(f"cannot read the scanner archive of site {task.partition_id}")


def train_wrong_shape(weights, task):
    return cohort.TrainResult({"w": np.zeros((10, 64), np.float32), "b": weights["b"]}, 5)


def train_nan(weights, task):
    w = weights["w"].copy()
    w[3, 4] = np.nan
    return cohort.TrainResult({"w": w, "b": weights["b"]}, 5)


def train_missing(weights, task):
    return cohort.TrainResult({"w": weights["w"]}, 5)


def train_int(weights, task):
    return cohort.TrainResult({"w": weights["w"].astype(np.int64), "b": weights["b"]}, 5)


def train_fails_for_odd(weights, task):
    if task.partition_id % 2 == 1:
        raise ValueError("odd sites are down")
    return train(weights, task)


def train_in_place(weights, task):
    weights["w"] += 1.0  # read-only: raises
    return cohort.TrainResult(weights, 5)


def train_reordered(weights, task):
    """``train``'s update with its tensors in the other order: as valid, and as exact."""
    r = train(weights, task)
    return cohort.TrainResult({"b": r.weights["b"], "w": r.weights["w"]}, r.num_examples, r.metrics)


def train_float64(weights, task):
    """``train``'s update widened to float64: too large for a float32 slot, so it takes
    the pipe, and narrows back to the same float32 values."""
    r = train(weights, task)
    wide = {k: v.astype(np.float64) for k, v in r.weights.items()}
    return cohort.TrainResult(wide, r.num_examples, r.metrics)


def train_identity(weights, task):
    return cohort.TrainResult(weights, 10)


def client_data_fails(partition_id):
    raise OSError(f"/data/site-{partition_id}.csv: no such file")


def train_crashes_site_3(weights, task):
    if task.partition_id == 3 and task.round == 2:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return train(weights, task)


def train_hangs_site_1(weights, task):
    if task.partition_id == 1 and task.round == 1:
        import time

        time.sleep(60)
    return train(weights, task)


def train_reports_device(weights, task):
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    return cohort.TrainResult(weights, 1, {"device": float(visible) if visible else -1.0})
