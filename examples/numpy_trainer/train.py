#!/usr/bin/env python3
"""A Cohort trainer in NumPy: an MLP classifier trained on one site's CSV file.

cohort-edge runs it once per task (see README.md):

    cohort-edge ... --trainer "python3 examples/numpy_trainer/train.py --data site.csv"

It reads task.json and global.safetensors, evaluates the received global model on a
held-out part of the local data, and, for a "train" task, trains it with mini-batch SGD
and writes update.safetensors (the new weights) and result.json. The architecture comes
from the global model's tensors: fc1.weight [out, in], fc1.bias [out], fc2.weight, ...
(PyTorch nn.Linear names and shapes), with ReLU between the layers.
"""

import argparse
import csv
import gzip
import io
import json
import math
import os
import re
import sys

import numpy as np

import st  # the safetensors reader/writer next to this file

# The held-out split is drawn with this seed, not the task's, so that the same
# examples are held out in every round and never trained on.
SPLIT_SEED = 0

# What the edge client's own trainer uses when a task leaves a setting out.
TRAIN_DEFAULTS = {"local_epochs": 5, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


class TrainerError(Exception):
    """Bad input: reported on stderr, exit status 2."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="local CSV (or .csv.gz) with a header row and a 'label' column")
    parser.add_argument("--val-fraction", type=float, default=0.2, help="share of the local rows held out for evaluation (default 0.2)")
    args = parser.parse_args(argv)
    try:
        run(args)
    except TrainerError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    return 0


def run(args):
    paths = task_paths()
    task = read_json(paths["task"], "task")
    kind = task.get("kind")
    if kind not in ("train", "evaluate"):
        raise TrainerError(f"task kind {kind!r}: expected 'train' or 'evaluate'")
    if not 0.0 <= args.val_fraction < 1.0:
        raise TrainerError(f"--val-fraction {args.val_fraction}: must be in [0, 1)")

    global_tensors = load_model(paths["global_model"])
    layers = mlp_layers(global_tensors)
    features, classes = layers[0][0].shape[1], layers[-1][0].shape[0]

    hyper = task.get("hyperparameters") or {}
    scale = number(hyper.get("feature_scale", 1.0), "hyperparameters.feature_scale")
    x, y = read_csv(args.data, features, classes)
    x *= np.float32(scale)
    try:
        (x_train, y_train), (x_val, y_val) = split(x, y, args.val_fraction)
    except TrainerError as e:
        raise TrainerError(f"{args.data}: {e}") from None

    result = {}
    if len(y_val):
        with np.errstate(over="ignore", invalid="ignore"):
            loss, accuracy = evaluate(layers, x_val, y_val)
        if not math.isfinite(loss):
            raise TrainerError("the received model's held-out loss is not finite (its outputs overflow)")
        result.update(accuracy=accuracy, loss=loss, eval_num_examples=len(y_val))
    elif kind == "evaluate":
        raise TrainerError("an evaluate task needs held-out data: use --val-fraction > 0")

    if kind == "evaluate":
        result = {"num_examples": len(y_val), "accuracy": result["accuracy"], "loss": result["loss"]}
    else:
        if not len(y_train):
            raise TrainerError(f"{args.data}: no training examples left after holding out {len(y_val)}")
        settings = train_settings(task)
        seed = task.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise TrainerError(f"task seed {seed!r}: expected a non-negative integer")
        with np.errstate(over="ignore", invalid="ignore"):  # divergence is reported below
            trained, train_loss = train(layers, x_train, y_train, settings, np.random.default_rng(seed))
        update = {}
        for i, (w, b) in enumerate(trained, start=1):
            update[f"fc{i}.weight"], update[f"fc{i}.bias"] = w, b
        # Same names as the global model, in the order its tensors lie in its file.
        update = {name: update[name].astype(np.float32) for name in global_tensors}
        # Write the update first: result.json appearing last marks a finished task.
        st.save(update, paths["update"])
        result = {"num_examples": len(y_train), "train_loss": train_loss, **result}

    st.write_atomic(paths["result"], (json.dumps(result, indent=2, allow_nan=False) + "\n").encode())
    summary = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())
    print(f"round {task.get('round', '?')} {kind}: {summary}", file=sys.stderr)


def task_paths():
    """The files of this task: from cohort-edge's environment, else the current folder."""
    return {
        "task": os.environ.get("COHORT_TASK", "task.json"),
        "global_model": os.environ.get("COHORT_GLOBAL_MODEL", "global.safetensors"),
        "update": os.environ.get("COHORT_UPDATE", "update.safetensors"),
        "result": os.environ.get("COHORT_RESULT", "result.json"),
    }


def read_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise TrainerError(f"cannot read the {what} file: {e}") from None
    except ValueError as e:
        raise TrainerError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise TrainerError(f"{path}: expected a JSON object")
    return value


def number(value, what, low=-math.inf, high=math.inf):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise TrainerError(f"{what} = {value!r}: expected a number in [{low}, {high}]")
    return float(value)


def train_settings(task):
    given = task.get("train") or {}
    if not isinstance(given, dict):
        raise TrainerError("task 'train' must be an object")
    s = {**TRAIN_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    for key in ("local_epochs", "batch_size"):
        if not isinstance(s[key], int) or isinstance(s[key], bool) or s[key] < 1:
            raise TrainerError(f"train.{key} = {s[key]!r}: expected an integer >= 1")
    s["lr"] = number(s["lr"], "train.lr", 0.0, 1e3)
    s["momentum"] = number(s["momentum"], "train.momentum", 0.0, 0.999)
    s["weight_decay"] = number(s["weight_decay"], "train.weight_decay", 0.0, 1e3)
    s["proximal_mu"] = number(s.get("proximal_mu", 0.0), "train.proximal_mu", 0.0, 1e6)
    return s


def load_model(path):
    try:
        tensors, _ = st.load(path)
    except OSError as e:
        raise TrainerError(f"cannot read the global model: {e}") from None
    except st.SafetensorsError as e:
        raise TrainerError(str(e)) from None
    return tensors


def mlp_layers(tensors):
    """[(weight [out, in], bias [out]), ...] in layer order, checked to chain."""
    index = {}
    for name, array in tensors.items():
        m = re.fullmatch(r"fc([1-9][0-9]*)\.(weight|bias)", name)
        if not m:
            raise TrainerError(f"global model tensor {name!r}: this trainer expects only fc<i>.weight and fc<i>.bias")
        if array.dtype != np.float32:
            raise TrainerError(f"global model tensor {name!r}: dtype {array.dtype}, expected F32")
        index[(int(m.group(1)), m.group(2))] = array
    if not index:
        raise TrainerError("the global model has no tensors")
    layers = []
    for i in range(1, max(k for k, _ in index) + 1):
        w, b = index.get((i, "weight")), index.get((i, "bias"))
        if w is None or b is None:
            raise TrainerError(f"the global model lacks fc{i}.weight or fc{i}.bias")
        if w.ndim != 2 or b.shape != (w.shape[0],) or 0 in w.shape:
            raise TrainerError(f"fc{i}: weight {list(w.shape)} and bias {list(b.shape)} do not form a linear layer")
        if layers and layers[-1][0].shape[0] != w.shape[1]:
            raise TrainerError(f"fc{i}.weight takes {w.shape[1]} inputs but fc{i - 1} gives {layers[-1][0].shape[0]}")
        layers.append((w, b))
    return layers


def read_csv(path, features, classes):
    """Reads features and labels, checking them against the model's shape."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TrainerError(f"cannot read the data: {e}") from None
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise TrainerError(f"{path}: broken gzip data: {e}") from None
    try:
        rows = csv.reader(io.StringIO(raw.decode("utf-8-sig")))
        header = [h.strip() for h in next(rows)]
    except (UnicodeDecodeError, StopIteration, csv.Error) as e:
        raise TrainerError(f"{path}: cannot read a CSV header row ({e or 'empty file'})") from None
    if header.count("label") != 1:
        raise TrainerError(f"{path}: the header must have exactly one 'label' column")
    label_col = header.index("label")
    if len(header) - 1 != features:
        raise TrainerError(f"{path}: {len(header) - 1} feature columns, the model takes {features}")

    values, lines = [], []  # lines: the file line of each row, for messages
    try:
        for line, row in enumerate(rows, start=2):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank line
            if len(row) != len(header):
                raise TrainerError(f"{path}:{line}: {len(row)} columns, the header has {len(header)}")
            try:
                values.append([float(v) for v in row])
                lines.append(line)
            except ValueError:
                raise TrainerError(f"{path}:{line}: a value is not a number") from None
    except csv.Error as e:
        raise TrainerError(f"{path}: {e}") from None
    if not values:
        raise TrainerError(f"{path}: no data rows")
    data = np.array(values, dtype=np.float64)
    if not np.isfinite(data).all():
        line = lines[int(np.argwhere(~np.isfinite(data))[0][0])]
        raise TrainerError(f"{path}:{line}: NaN or infinite value")
    labels = data[:, label_col]
    bad = (labels != np.round(labels)) | (labels < 0) | (labels >= classes)
    if bad.any():
        line = lines[int(np.argmax(bad))]
        raise TrainerError(f"{path}:{line}: label {labels[bad][0]:g} is not a class number 0..{classes - 1}")
    x = np.delete(data, label_col, axis=1).astype(np.float32)
    return x, labels.astype(np.int64)


def split(x, y, val_fraction):
    """Deterministic held-out split of the local rows: ((x, y) train, (x, y) held out)."""
    n = len(y)
    n_val = int(round(n * val_fraction))
    if val_fraction > 0:
        if n < 2:
            raise TrainerError(f"{n} example(s): too few to hold some out (use --val-fraction 0)")
        n_val = min(max(n_val, 1), n - 1)
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    val, tr = order[:n_val], order[n_val:]
    return (x[tr], y[tr]), (x[val], y[val])


def forward(layers, x):
    """Returns the logits and the inputs of every layer (kept for the backward pass)."""
    inputs = []
    h = x
    for i, (w, b) in enumerate(layers):
        inputs.append(h)
        h = h @ w.T + b
        if i < len(layers) - 1:
            h = np.maximum(h, 0.0)
    return h, inputs


def cross_entropy(logits, y):
    """Per-example softmax cross-entropy and the softmax probabilities."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(y)), y], np.exp(log_probs)


def evaluate(layers, x, y, batch=4096):
    """(mean loss, accuracy) of the model on (x, y)."""
    total_loss, correct = 0.0, 0
    for start in range(0, len(y), batch):
        logits, _ = forward(layers, x[start : start + batch])
        losses, _ = cross_entropy(logits.astype(np.float64), y[start : start + batch])
        total_loss += float(losses.astype(np.float64).sum())
        correct += int((logits.argmax(axis=1) == y[start : start + batch]).sum())
    return total_loss / len(y), correct / len(y)


def train(layers, x, y, s, rng):
    """Mini-batch SGD on softmax cross-entropy, PyTorch's SGD conventions: the gradient
    gets weight_decay * w and, for FedProx, mu * (w - w_global); then momentum
    v = momentum * v + g; w -= lr * v. Returns (trained layers, mean loss of the last epoch)."""
    params = [p.astype(np.float32) for layer in layers for p in layer]
    anchor = [p.copy() for p in params]  # the received global model, for FedProx
    velocity = [np.zeros_like(p) for p in params]
    n = len(y)
    for _ in range(s["local_epochs"]):
        order = rng.permutation(n)
        epoch_loss = 0.0
        for begin in range(0, n, s["batch_size"]):
            idx = order[begin : begin + s["batch_size"]]
            current = list(zip(params[0::2], params[1::2]))
            logits, inputs = forward(current, x[idx])
            losses, probs = cross_entropy(logits, y[idx])
            epoch_loss += float(losses.astype(np.float64).sum())
            # d(mean loss)/d(logits) = (softmax - one_hot) / batch
            delta = probs
            delta[np.arange(len(idx)), y[idx]] -= 1.0
            delta /= len(idx)
            grads = [None] * len(params)
            for i in range(len(current) - 1, -1, -1):
                w, _ = current[i]
                grads[2 * i] = delta.T @ inputs[i]
                grads[2 * i + 1] = delta.sum(axis=0)
                if i > 0:  # back through this layer and the ReLU before it
                    delta = (delta @ w) * (inputs[i] > 0)
            for p, g, a, v in zip(params, grads, anchor, velocity):
                if s["weight_decay"]:
                    g = g + s["weight_decay"] * p
                if s["proximal_mu"]:
                    g = g + s["proximal_mu"] * (p - a)
                if s["momentum"]:
                    v *= s["momentum"]
                    v += g
                    g = v
                p -= np.float32(s["lr"]) * g.astype(np.float32)
        if not (np.isfinite(epoch_loss) and all(np.isfinite(p).all() for p in params)):
            raise TrainerError(f"training diverged (non-finite loss or weights) with lr {s['lr']}: lower the learning rate")
    return list(zip(params[0::2], params[1::2])), epoch_loss / n


if __name__ == "__main__":
    sys.exit(main())
