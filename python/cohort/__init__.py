"""Cohort: federated learning with secure aggregation and differential privacy, with a
Rust core.

The same training function runs in simulation and in deployment::

    import cohort

    def train(weights, task):
        ...  # your PyTorch or NumPy code on task.data
        return cohort.TrainResult(new_weights, num_examples, {"loss": loss})

    result = cohort.simulate(train, evaluate, initial_weights=w0, client_data=(x, y),
                             clients=100, clients_per_round=10, rounds=50)

    cohort.EdgeClient("https://coordinator:8443", ca_cert="ca.pem",
                      enrol_token=token, state_dir="site").run(train, evaluate)

Public API: :func:`simulate`, :class:`EdgeClient`, :class:`Admin`, :class:`Task`,
:class:`TrainResult`, :class:`EvalResult`, the exceptions, and the modules
:mod:`cohort.datasets`, :mod:`cohort.flower` and :mod:`cohort.torch`.
"""

from . import _rust
from ._types import (
    ApiError,
    CohortError,
    ConfigError,
    EvalResult,
    Task,
    TrainError,
    TrainResult,
    UnreachableError,
)
from . import datasets
from .admin import Admin
from .edge import EdgeClient
from .simulation import SimulationResult, simulate

__version__: str = _rust.__version__

__all__ = [
    "Admin",
    "ApiError",
    "CohortError",
    "ConfigError",
    "EdgeClient",
    "EvalResult",
    "SimulationResult",
    "Task",
    "TrainError",
    "TrainResult",
    "UnreachableError",
    "datasets",
    "simulate",
    "__version__",
]
