"""Run an unchanged Flower ``NumPyClient`` under Cohort.

A Flower project already has a ``client_fn`` that builds a ``NumPyClient`` for a
partition. :func:`from_numpy_client` turns it into Cohort's ``train`` and ``evaluate``
functions, so the same client code runs in :func:`cohort.simulate` and under
:class:`cohort.EdgeClient`::

    import cohort
    from cohort.flower import from_numpy_client, initial_weights

    from my_flower_app.client_app import client_fn   # def client_fn(context): ...

    train, evaluate = from_numpy_client(client_fn)
    result = cohort.simulate(train, evaluate, initial_weights=initial_weights(client_fn),
                             clients=10, rounds=8)

How Flower's calls map onto Cohort's:

* ``client_fn`` is called for every task, as Flower calls it for every message, with a
  ``flwr.common.Context`` whose ``node_config`` holds ``partition-id``
  (``task.partition_id``) and ``num-partitions``. An old-style ``client_fn(cid: str)``
  gets ``str(partition_id)``. It may return a ``NumPyClient`` or a ``Client`` (from
  ``NumPyClient.to_client()``).
* The weights dict becomes Flower's list of arrays, in the dict's order (writable
  copies, as Flower's deserialised parameters are); the list ``fit`` returns becomes a
  dict again with the same names in the same order.
* Flower's ``config`` holds the task's training config (``local_epochs``,
  ``batch_size``, ``lr``, ``momentum``, ``weight_decay``, ``proximal_mu`` when set),
  then ``task.hyperparameters``, then ``server_round`` (``task.round``).
* ``fit`` returns ``(arrays, num_examples, metrics)``: a :class:`cohort.TrainResult`.
  ``evaluate`` returns ``(loss, num_examples, metrics)``: a :class:`cohort.EvalResult`.

The global test evaluation (``task.partition_id`` is ``None``) has no Flower
counterpart on a client: a ``NumPyClient`` evaluates on its own data. By default the
client built for partition ``evaluate_partition`` (0) evaluates the global model on its
local data; pass ``server_evaluate_fn`` (the ``evaluate_fn`` of Flower's strategies,
``evaluate_fn(server_round, arrays, config) -> (loss, metrics)``) to score it centrally
instead, as a Flower ``FedAvg(evaluate_fn=...)`` would.

Flower itself is not needed to import this module; it is imported when first used.
Without Flower, a duck-typed client (``get_parameters``/``fit``/``evaluate`` with
Flower's signatures) still works, with a minimal stand-in for ``Context``.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._types import EvalResult, Task, TrainResult

__all__ = [
    "from_numpy_client",
    "initial_weights",
    "FlowerTrain",
    "FlowerEvaluate",
]

Weights = Dict[str, np.ndarray]


@dataclass
class _StandInContext:
    """What ``client_fn(context)`` receives when Flower is not installed: the same
    attributes as ``flwr.common.Context``."""

    run_id: int
    node_id: int
    node_config: Dict[str, Any]
    state: Any
    run_config: Dict[str, Any]
    series_id: int = 0


def _is_old_style(client_fn: Callable[..., Any]) -> bool:
    """Whether ``client_fn`` takes a client id string (``client_fn(cid: str)``) rather
    than a Flower ``Context``, decided as Flower's own ``ClientApp`` decides: a first
    parameter annotated ``str`` or named ``cid``."""
    try:
        params = list(inspect.signature(client_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: assume Flower's current form
        return False
    if not params:
        raise TypeError("client_fn must take one argument: a flwr.common.Context (or a cid string)")
    first = params[0]
    annotation = first.annotation
    if annotation is str or annotation == "str":
        return True
    if isinstance(annotation, str) and "Context" in annotation:
        return False
    return first.name == "cid"


def _make_context(
    partition_id: int,
    num_partitions: int,
    run_config: Mapping[str, Any],
) -> Any:
    """A real ``flwr.common.Context`` when Flower is installed, else a stand-in."""
    node_config = {"partition-id": int(partition_id), "num-partitions": int(num_partitions)}
    try:
        from flwr.common import Context, RecordDict  # type: ignore
    except ImportError:
        return _StandInContext(
            run_id=0,
            node_id=int(partition_id),
            node_config=node_config,
            state={},
            run_config=dict(run_config),
        )
    return Context(
        run_id=0,
        node_id=int(partition_id),
        node_config=node_config,
        state=RecordDict(),
        run_config=dict(run_config),
    )


def _num_partitions(explicit: Optional[int], partition_id: int) -> int:
    """``num-partitions`` for the context: the explicit value, else the number of
    clients of the running simulation (its workers know it), else at least
    ``partition_id + 1``."""
    if explicit is not None:
        return int(explicit)
    env = os.environ.get("COHORT_WORKER_CLIENTS")
    if env:
        try:
            return int(env)
        except ValueError:
            pass
    return int(partition_id) + 1


def _to_client(obj: Any) -> Any:
    """Unwraps ``NumPyClient.to_client()`` back to the ``NumPyClient``; a ``Client``
    without one is returned as is (it is then driven with Flower's ``FitIns`` and
    ``EvaluateIns`` messages)."""
    inner = getattr(obj, "numpy_client", None)
    if inner is not None:
        return inner
    return obj


def _is_message_client(client: Any) -> bool:
    """Whether ``client`` is a Flower ``Client`` (message based), not a ``NumPyClient``."""
    try:
        from flwr.client import Client  # type: ignore
    except ImportError:
        return False
    return isinstance(client, Client)


def _flower_config(task: Task) -> Dict[str, Any]:
    """Flower's ``config`` for a task: its training config, its hyperparameters and
    ``server_round``. ``None`` values (``proximal_mu`` outside FedProx) are left out:
    Flower's config values are scalars."""
    config: Dict[str, Any] = {}
    for source in (task.config or {}, task.hyperparameters or {}):
        for key, value in source.items():
            if value is not None:
                config[str(key)] = value
    config["server_round"] = int(task.round)
    return config


def _to_list(weights: Mapping[str, Any]) -> List[np.ndarray]:
    """Cohort's weights (read-only views) as Flower's list of writable arrays."""
    return [np.array(v, copy=True) for v in weights.values()]


def _check_status(res: Any, what: str) -> None:
    status = getattr(res, "status", None)
    code = getattr(status, "code", None)
    if code is not None and getattr(code, "value", code) != 0:
        raise RuntimeError(f"Flower client's {what} failed: {getattr(status, 'message', status)}")


class _Adapter:
    """What :class:`FlowerTrain` and :class:`FlowerEvaluate` share: building the
    Flower client of a partition. Pickled by reference to ``client_fn`` (which must
    therefore be defined at the top level of a module); the per-partition contexts
    stay in the process that made them."""

    def __init__(
        self,
        client_fn: Callable[..., Any],
        num_partitions: Optional[int] = None,
        run_config: Optional[Mapping[str, Any]] = None,
    ) -> None:
        if not callable(client_fn):
            raise TypeError("client_fn must be a function client_fn(context) -> NumPyClient")
        self.client_fn = client_fn
        self.num_partitions = num_partitions
        self.run_config = dict(run_config or {})
        self._old_style = _is_old_style(client_fn)
        self._contexts: Dict[int, Any] = {}

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_contexts"] = {}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _context(self, partition_id: int, task: Optional[Task]) -> Any:
        """The partition's context, kept across rounds in this process (so a
        ``client_fn`` may keep things in ``context.state``, as in Flower)."""
        ctx = self._contexts.get(partition_id)
        if ctx is None:
            run_config = dict(self.run_config)
            if task is not None:
                run_config.update({k: v for k, v in (task.hyperparameters or {}).items()
                                   if v is not None})
            ctx = _make_context(
                partition_id, _num_partitions(self.num_partitions, partition_id), run_config
            )
            self._contexts[partition_id] = ctx
        return ctx

    def client(self, partition_id: int, task: Optional[Task] = None) -> Any:
        """Builds the Flower client of ``partition_id`` with ``client_fn``.

        Args:
            partition_id: The partition (Flower's ``partition-id``).
            task: The task being run (its hyperparameters go into ``run_config``).

        Returns:
            The ``NumPyClient`` (unwrapped from ``to_client()``), or a ``Client``.
        """
        if self._old_style:
            obj = self.client_fn(str(int(partition_id)))
        else:
            obj = self.client_fn(self._context(int(partition_id), task))
        if obj is None:
            raise TypeError("client_fn returned None instead of a NumPyClient or Client")
        return _to_client(obj)


class FlowerTrain(_Adapter):
    """Cohort ``train(weights, task)`` that runs a Flower client's ``fit``.

    Made by :func:`from_numpy_client`; picklable (it holds ``client_fn`` by reference),
    so it can be sent to :func:`cohort.simulate`'s worker processes.

    Args:
        client_fn: Flower's ``client_fn(context)`` or ``client_fn(cid)``.
        num_partitions: ``num-partitions`` in the context's ``node_config`` (default:
            the simulation's number of clients).
        run_config: The context's ``run_config`` (``task.hyperparameters`` are added).
        default_partition: The partition used when ``task.partition_id`` is ``None``
            (a deployed site without a partition id).
    """

    def __init__(
        self,
        client_fn: Callable[..., Any],
        num_partitions: Optional[int] = None,
        run_config: Optional[Mapping[str, Any]] = None,
        default_partition: int = 0,
    ) -> None:
        super().__init__(client_fn, num_partitions, run_config)
        self.default_partition = int(default_partition)

    def __call__(self, weights: Mapping[str, Any], task: Task) -> TrainResult:
        """Runs ``fit`` on the task's partition.

        Args:
            weights: The global model, in the fixed tensor order.
            task: The Cohort task.

        Returns:
            A :class:`cohort.TrainResult` with the arrays ``fit`` returned under the
            names of ``weights``.

        Raises:
            ValueError: ``fit`` returned a different number of arrays than it got, or
                no examples.
            TypeError: ``fit`` returned something other than Flower's 3-tuple.
        """
        pid = self.default_partition if task.partition_id is None else int(task.partition_id)
        client = self.client(pid, task)
        names = list(weights.keys())
        params = _to_list(weights)
        config = _flower_config(task)
        if _is_message_client(client):
            from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays  # type: ignore

            res = client.fit(FitIns(parameters=ndarrays_to_parameters(params), config=config))
            _check_status(res, "fit")
            arrays = parameters_to_ndarrays(res.parameters)
            num_examples, metrics = res.num_examples, res.metrics
        else:
            out = client.fit(params, config)
            if not (isinstance(out, (tuple, list)) and len(out) == 3):
                raise TypeError(
                    "NumPyClient.fit must return (arrays, num_examples, metrics), got "
                    f"{type(out).__name__}"
                )
            arrays, num_examples, metrics = out
        arrays = list(arrays)
        if len(arrays) != len(names):
            raise ValueError(
                f"fit returned {len(arrays)} arrays for a model of {len(names)} tensors "
                f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
            )
        num_examples = int(num_examples)
        if num_examples < 1:
            raise ValueError(
                f"fit on partition {pid} returned num_examples={num_examples}: Cohort "
                "counts the task as a dropout (Flower's FedAvg would give it weight 0)"
            )
        new = {name: np.asarray(a) for name, a in zip(names, arrays)}
        return TrainResult(new, num_examples, dict(metrics or {}))


def _num_examples_of(data: Any, metrics: Mapping[str, Any]) -> int:
    """Examples a central evaluation scored: ``metrics["num_examples"]``, else the
    length of ``task.data`` (its first element for an ``(x, y)`` pair), else 1."""
    for key in ("num_examples", "num-examples"):
        if key in metrics:
            try:
                return max(1, int(metrics[key]))
            except (TypeError, ValueError):
                pass
    if isinstance(data, (tuple, list)) and len(data) == 2 and hasattr(data[0], "__len__"):
        try:
            return max(1, len(data[0]))
        except TypeError:
            pass
    if hasattr(data, "__len__"):
        try:
            return max(1, len(data))
        except TypeError:
            pass
    return 1


class FlowerEvaluate(_Adapter):
    """Cohort ``evaluate(weights, task)`` that runs a Flower client's ``evaluate`` (or
    a Flower server-side ``evaluate_fn``).

    Made by :func:`from_numpy_client`; picklable by reference like
    :class:`FlowerTrain`.

    Args:
        client_fn: Flower's ``client_fn(context)`` or ``client_fn(cid)``.
        evaluate_partition: Whose client scores the global model when
            ``task.partition_id`` is ``None`` (Cohort's per-round test evaluation):
            that client's ``evaluate`` runs on its own local data.
        server_evaluate_fn: Optional Flower-style central evaluation,
            ``evaluate_fn(server_round, arrays, config) -> (loss, metrics)`` (or
            ``None``), used instead of a client when ``task.partition_id`` is ``None``.
            ``metrics["accuracy"]`` becomes the round's test accuracy.
        num_partitions: ``num-partitions`` in the context's ``node_config``.
        run_config: The context's ``run_config``.
    """

    def __init__(
        self,
        client_fn: Callable[..., Any],
        evaluate_partition: int = 0,
        server_evaluate_fn: Optional[Callable[..., Any]] = None,
        num_partitions: Optional[int] = None,
        run_config: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().__init__(client_fn, num_partitions, run_config)
        if server_evaluate_fn is not None and not callable(server_evaluate_fn):
            raise TypeError("server_evaluate_fn must be evaluate_fn(server_round, arrays, config)")
        self.evaluate_partition = int(evaluate_partition)
        self.server_evaluate_fn = server_evaluate_fn

    def __call__(self, weights: Mapping[str, Any], task: Task) -> EvalResult:
        """Scores ``weights``.

        Args:
            weights: The global model, in the fixed tensor order.
            task: The Cohort task (``partition_id`` ``None`` for the test evaluation).

        Returns:
            A :class:`cohort.EvalResult`.

        Raises:
            RuntimeError: ``server_evaluate_fn`` returned ``None``.
            TypeError: the client's ``evaluate`` returned something other than
                Flower's 3-tuple.
        """
        params = _to_list(weights)
        config = _flower_config(task)
        if task.partition_id is None and self.server_evaluate_fn is not None:
            out = self.server_evaluate_fn(int(task.round), params, config)
            if out is None:
                raise RuntimeError("server_evaluate_fn returned None: nothing to record")
            loss, metrics = out
            metrics = dict(metrics or {})
            return EvalResult(float(loss), _num_examples_of(task.data, metrics), metrics)
        pid = self.evaluate_partition if task.partition_id is None else int(task.partition_id)
        client = self.client(pid, task)
        if _is_message_client(client):
            from flwr.common import EvaluateIns, ndarrays_to_parameters  # type: ignore

            res = client.evaluate(
                EvaluateIns(parameters=ndarrays_to_parameters(params), config=config)
            )
            _check_status(res, "evaluate")
            loss, num_examples, metrics = res.loss, res.num_examples, res.metrics
        else:
            out = client.evaluate(params, config)
            if not (isinstance(out, (tuple, list)) and len(out) == 3):
                raise TypeError(
                    "NumPyClient.evaluate must return (loss, num_examples, metrics), got "
                    f"{type(out).__name__}"
                )
            loss, num_examples, metrics = out
        return EvalResult(float(loss), int(num_examples), dict(metrics or {}))


def from_numpy_client(
    client_fn: Callable[..., Any],
    *,
    evaluate_partition: int = 0,
    server_evaluate_fn: Optional[Callable[..., Any]] = None,
    num_partitions: Optional[int] = None,
    run_config: Optional[Mapping[str, Any]] = None,
) -> Tuple[FlowerTrain, FlowerEvaluate]:
    """Turns a Flower ``client_fn`` into Cohort's ``train`` and ``evaluate``.

    The Flower code stays unchanged: ``client_fn`` is called with a
    ``flwr.common.Context`` (``node_config["partition-id"]`` is the task's partition,
    ``node_config["num-partitions"]`` the number of clients), or with ``str(partition)``
    if it is an old-style ``client_fn(cid: str)`` (a first parameter annotated ``str``
    or named ``cid``, as Flower decides). It may return a ``NumPyClient`` or the
    ``Client`` of ``NumPyClient.to_client()``.

    Example::

        train, evaluate = cohort.flower.from_numpy_client(client_fn)
        cohort.simulate(train, evaluate,
                        initial_weights=cohort.flower.initial_weights(client_fn),
                        clients=10, rounds=8)

    Args:
        client_fn: Flower's ``client_fn``, defined at the top level of a module or
            script so that it pickles by reference to the simulation's workers.
        evaluate_partition: Cohort's per-round test evaluation
            (``task.partition_id is None``) has no Flower counterpart on a client: the
            client built for this partition (default 0) evaluates the global model on
            its own local data, and its ``evaluate`` metrics (``accuracy``) become the
            round's test metrics. Use ``server_evaluate_fn`` to score a real test set.
        server_evaluate_fn: Optional central evaluation with the signature of Flower
            strategies' ``evaluate_fn``: ``evaluate_fn(server_round, arrays, config) ->
            (loss, metrics)``. When given, it replaces the client evaluation for
            ``task.partition_id is None``; ``num_examples`` is
            ``metrics["num_examples"]`` or the length of ``task.data`` (Cohort's
            ``test_data``). Must be picklable by reference too.
        num_partitions: ``num-partitions`` in the contexts (default: the simulation's
            ``clients``; outside a simulation, ``partition_id + 1``).
        run_config: The contexts' ``run_config`` (Flower's ``[tool.flwr.app.config]``);
            ``task.hyperparameters`` are added to it.

    Returns:
        ``(train, evaluate)``: a :class:`FlowerTrain` and a :class:`FlowerEvaluate`,
        callables with Cohort's signatures.

    Note:
        Flower calls ``client_fn`` for every message; so does Cohort, for every task. A
        partition's context is kept across rounds in the worker process that made it,
        but Cohort's workers may train a partition in different processes in different
        rounds, so ``context.state`` is not guaranteed to persist.
    """
    train = FlowerTrain(client_fn, num_partitions=num_partitions, run_config=run_config)
    evaluate = FlowerEvaluate(
        client_fn,
        evaluate_partition=evaluate_partition,
        server_evaluate_fn=server_evaluate_fn,
        num_partitions=num_partitions,
        run_config=run_config,
    )
    return train, evaluate


def initial_weights(
    client_fn: Callable[..., Any],
    names: Optional[Sequence[str]] = None,
    *,
    partition_id: int = 0,
    num_partitions: Optional[int] = None,
    run_config: Optional[Mapping[str, Any]] = None,
) -> Weights:
    """The initial model of a Flower client: ``get_parameters(config={})`` of the
    client built for partition 0, as Cohort's weights dict.

    Args:
        client_fn: Flower's ``client_fn(context)`` or ``client_fn(cid)``.
        names: Names of the tensors, in Flower's order (default ``param_0``,
            ``param_1``, ...). Tensors are always matched by position.
        partition_id: Whose client gives the parameters.
        num_partitions: ``num-partitions`` in the context (default
            ``partition_id + 1``: pass your client count if ``client_fn`` partitions
            a data set by it).
        run_config: The context's ``run_config``.

    Returns:
        A dict of name to array (copies), in Flower's order.

    Raises:
        ValueError: ``names`` does not have one name per array, or repeats a name.
    """
    adapter = _Adapter(client_fn, num_partitions=num_partitions, run_config=run_config)
    client = adapter.client(int(partition_id))
    if _is_message_client(client):
        from flwr.common import GetParametersIns, parameters_to_ndarrays  # type: ignore

        res = client.get_parameters(GetParametersIns(config={}))
        _check_status(res, "get_parameters")
        arrays = parameters_to_ndarrays(res.parameters)
    else:
        arrays = client.get_parameters(config={})
    arrays = [np.array(a, copy=True) for a in arrays]
    if names is None:
        names = [f"param_{i}" for i in range(len(arrays))]
    names = [str(n) for n in names]
    if len(names) != len(arrays):
        raise ValueError(f"{len(names)} names for {len(arrays)} arrays from get_parameters")
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    return dict(zip(names, arrays))
