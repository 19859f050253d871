"""``cohort.simulate``: a federated experiment with your own Python training function,
driven by Cohort's Rust round engine."""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _rust
from ._types import ConfigError, EvalResult, Task, TrainResult

__all__ = ["simulate", "SimulationResult"]

Weights = Dict[str, np.ndarray]
TrainFn = Callable[[Weights, Task], TrainResult]
EvalFn = Callable[[Weights, Task], EvalResult]

@dataclass
class SimulationResult:
    """What a finished simulation returns.

    Attributes:
        weights: The final global model, a dict of tensor name to float32 array, in the
            order of ``initial_weights``.
        rounds: One dict per round, the rows of ``metrics.csv``: ``round``,
            ``test_accuracy``, ``test_loss`` (NaN without ``evaluate``),
            ``participants``, ``dropped``, ``selected``, ``seconds``, ``train_loss``,
            ``samples``, ``status``, ``bytes_up`` and ``bytes_down`` (all the round's
            clients together: updates as sent, models as received), ``sim_seconds``,
            ``epsilon`` (against observers of
            the published models) and ``epsilon_coordinator`` (against the coordinator,
            which knows who was sampled: the worst client's own rounds, unamplified;
            ``inf`` under central noise, where the coordinator sees every update); with
            ``client_holdout`` or ``personalise``, ``client_accuracy_mean`` and
            ``client_accuracy_p10`` (the global model on each client's held-out rows)
            and ``personal_accuracy_mean`` and ``personal_accuracy_p10`` (each client's
            personalised model), ``None`` otherwise.
        summary: The run's ``summary.json`` as a dict (resolved configuration, totals,
            epsilon spent against observers and against the coordinator,
            ``total_failed``).
        failures: The tasks that failed (each a dropout): ``client``, ``round`` and
            ``reason`` (the exception's message, or which tensor was wrong).
        out: The directory holding ``metrics.csv``, ``metrics.jsonl``,
            ``summary.json``, ``accuracy.png`` and ``accuracy.svg``.
    """

    weights: Weights
    rounds: List[Dict[str, Any]]
    summary: Dict[str, Any]
    failures: List[Dict[str, Any]] = field(default_factory=list)
    out: str = ""

    @property
    def accuracy(self) -> float:
        """Test accuracy after the last round (NaN without ``evaluate``)."""
        return float(self.rounds[-1]["test_accuracy"]) if self.rounds else math.nan


def simulate(
    train: TrainFn,
    evaluate: Optional[EvalFn] = None,
    initial_weights: Union[Mapping[str, Any], Callable[[], Mapping[str, Any]], None] = None,
    client_data: Union[Callable[[int], Any], Tuple[Any, Any], None] = None,
    clients: int = 10,
    clients_per_round: Optional[int] = None,
    rounds: int = 10,
    strategy: str = "fedavg",
    partition: str = "dirichlet:0.5",
    secure_aggregation: bool = False,
    dp: Optional[Mapping[str, Any]] = None,
    dropout: float = 0.0,
    seed: int = 0,
    workers: int = 2,
    devices: Optional[Sequence[str]] = None,
    out: Optional[str] = None,
    *,
    test_data: Any = None,
    local_epochs: int = 1,
    batch_size: int = 32,
    lr: float = 0.01,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    min_participants: int = 1,
    hyperparameters: Optional[Mapping[str, Any]] = None,
    task_timeout: Optional[float] = None,
    target_accuracy: Optional[float] = None,
    progress: bool = True,
    python: Optional[str] = None,
    **settings: Any,
) -> SimulationResult:
    """Runs a federated experiment with your ``train`` function on virtual clients.

    The Rust round engine selects clients, runs the strategy, secure aggregation,
    differential privacy and its accountant, dropouts and stragglers, exactly as
    ``cohort simulate`` does for the built-in models; your functions run in a pool of
    ``workers`` Python processes (no Ray). The same ``train`` runs unchanged under
    :class:`cohort.EdgeClient` in deployment.

    Args:
        train: ``train(weights, task) -> TrainResult``. ``weights`` is the global model
            as a dict of read-only float32 NumPy arrays, without copies (on Linux they
            view memory the worker shares with the engine, where a later round's model
            is written: copy an array to change it, or to keep it past the call); ``task`` is a :class:`cohort.Task` (round, seed, ``partition_id``,
            training ``config``, ``hyperparameters`` and this client's ``data``). Return
            the new weights (same names and shapes), the number of examples trained on
            and optional metrics. An exception, or weights with a wrong shape, a NaN, a
            missing tensor or a non-float dtype, fails that client's task: it counts as
            a dropout and is listed in ``result.failures``. A round in which every
            client fails raises :class:`cohort.TrainError`.
        evaluate: Optional ``evaluate(weights, task) -> EvalResult``, called once per
            round on the new global model with ``task.partition_id = None`` and
            ``task.data = test_data``; ``metrics["accuracy"]`` becomes the round's test
            accuracy. In deployment the same function scores the model on a site's own
            data.
        initial_weights: The model before round 1: a dict of name to array, a PyTorch
            ``state_dict`` (or module), or a function returning one.
        client_data: Each client's data. A function ``client_data(partition_id)``
            called in the worker (its result is cached there and passed as
            ``task.data``), or an ``(x, y)`` pair of arrays that Cohort splits over the
            clients with ``partition`` (``y`` holds class indices); ``None`` when
            ``train`` loads its own data by ``task.partition_id``.
        clients: Number of virtual clients (partition ids ``0..clients``).
        clients_per_round: Clients selected each round (default: all).
        rounds: Rounds to run.
        strategy: ``fedavg``, ``fedprox:MU``, ``fedadam``, ``fedyogi`` or
            ``fedadagrad`` (the server optimisers take ``server_lr=``).
        partition: How an ``(x, y)`` ``client_data`` is split: ``iid``,
            ``dirichlet:ALPHA``, ``shards:K`` and the other ``cohort partition``
            schemes.
        secure_aggregation: SecAgg+ (pairwise masks, dropout recovery): the engine
            sees only the sum of the updates.
        dp: Central or distributed differential privacy, e.g.
            ``{"noise_multiplier": 1.0, "clip": 1.0, "delta": 1e-5, "epsilon": 8.0}``
            (keys of ``cohort simulate``'s ``--dp-*`` flags without the prefix;
            ``"budget_against": "coordinator"`` enforces ``epsilon`` on the worst
            client's epsilon against the coordinator, with secure aggregation). Each
            round's two epsilons are in ``result.rounds``.
        dropout: Probability that a selected client drops out of a round.
        seed: Seed of every random choice (selection, partition, dropouts, task seeds).
        workers: Python worker processes training clients in parallel.
        devices: Pins workers to devices, round robin: ``["cuda:0", "cuda:1"]`` makes
            each worker see only its GPU (``CUDA_VISIBLE_DEVICES``); ``"cpu"`` hides
            every GPU. Default: the workers inherit the environment.
        out: Output directory (default ``runs/simulate-<timestamp>``); it appears only
            when the run finishes.
        test_data: What ``evaluate`` gets as ``task.data`` (or a function returning
            it, called once in the evaluating worker).
        local_epochs: ``task.config["local_epochs"]``.
        batch_size: ``task.config["batch_size"]``.
        lr: ``task.config["lr"]``.
        momentum: ``task.config["momentum"]``.
        weight_decay: ``task.config["weight_decay"]``.
        min_participants: Fewest updates a round needs to publish.
        hyperparameters: Free-form settings for ``task.hyperparameters``.
        task_timeout: Seconds after which a task's worker is killed and the task fails.
        target_accuracy: Report the first round reaching this test accuracy.
        progress: Print one line per round to standard error.
        python: Interpreter for the workers (default: this one).
        **settings: Any other ``cohort simulate`` setting by its name with underscores
            (``server_lr``, ``mode="fedbuff"``, ``straggler``, ``aggregator``,
            ``dropout_stage``, ``threshold``, ``max_weight``, ...). Compression:
            ``compress_up="quantize:4"`` (or ``"sign"``, ``"topk:0.01"``),
            ``compress_down="quantize:4"``, ``word_bits=16`` (secure rounds); the
            update your ``train`` returns is compressed after it returns, and it
            trains from the model as the client decoded it. Personalisation:
            ``personalise="fedper:fc2.weight,fc2.bias"`` (those tensors stay each
            client's own and never reach the aggregate) or ``"finetune:EPOCHS"``, with
            ``client_holdout=0.2``: each client's ``(x, y)`` keeps that fraction out of
            ``task.data``, and ``evaluate`` scores the global and the personalised model
            on it every round (``personal_accuracy_mean`` and ``_p10`` beside
            ``client_accuracy_*`` in ``result.rounds``, every client in
            ``clients.csv``). TensorBoard: ``tensorboard="runs/tb"`` writes every
            round's metrics as event files in ``runs/tb/<strategy>/``. MLflow:
            ``mlflow_uri="http://127.0.0.1:5000"`` (and ``mlflow_experiment=``)
            reports the settings, every round's metrics and the final model to a
            tracking server.

    Returns:
        A :class:`SimulationResult`.

    Raises:
        cohort.ConfigError: A setting is invalid (raised before any work starts).
        cohort.TrainError: Every client of a round failed, or the initial weights or
            the evaluation are unusable.
        KeyboardInterrupt: Ctrl-C; the workers are stopped and nothing is written.
    """
    if not callable(train):
        raise ConfigError("train must be a function train(weights, task) -> TrainResult")
    if evaluate is not None and not callable(evaluate):
        raise ConfigError("evaluate must be a function evaluate(weights, task) -> EvalResult")
    if initial_weights is None:
        raise ConfigError("initial_weights is required: a dict of name to array or a state_dict")
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ConfigError(f"clients must be a positive integer, got {clients!r}")
    config: Dict[str, Any] = {
        "clients": clients,
        "rounds": rounds,
        "strategy": strategy,
        "partition": partition,
        "secure-aggregation": bool(secure_aggregation),
        "dropout": dropout,
        "seed": seed,
        "local-epochs": local_epochs,
        "batch-size": batch_size,
        "lr": lr,
        "momentum": momentum,
        "weight-decay": weight_decay,
        "min-participants": min_participants,
    }
    if clients_per_round is not None:
        config["clients-per-round"] = clients_per_round
    if out is not None:
        config["out"] = os.fspath(out)
    if target_accuracy is not None:
        config["target-accuracy"] = target_accuracy
    for key, value in (dp or {}).items():
        config["dp-" + key.replace("_", "-")] = value
    for key, value in settings.items():
        config[key.replace("_", "-")] = value

    dataset = None
    partitions = None
    data_fn = None
    if isinstance(client_data, tuple):
        if len(client_data) != 2:
            raise ConfigError("client_data as a tuple must be (x, y)")
        x, y = (np.asarray(a) for a in client_data)
        if len(x) != len(y):
            raise ConfigError(f"client_data: x has {len(x)} rows but y has {len(y)}")
        labels = np.ascontiguousarray(y, dtype=np.int64)
        partitions = _rust.partition(labels, clients, partition, seed)
        dataset = (x, y)
    elif client_data is not None:
        if not callable(client_data):
            raise ConfigError("client_data must be a function of the partition id or an (x, y) pair")
        data_fn = client_data

    spec = {
        "train": train,
        "evaluate": evaluate,
        "client_data": data_fn,
        "test_data": test_data,
        "initial_weights": _plain_weights(initial_weights),
        "dataset": dataset,
        "partitions": partitions,
    }
    # Settings are checked before the data is split or anything is pickled.
    _rust.check_config(json.dumps(config))
    with tempfile.TemporaryDirectory(prefix="cohort-sim-") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        _write_payload(payload, spec)
        raw = _rust.simulate(
            json.dumps(config),
            python or sys.executable,
            payload,
            workers,
            list(devices or []),
            task_timeout,
            clients,
            json.dumps(dict(hyperparameters or {})),
            progress,
        )
    return SimulationResult(
        weights=dict(raw["weights"]),
        rounds=list(raw["rounds"]),
        summary=json.loads(raw["summary"]),
        failures=list(raw["failures"]),
        out=raw["out"],
    )


def _plain_weights(weights: Any) -> Any:
    """Torch tensors become NumPy arrays before pickling, so the workers need not
    rebuild them (nor import torch just for that)."""
    if callable(weights) and not hasattr(weights, "state_dict"):
        return weights
    if hasattr(weights, "state_dict") and callable(weights.state_dict):
        weights = weights.state_dict()
    if isinstance(weights, Mapping):
        out = {}
        for k, v in weights.items():
            if hasattr(v, "detach") and hasattr(v, "cpu"):
                v = v.detach().cpu().numpy()
            out[k] = v
        return out
    return weights


def _write_payload(path: str, spec: Dict[str, Any]) -> None:
    """Pickles the user's functions and data for the workers. A function defined in the
    script being run (``__main__``) is found again in the workers by loading that script
    as ``__mp_main__``, as multiprocessing's spawn method does; ``cloudpickle`` is used
    when installed, so lambdas and closures work too."""
    main = sys.modules.get("__main__")
    main_path = getattr(main, "__file__", None)
    try:
        import cloudpickle  # type: ignore

        dumps: Callable[[Any], bytes] = cloudpickle.dumps
        main_path = None  # cloudpickle carries __main__'s functions by value
    except ImportError:
        dumps = lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # noqa: E731
    try:
        body = dumps(spec)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do about it
        raise ConfigError(
            f"cannot send your functions to the workers: {exc}. Define train, evaluate and "
            "client_data at the top level of a module or script (not inside a function or "
            "as a lambda), or install cloudpickle."
        ) from exc
    preamble = {
        "main_path": main_path if main_path and os.path.exists(main_path) else None,
        # The workers import what this process can, as multiprocessing's children do.
        "sys_path": list(sys.path),
    }
    with open(path, "wb") as f:
        pickle.dump(preamble, f)
        f.write(body)
