"""``cohort.flower``: an unchanged Flower ``NumPyClient`` under Cohort and under Flower.

The client below is written as in Flower's NumPy quickstart (a ``NumPyClient`` with
``get_parameters``/``fit``/``evaluate``, and ``client_fn(context)`` returning
``.to_client()``): softmax regression on the shipped UCI digits, features standardised
with the training mean and std, split over 10 clients with Cohort's
``dirichlet:1.0`` partitioner.

The comparison test runs it

(a) under Flower's own simulation engine: ``flwr.simulation.run_simulation`` with the
    Ray backend, a legacy ``ServerApp`` with ``flwr.server.strategy.FedAvg`` and a
    ``ClientApp(client_fn=client_fn)`` (the first choice of the brief; Ray is driven
    from pytest, in this process, and shut down afterwards), and
(b) under ``cohort.simulate`` through :func:`cohort.flower.from_numpy_client`,

with the same initial weights, the same training config (``lr``, ``local_epochs``,
``batch_size``, ``server_round``), all 10 clients every round for 8 rounds, and the same
central evaluation of the global model on the held-out test set (Flower's
``evaluate_fn``; Cohort's ``server_evaluate_fn``). The final test accuracies must agree
within 0.02.

Skipped when flwr is not installed, unless ``COHORT_REQUIRE_FLWR=1``; the Ray part is
skipped when Ray is missing, unless the same variable is set.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

if os.environ.get("COHORT_REQUIRE_FLWR") == "1":
    import flwr  # noqa: F401
else:
    flwr = pytest.importorskip("flwr")

import cohort  # noqa: E402
from cohort.flower import (  # noqa: E402
    FlowerEvaluate,
    FlowerTrain,
    from_numpy_client,
    initial_weights,
)
from flwr.client import ClientApp, NumPyClient  # noqa: E402
from flwr.common import Context, ndarrays_to_parameters  # noqa: E402

CLIENTS = 10
ROUNDS = 8
LR = 0.1
LOCAL_EPOCHS = 2
BATCH_SIZE = 32
NUM_CLASSES = 10

# ---------------------------------------------------------------- the Flower project

_DATA: Dict[str, Any] = {}


def load_data() -> Dict[str, Any]:
    """Digits, standardised with the training mean/std (cached per process)."""
    if not _DATA:
        ds = cohort.datasets.load("digits")
        mean = ds.x_train.mean(axis=0)
        std = ds.x_train.std(axis=0)
        std[std == 0] = 1.0
        _DATA["x_train"] = ((ds.x_train - mean) / std).astype(np.float32)
        _DATA["y_train"] = ds.y_train.astype(np.int64)
        _DATA["x_test"] = ((ds.x_test - mean) / std).astype(np.float32)
        _DATA["y_test"] = ds.y_test.astype(np.int64)
        _DATA["parts"] = {}
    return _DATA


def load_partition(partition_id: int, num_partitions: int) -> Tuple[np.ndarray, np.ndarray]:
    """One client's examples: Cohort's Dirichlet(1.0) split, seed 0."""
    d = load_data()
    if num_partitions not in d["parts"]:
        d["parts"][num_partitions] = cohort.datasets.partition(
            d["y_train"], "dirichlet:1.0", clients=num_partitions, seed=0
        )
    idx = d["parts"][num_partitions][partition_id]
    return d["x_train"][idx], d["y_train"][idx]


def _softmax_loss_acc(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray):
    z = x @ w + b
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = float(-logp[np.arange(len(y)), y].mean())
    acc = float((logp.argmax(axis=1) == y).mean())
    return loss, acc


class FlowerClient(NumPyClient):
    """Softmax regression trained with mini-batch SGD (plain Flower code)."""

    def __init__(self, partition_id: int, x: np.ndarray, y: np.ndarray) -> None:
        self.partition_id = partition_id
        self.x, self.y = x, y
        rng = np.random.default_rng(42)
        self.w = rng.normal(0.0, 0.01, size=(x.shape[1], NUM_CLASSES)).astype(np.float32)
        self.b = np.zeros(NUM_CLASSES, dtype=np.float32)

    def get_parameters(self, config):
        return [self.w, self.b]

    def fit(self, parameters, config):
        w, b = (p.astype(np.float32) for p in parameters)  # copies
        lr = float(config["lr"])
        epochs = int(config["local_epochs"])
        batch = int(config["batch_size"])
        rng = np.random.default_rng(1000 * int(config["server_round"]) + self.partition_id)
        x, y = self.x, self.y
        for _ in range(epochs):
            order = rng.permutation(len(y))
            for i in range(0, len(y), batch):
                j = order[i : i + batch]
                z = x[j] @ w + b
                z -= z.max(axis=1, keepdims=True)
                p = np.exp(z)
                p /= p.sum(axis=1, keepdims=True)
                p[np.arange(len(j)), y[j]] -= 1.0
                p /= len(j)
                w -= lr * (x[j].T @ p)
                b -= lr * p.sum(axis=0)
        loss, _ = _softmax_loss_acc(w, b, x, y)
        return [w, b], len(y), {"loss": loss}

    def evaluate(self, parameters, config):
        w, b = parameters
        loss, acc = _softmax_loss_acc(w, b, self.x, self.y)
        return loss, len(self.y), {"accuracy": acc}


def client_fn(context: Context):
    """Flower's client_fn: builds the client of this node's partition."""
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    x, y = load_partition(partition_id, num_partitions)
    return FlowerClient(partition_id, x, y).to_client()


def client_fn_cid(cid: str):
    """An old-style client_fn (``client_fn(cid)``) returning the NumPyClient itself."""
    x, y = load_partition(int(cid), CLIENTS)
    return FlowerClient(int(cid), x, y)


def central_evaluate(server_round, parameters, config):
    """Flower strategies' ``evaluate_fn``: the global model on the test set."""
    d = load_data()
    w, b = parameters
    loss, acc = _softmax_loss_acc(w, b, d["x_test"], d["y_test"])
    HISTORY.append((int(server_round), acc))
    return loss, {"accuracy": acc}


HISTORY: List[Tuple[int, float]] = []


def fit_config(server_round: int):
    """Flower's on_fit_config_fn: the settings Cohort puts in the config it hands
    ``fit`` (``task.config`` plus ``server_round``)."""
    return {"server_round": server_round, "lr": LR, "local_epochs": LOCAL_EPOCHS,
            "batch_size": BATCH_SIZE}


# ---------------------------------------------------------------- unit checks


def _task(partition_id, round_=1, data=None):
    return cohort.Task(
        round=round_,
        seed=0,
        partition_id=partition_id,
        config={"local_epochs": 1, "batch_size": 32, "lr": 0.1, "momentum": 0.0,
                "weight_decay": 0.0, "proximal_mu": None},
        hyperparameters={},
        data=data,
    )


def _readonly(weights):
    out = {}
    for k, v in weights.items():
        v = np.array(v, dtype=np.float32)
        v.flags.writeable = False
        out[k] = v
    return out


def test_initial_weights_names_and_order():
    w = initial_weights(client_fn, num_partitions=CLIENTS)
    assert list(w) == ["param_0", "param_1"]
    assert w["param_0"].shape == (64, NUM_CLASSES) and w["param_1"].shape == (NUM_CLASSES,)
    named = initial_weights(client_fn, names=["w", "b"], num_partitions=CLIENTS)
    assert list(named) == ["w", "b"]
    np.testing.assert_array_equal(named["w"], w["param_0"])
    with pytest.raises(ValueError):
        initial_weights(client_fn, names=["only_one"])


@pytest.mark.parametrize("fn", [client_fn, client_fn_cid])
def test_train_and_evaluate_map_flower_calls(fn):
    train, evaluate = from_numpy_client(fn, num_partitions=CLIENTS)
    w0 = _readonly(initial_weights(fn, names=["w", "b"], num_partitions=CLIENTS))
    res = train(w0, _task(3))
    assert isinstance(res, cohort.TrainResult)
    assert list(res.weights) == ["w", "b"]
    assert res.num_examples == len(load_partition(3, CLIENTS)[1])
    assert "loss" in res.metrics
    assert not np.allclose(res.weights["w"], w0["w"])
    # Same call straight on the NumPyClient: identical result.
    x, y = load_partition(3, CLIENTS)
    config = {"local_epochs": 1, "batch_size": 32, "lr": 0.1, "momentum": 0.0,
              "weight_decay": 0.0, "server_round": 1}
    direct, _, _ = FlowerClient(3, x, y).fit([np.array(a) for a in w0.values()], config)
    np.testing.assert_allclose(res.weights["w"], direct[0])
    # Global evaluation without server_evaluate_fn: partition 0's client, its own data.
    ev = evaluate(res.weights, _task(None))
    assert isinstance(ev, cohort.EvalResult)
    assert ev.num_examples == len(load_partition(0, CLIENTS)[1])
    assert 0.0 <= ev.metrics["accuracy"] <= 1.0
    # A partition's own evaluation.
    ev3 = evaluate(res.weights, _task(3))
    assert ev3.num_examples == res.num_examples


def test_server_evaluate_fn_and_evaluate_partition():
    d = load_data()
    _, evaluate = from_numpy_client(client_fn, server_evaluate_fn=central_evaluate,
                                    num_partitions=CLIENTS)
    w0 = _readonly(initial_weights(client_fn, num_partitions=CLIENTS))
    ev = evaluate(w0, _task(None, data=(d["x_test"], d["y_test"])))
    assert ev.num_examples == len(d["y_test"])
    _, evaluate5 = from_numpy_client(client_fn, evaluate_partition=5, num_partitions=CLIENTS)
    assert evaluate5(w0, _task(None)).num_examples == len(load_partition(5, CLIENTS)[1])


def test_message_client_without_numpy_client():
    """A Flower ``Client`` (no ``numpy_client`` to unwrap) is driven with FitIns."""
    from flwr.client import Client
    from flwr.common import (Code, EvaluateRes, FitRes, GetParametersRes, Status,
                             parameters_to_ndarrays)

    class Doubler(Client):
        def get_parameters(self, ins):
            return GetParametersRes(status=Status(Code.OK, ""),
                                    parameters=ndarrays_to_parameters([np.ones(3, np.float32)]))

        def fit(self, ins):
            arrays = [a * 2 for a in parameters_to_ndarrays(ins.parameters)]
            return FitRes(status=Status(Code.OK, ""), parameters=ndarrays_to_parameters(arrays),
                          num_examples=int(ins.config["server_round"]), metrics={})

        def evaluate(self, ins):
            return EvaluateRes(status=Status(Code.OK, ""), loss=1.5, num_examples=4,
                               metrics={"accuracy": 0.25})

    train, evaluate = from_numpy_client(_doubler_fn)
    _DOUBLER["cls"] = Doubler
    w0 = initial_weights(_doubler_fn, names=["v"])
    res = train(_readonly(w0), _task(0, round_=7))
    np.testing.assert_array_equal(res.weights["v"], np.full(3, 2.0, np.float32))
    assert res.num_examples == 7
    ev = evaluate(_readonly(w0), _task(None))
    assert (ev.loss, ev.num_examples, ev.metrics["accuracy"]) == (1.5, 4, 0.25)


_DOUBLER: Dict[str, Any] = {}


def _doubler_fn(context: Context):
    return _DOUBLER["cls"]()


def test_adapters_pickle_by_reference():
    train, evaluate = from_numpy_client(client_fn, server_evaluate_fn=central_evaluate)
    assert isinstance(train, FlowerTrain) and isinstance(evaluate, FlowerEvaluate)
    # Use them once so they hold per-process contexts, which must not travel.
    train(_readonly(initial_weights(client_fn, num_partitions=CLIENTS)), _task(1))
    train2 = pickle.loads(pickle.dumps(train))
    evaluate2 = pickle.loads(pickle.dumps(evaluate))
    assert train2.client_fn is client_fn
    assert evaluate2.server_evaluate_fn is central_evaluate
    assert train2._contexts == {}
    assert b"FlowerClient" not in pickle.dumps(train)  # client_fn goes by reference


# ---------------------------------------------------------------- Flower vs Cohort


def _run_flower_ray(init: List[np.ndarray]) -> float:
    """FedAvg under Flower's simulation engine (Ray backend); final test accuracy."""
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    def server_fn(context: Context) -> ServerAppComponents:
        strategy = FedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=CLIENTS,
            min_evaluate_clients=0,
            min_available_clients=CLIENTS,
            evaluate_fn=central_evaluate,
            on_fit_config_fn=fit_config,
            initial_parameters=ndarrays_to_parameters(init),
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=ROUNDS))

    HISTORY.clear()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    import ray

    try:
        run_simulation(
            server_app=ServerApp(server_fn=server_fn),
            client_app=ClientApp(client_fn=client_fn),
            num_supernodes=CLIENTS,
            backend_name="ray",
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"num_cpus": min(4, os.cpu_count() or 1),
                              "include_dashboard": False},
            },
        )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    rounds = dict(HISTORY)  # round -> accuracy; round 0 is the initial model
    assert max(rounds) == ROUNDS, f"Flower evaluated rounds {sorted(rounds)}"
    return rounds[ROUNDS]


def test_same_accuracy_as_flower_simulation(tmp_path):
    if os.environ.get("COHORT_REQUIRE_FLWR") != "1":
        pytest.importorskip("ray")
    d = load_data()
    init = initial_weights(client_fn, num_partitions=CLIENTS)

    train, evaluate = from_numpy_client(client_fn, server_evaluate_fn=central_evaluate)
    result = cohort.simulate(
        train,
        evaluate,
        initial_weights=init,
        clients=CLIENTS,
        clients_per_round=CLIENTS,
        rounds=ROUNDS,
        seed=0,
        workers=2,
        out=str(tmp_path / "cohort-run"),
        test_data=(d["x_test"], d["y_test"]),
        local_epochs=LOCAL_EPOCHS,
        batch_size=BATCH_SIZE,
        lr=LR,
        progress=False,
    )
    assert not result.failures, result.failures
    cohort_acc = result.accuracy

    flower_acc = _run_flower_ray(list(init.values()))

    print(f"\nfinal test accuracy after {ROUNDS} rounds: Flower (Ray) {flower_acc:.4f}, "
          f"Cohort {cohort_acc:.4f}")
    assert flower_acc > 0.8 and cohort_acc > 0.8
    assert abs(flower_acc - cohort_acc) <= 0.02
