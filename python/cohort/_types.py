"""What a training function receives and returns, and Cohort's exceptions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import numpy as np

__all__ = [
    "Task",
    "TrainResult",
    "EvalResult",
    "CohortError",
    "ConfigError",
    "TrainError",
    "ApiError",
    "UnreachableError",
]


@dataclass(frozen=True)
class Task:
    """One piece of work for a client, the same in simulation and in deployment.

    Attributes:
        round: The round this task belongs to (1 for the first).
        seed: A seed for the task's randomness (shuffling, dropout, augmentation).
            Simulation derives it from the run's seed, the round and the client, so a
            run repeats exactly.
        partition_id: The client's partition (``0..clients``) in simulation; the
            site's configured partition id, or ``None``, in deployment; ``None`` when
            ``evaluate`` is asked to score the global model on the held-out test set.
        config: The round's training settings: ``local_epochs``, ``batch_size``,
            ``lr``, ``momentum``, ``weight_decay`` and ``proximal_mu`` (``None``
            outside FedProx).
        hyperparameters: The experiment's free-form settings (``hyperparameters=`` in
            ``simulate``, the experiment's ``hyperparameters`` when deployed).
        data: The client's data: what ``client_data(partition_id)`` returned, or the
            ``(x, y)`` slice of the dataset for this partition; for a test-set
            evaluation, ``test_data``; ``None`` when no data was given (the function
            loads its own by ``partition_id``).
        worker: Index of the worker process running the task (simulation), else 0.
    """

    round: int
    seed: int
    partition_id: Optional[int]
    config: Mapping[str, Any] = field(default_factory=dict)
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    data: Any = None
    worker: int = 0

    @property
    def local_epochs(self) -> int:
        """Passes over the local data this round (``config["local_epochs"]``)."""
        return int(self.config.get("local_epochs", 1))

    @property
    def batch_size(self) -> int:
        """Examples per step (``config["batch_size"]``)."""
        return int(self.config.get("batch_size", 32))

    @property
    def lr(self) -> float:
        """Learning rate (``config["lr"]``)."""
        return float(self.config.get("lr", 0.01))


@dataclass
class TrainResult:
    """What ``train`` returns.

    Attributes:
        weights: The new weights, a dict of tensor name to array with the same names
            and shapes as the weights ``train`` received (float32 or float64; a
            PyTorch ``state_dict`` is accepted too).
        num_examples: Examples trained on: the update's weight in the average.
        metrics: Numbers to report (``loss`` is recorded as the training loss).
    """

    weights: Mapping[str, Any]
    num_examples: int
    metrics: Dict[str, float] = field(default_factory=dict)


@dataclass
class EvalResult:
    """What ``evaluate`` returns.

    Attributes:
        loss: Mean loss over the examples.
        num_examples: Examples evaluated.
        metrics: Other numbers (``accuracy`` is the test accuracy that simulation
            records and plots).
    """

    loss: float
    num_examples: int
    metrics: Dict[str, float] = field(default_factory=dict)


class CohortError(Exception):
    """Base class of Cohort's exceptions."""


class ConfigError(CohortError, ValueError):
    """A setting is invalid (an unknown strategy, a bad partition scheme, ...).
    Raised before any work starts."""


class TrainError(CohortError):
    """Training could not go on: every client of a round failed, or the initial
    weights, the data or the evaluation are unusable. The message says which client,
    which round and why (the exception's message, or the tensor that was wrong)."""


class ApiError(CohortError):
    """The coordinator refused a request.

    Attributes:
        status: The HTTP status (403 for a revoked client, 404, 409, ...).
        code: The API's error code (``forbidden``, ``not_found``, ``conflict``, ...).
        message: The coordinator's explanation.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class UnreachableError(CohortError, ConnectionError):
    """The coordinator could not be reached (refused, timed out, TLS failed)."""


def _check_result(result: Any, kind: type, function: str) -> Any:
    """Accepts a result object, or the tuple a Flower user would write:
    ``(weights, num_examples[, metrics])`` from ``train`` and
    ``(loss, num_examples[, metrics])`` from ``evaluate``."""
    if isinstance(result, kind):
        pass
    elif isinstance(result, tuple) and len(result) in (2, 3):
        result = kind(*result)
    else:
        raise TypeError(
            f"{function} must return cohort.{kind.__name__} (or a tuple "
            f"({'weights' if kind is TrainResult else 'loss'}, num_examples[, metrics])), "
            f"got {type(result).__name__}"
        )
    n = result.num_examples
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{function}: num_examples must be a positive integer, got {n!r}")
    if result.metrics is None:
        result.metrics = {}
    if not isinstance(result.metrics, Mapping):
        raise TypeError(f"{function}: metrics must be a dict of name to number")
    return result
