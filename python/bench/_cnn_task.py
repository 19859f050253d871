"""The client side of ``cnn_vs_flower.py``: the CNN, the data and the one training
function that every engine runs.

It is a module of its own, not part of the script, so that every engine's workers import
it once per process and keep its data cache, as a Flower app started with ``flwr run``
(its ``ClientApp`` loaded from a module) and Cohort's workers do. Defined in the script
(``__main__``), Flower's Ray backend would pickle it by value with the ``ClientApp`` it
sends along with every message, and every call would load the data again.

The settings come from ``$CNN_BENCH_CFG`` (JSON), which the script sets before any
worker starts and every worker inherits.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import cohort

# The model is the example's own (examples/pytorch_cnn/model.py): the benchmark measures
# the engines on exactly the network the example trains.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "pytorch_cnn"))
from model import CNN  # noqa: E402

# The run's settings: filled by the script in its own process, read from $CNN_BENCH_CFG
# in the workers.
CFG: Dict[str, Any] = {}


def cfg() -> Dict[str, Any]:
    if not CFG:
        CFG.update(json.loads(os.environ["CNN_BENCH_CFG"]))
    return CFG


NAMES = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
         "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]

# ------------------------------------------------------------------------------ data

_D: Dict[str, Any] = {}


def data() -> Dict[str, Any]:
    """mnist10k (pixels / 255, as N x 1 x 28 x 28) and Cohort's Dirichlet partition of
    its training split; loaded once per process."""
    if not _D:
        c = cfg()
        ds = cohort.datasets.load("mnist10k")
        parts = cohort.datasets.partition(ds.y_train, f"dirichlet:{c['alpha']}",
                                          clients=c["clients"], seed=c["partition_seed"])
        _D.update(
            x=(ds.x_train / 255.0).astype(np.float32).reshape(-1, 1, 28, 28),
            y=ds.y_train.astype(np.int64),
            x_test=(ds.x_test / 255.0).astype(np.float32).reshape(-1, 1, 28, 28),
            y_test=ds.y_test.astype(np.int64),
            parts=parts,
        )
    return _D


# ---------------------------------------------------------- the one training function


def _record(line: Dict[str, Any]) -> None:
    """Appends one line to the run's train log (one write, O_APPEND: lines from
    concurrent processes and threads do not interleave)."""
    fd = os.open(cfg()["train_log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def fit_arrays(arrays: List[np.ndarray], server_round: int, partition: int
               ) -> Tuple[List[np.ndarray], int, float, float]:
    """Local training of one client: what every engine runs. Returns the new arrays (in
    ``NAMES`` order), the number of examples, the last epoch's mean loss and the
    seconds this call took."""
    t0 = time.perf_counter()
    started = time.time()
    c = cfg()
    torch.set_num_threads(c["threads"])
    d = data()
    idx = d["parts"][partition]
    x = torch.from_numpy(d["x"][idx])
    y = torch.from_numpy(d["y"][idx])
    model = CNN()
    model.load_state_dict({k: torch.from_numpy(np.array(a, dtype=np.float32))
                           for k, a in zip(NAMES, arrays)})
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=c["lr"], momentum=c["momentum"])
    g = torch.Generator().manual_seed(c["seed"] * 1_000_003 + server_round * 1009 + partition)
    n = len(idx)
    loss_sum = 0.0
    for _ in range(c["epochs"]):
        perm = torch.randperm(n, generator=g)
        loss_sum = 0.0
        for i in range(0, n, c["batch"]):
            j = perm[i:i + c["batch"]]
            loss = F.cross_entropy(model(x[j]), y[j])
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(j)
    state = model.state_dict()
    out = [state[k].detach().numpy().copy() for k in NAMES]
    seconds = time.perf_counter() - t0
    _record({"round": server_round, "partition": partition, "worker": f"{os.getpid()}/{threading.get_ident()}",
             "start": started, "s": seconds})
    return out, max(n, 1), loss_sum / max(n, 1), seconds


@torch.no_grad()
def accuracy(arrays: List[np.ndarray]) -> float:
    """Test accuracy of a model on the 2,000 test images (the same code for every engine)."""
    d = data()
    model = CNN()
    model.load_state_dict({k: torch.from_numpy(np.array(a, dtype=np.float32))
                           for k, a in zip(NAMES, arrays)})
    model.eval()
    correct = 0
    for i in range(0, len(d["y_test"]), 1000):
        logits = model(torch.from_numpy(d["x_test"][i:i + 1000]))
        correct += int((logits.argmax(1) == torch.from_numpy(d["y_test"][i:i + 1000])).sum())
    return correct / len(d["y_test"])


def initial_arrays(seed: int) -> List[np.ndarray]:
    torch.manual_seed(seed)
    state = CNN().state_dict()
    return [state[k].detach().numpy().copy() for k in NAMES]


# ----------------------------------------------------------------------------- Cohort


def cohort_train(weights: Dict[str, np.ndarray], task: "cohort.Task") -> "cohort.TrainResult":
    out, n, loss, seconds = fit_arrays([weights[k] for k in NAMES], task.round, task.partition_id)
    return cohort.TrainResult(dict(zip(NAMES, out)), n, {"loss": loss, "train_s": seconds})
