#!/usr/bin/env python3
"""A PyTorch CNN on MNIST, trained federatedly with Cohort: one ``train`` function for
simulation and for deployment.

    # 100 virtual clients on one machine (Dirichlet(0.3) label skew, 10 a round)
    python examples/pytorch_cnn/train.py simulate --rounds 100 --workers 2 --target 0.95

    # one site of a real deployment, serving a Cohort coordinator
    python examples/pytorch_cnn/train.py edge --coordinator https://127.0.0.1:8443 \\
        --ca-cert cohort-data/tls/ca.pem --token TOKEN --state-dir site-0 --partition-id 0

``train(weights, task)`` and ``evaluate(weights, task)`` below are plain functions of a
dict of NumPy arrays and a :class:`cohort.Task`; ``cohort.simulate`` runs them in a pool
of worker processes and ``cohort.EdgeClient`` runs the very same functions at a site.
They live at the top level of this file, and the command line under
``if __name__ == "__main__":``, because the simulation pickles them for its worker
processes: by reference, the workers importing this file again as ``__mp_main__`` (as
``multiprocessing`` does), or by value when ``cloudpickle`` is installed.

Torch uses ``$OMP_NUM_THREADS`` threads per process (default 1: with ``--workers 2`` on
two cores, one each); ``$CNN_DEVICE`` picks the device (default ``cuda`` when PyTorch
sees a GPU, else ``cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import cohort
from cohort.torch import from_state_dict, load_weights

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import CNN, IMAGE_SHAPE, num_parameters  # noqa: E402

# ---------------------------------------------------------------------------- data

_MNIST: dict = {}


def mnist():
    """mnist10k as shipped with Cohort: 8,000 training and 2,000 test images, pixels
    scaled to 0-1, one flat row of 784 per image."""
    if not _MNIST:
        ds = cohort.datasets.load("mnist10k")
        _MNIST.update(
            x_train=(ds.x_train / 255.0).astype(np.float32),
            y_train=ds.y_train.astype(np.int64),
            x_test=(ds.x_test / 255.0).astype(np.float32),
            y_test=ds.y_test.astype(np.int64),
        )
    return _MNIST


def site_data(partition_id: int, clients: int, alpha: float, seed: int):
    """One site's share of the training split: the same Dirichlet(alpha) partitioner,
    with the same seed, as ``cohort.simulate(partition="dirichlet:ALPHA")``."""
    d = mnist()
    parts = cohort.datasets.partition(d["y_train"], f"dirichlet:{alpha}", clients=clients, seed=seed)
    idx = parts[partition_id]
    return d["x_train"][idx], d["y_train"][idx]


# ------------------------------------------------------------------ train / evaluate

_SETUP: dict = {}


def _device() -> torch.device:
    """Sets torch's threads once per process and picks the device."""
    if not _SETUP:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or 1)))
        name = os.environ.get("CNN_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        _SETUP["device"] = torch.device(name)
    return _SETUP["device"]


def _tensors(data, device):
    x, y = data
    x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32).reshape(-1, *IMAGE_SHAPE))
    y = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    return x.to(device), y.to(device)


def train(weights, task):
    """Local SGD on this client's images, starting from the global model.

    ``task.data`` is ``(x, y)``: flat 784-pixel rows scaled to 0-1, and labels. The
    batches are shuffled with a generator seeded by ``task.seed``, so a run repeats
    exactly (on the CPU)."""
    device = _device()
    model = CNN()
    load_weights(model, weights)
    model.to(device).train()
    x, y = _tensors(task.data, device)
    n = len(y)
    generator = torch.Generator().manual_seed(task.seed)
    opt = torch.optim.SGD(
        model.parameters(),
        lr=task.lr,
        momentum=float(task.config.get("momentum") or 0.0),
        weight_decay=float(task.config.get("weight_decay") or 0.0),
    )
    batch = task.batch_size
    loss_sum = 0.0
    for _ in range(task.local_epochs):
        order = torch.randperm(n, generator=generator).to(device)
        loss_sum = 0.0
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
    return cohort.TrainResult(from_state_dict(model), n, {"loss": loss_sum / max(n, 1)})


@torch.no_grad()
def evaluate(weights, task):
    """Loss and accuracy of the model on ``task.data``: the test split in simulation,
    the site's own images in deployment."""
    device = _device()
    model = CNN()
    load_weights(model, weights)
    model.to(device).eval()
    x, y = _tensors(task.data, device)
    loss, correct = 0.0, 0
    for start in range(0, len(y), 1000):
        logits = model(x[start : start + 1000])
        loss += F.cross_entropy(logits, y[start : start + 1000], reduction="sum").item()
        correct += int((logits.argmax(1) == y[start : start + 1000]).sum())
    return cohort.EvalResult(loss / len(y), len(y), {"accuracy": correct / len(y)})


def initial_weights(seed: int = 0):
    """PyTorch's default initialisation, seeded."""
    torch.manual_seed(seed)
    return from_state_dict(CNN())


# ---------------------------------------------------------------------- command line


def down_for(scheme):
    """What ``--compress`` means for downloads, as ``cohort simulate --compress``: the
    same scheme for ``quantize:4`` and ``quantize:8``, none otherwise (the biased upload
    schemes, and fewer bits than a model can train from)."""
    return scheme if scheme in ("quantize:4", "quantize:8") else "none"


def run_simulation(args) -> int:
    d = mnist()
    started = time.perf_counter()
    result = cohort.simulate(
        train,
        evaluate,
        initial_weights=initial_weights(args.seed),
        client_data=(d["x_train"], d["y_train"]),
        test_data=(d["x_test"], d["y_test"]),
        clients=args.clients,
        clients_per_round=args.per_round,
        rounds=args.rounds,
        partition=f"dirichlet:{args.alpha}",
        local_epochs=args.epochs,
        batch_size=args.batch,
        lr=args.lr,
        momentum=args.momentum,
        workers=args.workers,
        secure_aggregation=args.secure,
        seed=args.seed,
        out=args.out,
        target_accuracy=args.target,
        compress_up=args.compress_up or args.compress or "none",
        compress_down=args.compress_down or down_for(args.compress),
    )
    wall = time.perf_counter() - started
    seconds = [r["seconds"] for r in result.rounds]
    reached = next((r["round"] for r in result.rounds if r["test_accuracy"] >= args.target), None)
    summary = {
        "parameters": num_parameters(CNN()),
        "rounds": len(result.rounds),
        "final_accuracy": round(result.accuracy, 4),
        "best_accuracy": round(max(r["test_accuracy"] for r in result.rounds), 4),
        "target": args.target,
        "round_reaching_target": reached,
        "median_round_s": round(float(np.median(seconds)), 3),
        "wall_s": round(wall, 1),
        "failed": result.summary.get("total_failed"),
        "secure_aggregation": args.secure,
        "workers": args.workers,
        "out": result.out,
    }
    print(json.dumps(summary))
    return 0


def run_edge(args) -> int:
    data = site_data(args.partition_id, args.clients, args.alpha, args.seed)
    print(f"site {args.partition_id}: {len(data[1])} training images", file=sys.stderr, flush=True)
    client = cohort.EdgeClient(
        args.coordinator,
        ca_cert=args.ca_cert,
        enrol_token=args.token,
        state_dir=args.state_dir,
        data=data,
        partition_id=args.partition_id,
        seed=args.seed * 1000 + args.partition_id,
        idle_exit=args.idle_exit,
    )
    report = client.run(train, evaluate)
    print(json.dumps(report))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)

    sim = modes.add_parser("simulate", help="run 100 virtual clients on this machine")
    sim.add_argument("--rounds", type=int, default=100)
    sim.add_argument("--workers", type=int, default=2, help="Python worker processes (default 2)")
    sim.add_argument("--target", type=float, default=0.95, help="report the first round reaching this test accuracy")
    sim.add_argument("--secure", action="store_true", help="SecAgg+ secure aggregation")
    sim.add_argument("--out", default=None, help="output folder (default runs/simulate-<time>)")
    sim.add_argument("--clients", type=int, default=100)
    sim.add_argument("--per-round", type=int, default=10)
    sim.add_argument("--epochs", type=int, default=5, help="local epochs")
    sim.add_argument("--batch", type=int, default=10)
    sim.add_argument("--lr", type=float, default=0.05)
    sim.add_argument("--momentum", type=float, default=0.0)
    sim.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration of the label skew")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--compress", default=None, help="both ways: quantize:B; or sign | topk:F up (as cohort simulate --compress)")
    sim.add_argument("--compress-up", default=None, help="uploads: none | quantize:B | sign | topk:F")
    sim.add_argument("--compress-down", default=None, help="downloads: none | quantize:B")

    edge = modes.add_parser("edge", help="serve a Cohort coordinator as one site")
    edge.add_argument("--coordinator", required=True, help="https://HOST:PORT")
    edge.add_argument("--ca-cert", default=None, help="PEM of the CA that signed the coordinator's certificate")
    edge.add_argument("--token", default=None, help="one-time enrolment token (only until enrolled)")
    edge.add_argument("--state-dir", required=True, help="where the site's credential is kept")
    edge.add_argument("--partition-id", type=int, required=True, help="this site's partition, 0..clients-1")
    edge.add_argument("--clients", type=int, default=5, help="number of sites the training split is divided over")
    edge.add_argument("--alpha", type=float, default=0.3)
    edge.add_argument("--seed", type=int, default=0, help="seed of the partition (the same at every site)")
    edge.add_argument("--idle-exit", type=float, default=None, help="stop after this many seconds without a task")

    args = parser.parse_args(argv)
    if args.mode == "edge" and not 0 <= args.partition_id < args.clients:
        parser.error(f"--partition-id must be in 0..{args.clients - 1}")
    return run_simulation(args) if args.mode == "simulate" else run_edge(args)


if __name__ == "__main__":
    sys.exit(main())
