#!/usr/bin/env python3
"""A Cohort trainer in PyTorch: a small CNN on one site's images, given as CSV rows.

cohort-edge runs it once per task (see README.md):

    cohort-edge ... --trainer "python3 examples/pytorch_cnn/train.py --data site.csv --image-shape 1,28,28"

Each CSV row is one image, its pixels flattened in C,H,W order, then its `label`. The
trainer evaluates the received global model on a held-out part of the local data and,
for a "train" task, trains it with SGD and writes update.safetensors and result.json.
"""

import argparse
import csv
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cnn import SmallCNN, parse_image_shape, read_csv

SPLIT_SEED = 0  # fixed, so that the same local examples are held out in every round
TRAIN_DEFAULTS = {"local_epochs": 5, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Cohort trainer: a small CNN in PyTorch.")
    parser.add_argument("--data", required=True, help="CSV (or .csv.gz): pixel columns, then 'label'")
    parser.add_argument("--image-shape", required=True, help="C,H,W of the images, e.g. 1,28,28")
    parser.add_argument("--val-fraction", type=float, default=0.2, help="share of local rows held out (default 0.2)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    args = parser.parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError, EOFError, csv.Error, SafetensorError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    return 0


def run(args):
    paths = {
        "task": os.environ.get("COHORT_TASK", "task.json"),
        "global_model": os.environ.get("COHORT_GLOBAL_MODEL", "global.safetensors"),
        "update": os.environ.get("COHORT_UPDATE", "update.safetensors"),
        "result": os.environ.get("COHORT_RESULT", "result.json"),
    }
    with open(paths["task"], encoding="utf-8") as f:
        task = json.load(f)
    kind = task.get("kind")
    if kind not in ("train", "evaluate"):
        raise ValueError(f"task kind {kind!r}: expected 'train' or 'evaluate'")
    if not 0.0 <= args.val_fraction < 1.0:
        raise ValueError("--val-fraction must be in [0, 1)")
    shape = parse_image_shape(args.image_shape)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)

    global_state = load_file(paths["global_model"])
    for name, t in global_state.items():
        if t.dtype != torch.float32:
            raise ValueError(f"global model tensor {name!r}: dtype {t.dtype}, expected float32")
    model = SmallCNN.from_state_dict(global_state, shape).to(device)
    classes = model.fc.out_features

    x, y = read_csv(args.data, int(np.prod(shape)), classes)
    x *= float((task.get("hyperparameters") or {}).get("feature_scale", 1.0))
    n = len(y)
    n_val = int(round(n * args.val_fraction))
    if args.val_fraction > 0:
        if n < 2:
            raise ValueError(f"{args.data}: too few examples to hold some out (use --val-fraction 0)")
        n_val = min(max(n_val, 1), n - 1)
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    to_tensors = lambda idx: (torch.from_numpy(x[idx]).reshape(-1, *shape).to(device),
                              torch.from_numpy(y[idx]).to(device))
    x_val, y_val = to_tensors(order[:n_val])
    x_train, y_train = to_tensors(order[n_val:])

    result = {}
    if n_val:
        loss, accuracy = evaluate(model, x_val, y_val)
        if not math.isfinite(loss):
            raise ValueError("the received model's held-out loss is not finite")
        result.update(accuracy=accuracy, loss=loss, eval_num_examples=n_val)
    elif kind == "evaluate":
        raise ValueError("an evaluate task needs held-out data: use --val-fraction > 0")

    if kind == "evaluate":
        result = {"num_examples": n_val, "accuracy": result["accuracy"], "loss": result["loss"]}
    else:
        if not len(y_train):
            raise ValueError(f"{args.data}: no training examples left after holding out {n_val}")
        train_loss = train(model, x_train, y_train, train_settings(task), int(task.get("seed", 0)))
        state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
        if not math.isfinite(train_loss) or not all(torch.isfinite(v).all() for v in state.values()):
            raise ValueError("training diverged (non-finite loss or weights): lower the learning rate")
        write_atomic(paths["update"], lambda tmp: save_file(state, tmp))
        result = {"num_examples": len(y_train), "train_loss": train_loss, **result}

    text = json.dumps(result, indent=2, allow_nan=False) + "\n"
    write_atomic(paths["result"], lambda tmp: write_text(tmp, text))
    print(f"round {task.get('round', '?')} {kind} on {device}: {result}", file=sys.stderr)


def train_settings(task):
    s = {**TRAIN_DEFAULTS, **{k: v for k, v in (task.get("train") or {}).items() if v is not None}}
    if int(s["local_epochs"]) < 1 or int(s["batch_size"]) < 1 or not s["lr"] > 0:
        raise ValueError(f"bad training settings {s}")
    return s


@torch.no_grad()
def evaluate(model, x, y, batch=1024):
    model.eval()
    total, correct = 0.0, 0
    for i in range(0, len(y), batch):
        logits = model(x[i : i + batch])
        total += F.cross_entropy(logits, y[i : i + batch], reduction="sum").item()
        correct += (logits.argmax(1) == y[i : i + batch]).sum().item()
    return total / len(y), correct / len(y)


def train(model, x, y, s, seed):
    """SGD with momentum and weight decay; FedProx adds mu/2 ||w - w_global||^2 to the
    loss. Returns the mean training loss of the last epoch."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    mu = float(s.get("proximal_mu") or 0.0)
    anchor = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=float(s["lr"]), momentum=float(s["momentum"]),
                          weight_decay=float(s["weight_decay"]))
    model.train()
    for _ in range(int(s["local_epochs"])):
        order = torch.randperm(len(y), generator=generator).to(y.device)
        total = 0.0
        for i in range(0, len(y), int(s["batch_size"])):
            idx = order[i : i + int(s["batch_size"])]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            total += loss.item() * len(idx)
            if mu > 0:
                loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return total / len(y)


def write_atomic(path, write):
    """Calls write(temporary name in the same folder), then renames it to `path`."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
