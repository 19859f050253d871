"""``cohort.EdgeClient``: a site's Python training function, served to a Cohort
coordinator by the Rust edge agent."""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from . import _rust
from ._types import ConfigError, EvalResult, Task, TrainResult, _check_result
from ._tensors import _describe, _to_numpy_dict

__all__ = ["EdgeClient"]

PathLike = Union[str, "os.PathLike[str]"]


def _code_files(*functions: Optional[Callable[..., Any]]) -> List[str]:
    """The source files of ``functions`` (each once, in order): what a site approves by
    hash. A function without a source file (a built-in, a lambda typed at a prompt) adds
    none."""
    files: List[str] = []
    for fn in functions:
        if fn is None:
            continue
        try:
            path = inspect.getsourcefile(inspect.unwrap(fn))
        except TypeError:
            path = None
        if path and os.path.isfile(path):
            path = os.path.abspath(path)
            if path not in files:
                files.append(path)
    return files


def _read(path: Optional[PathLike], what: str) -> Optional[bytes]:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{what} `{os.fspath(path)}`: {exc.strerror}") from exc


class EdgeClient:
    """A site (a hospital server, a workstation, a phone app) that trains for a Cohort
    coordinator with your own ``train`` function.

    Everything around the function is Rust: enrolment with a one-time token, TLS (and
    mutual TLS), check-in, SecAgg+ masking, clipping, checks of what the function
    returned (names, shapes, dtypes, finite values), retries and idempotent uploads.
    The function runs on the thread that called :meth:`run`, so Ctrl-C interrupts it;
    network waits release the GIL. A ``train`` that raises fails that task (its message
    is reported to the coordinator, which counts the site as a dropout) and the client
    carries on.

    Example::

        client = cohort.EdgeClient("https://coordinator:8443", ca_cert="ca.pem",
                                   enrol_token=token, state_dir="site-a")
        client.run(train, evaluate)

    Args:
        coordinator: The coordinator's base URL, ``https://host:port``.
        ca_cert: PEM file of the CA that signed the coordinator's certificate (its dev
            CA, or your organisation's); ``None`` trusts the system's roots.
        enrol_token: The one-time enrolment token an admin issued; needed only until
            the client's credential is stored in ``state_dir``.
        state_dir: Where the credential is kept (created if missing, file mode 0600).
            Restarting with the same directory resumes as the same client.
        client_cert: PEM certificate chain for mutual TLS (``cohort serve --client-ca``).
        client_key: PEM private key of ``client_cert``.
        data: Anything; passed to every task as ``task.data`` (your loaders, arrays).
        partition_id: Passed as ``task.partition_id`` (a site's data shard, if any).
        seed: Seed of the task seeds (each task's seed follows the round number, so a
            round handed out again trains the same way).
        idle_exit: Stop after this many seconds without a task (default: run until
            stopped).
        insecure_http: Allow a plain ``http://`` coordinator. The enrolment token, the
            client's credential and its updates then cross the network unencrypted:
            only for a test or a network you trust end to end. Without it such a URL
            is a :class:`cohort.ConfigError` (loopback addresses included).
        allowed_experiments: Only tasks of these experiment ids run on this site's
            data; any other is refused, reported to the coordinator and written to the
            site log (``site-log.jsonl`` in ``state_dir``, one JSON line per task).
        max_rounds: At most this many training rounds of any one experiment.
        approve_trainer: Only run while the source files of ``train`` (and
            ``evaluate``) have this SHA-256 (:meth:`trainer_hash`); checked before every
            task, so code edited after approval is refused.
        columns: The columns of the site's data that may be read (``label`` among
            them): a task whose experiment reads another (its spec's ``columns``), or
            does not name the columns it reads, is refused, reported and logged. The
            task's ``columns`` say which to give ``train``; pair it with
            ``approve_trainer`` for code that reads no other.
    """

    def __init__(
        self,
        coordinator: str,
        ca_cert: Optional[PathLike] = None,
        enrol_token: Optional[str] = None,
        state_dir: PathLike = "cohort-state",
        *,
        client_cert: Optional[PathLike] = None,
        client_key: Optional[PathLike] = None,
        data: Any = None,
        partition_id: Optional[int] = None,
        seed: int = 0,
        idle_exit: Optional[float] = None,
        insecure_http: bool = False,
        allowed_experiments: Optional[Sequence[str]] = None,
        max_rounds: Optional[int] = None,
        approve_trainer: Optional[str] = None,
        columns: Optional[Sequence[str]] = None,
    ) -> None:
        if not isinstance(coordinator, str) or not coordinator.lower().startswith(
            ("https://", "http://")
        ):
            raise ConfigError(f"coordinator must be an https:// URL, got {coordinator!r}")
        if coordinator.lower().startswith("http://") and not insecure_http:
            raise ConfigError(
                "refusing the plain HTTP coordinator: the enrolment token, the client's "
                "credential and its updates would cross the network unencrypted. Use an "
                "https:// URL, or pass insecure_http=True for a test or a network you "
                "trust end to end"
            )
        if (client_cert is None) != (client_key is None):
            raise ConfigError("client_cert and client_key go together")
        self.coordinator = coordinator
        self._ca = _read(ca_cert, "ca_cert")
        identity = None
        if client_cert is not None:
            identity = (_read(client_cert, "client_cert") or b"") + b"\n" + (
                _read(client_key, "client_key") or b""
            )
        self._identity = identity
        self._token = enrol_token
        self.state_dir = os.fspath(state_dir)
        self.data = data
        self.partition_id = partition_id
        self.seed = int(seed)
        self.idle_exit = idle_exit
        self.insecure_http = bool(insecure_http)
        self._site: Dict[str, Any] = {
            "allowed_experiments": (
                None if allowed_experiments is None else [str(e) for e in allowed_experiments]
            ),
            "max_rounds": max_rounds,
            "approve_trainer": approve_trainer,
            "columns": None if columns is None else [str(c) for c in columns],
        }
        self._train: Optional[Callable[..., Any]] = None
        self._evaluate: Optional[Callable[..., Any]] = None

    @staticmethod
    def trainer_hash(
        train: Callable[..., Any], evaluate: Optional[Callable[..., Any]] = None
    ) -> str:
        """The SHA-256 a site approves with ``approve_trainer``: over the source files of
        ``train`` and ``evaluate`` (each once), as ``cohort-edge --trainer-hash`` hashes
        a trainer's files."""
        return _rust.code_sha256(_code_files(train, evaluate))

    def train(self, fn: Callable[[Dict[str, np.ndarray], Task], TrainResult]) -> Callable[..., Any]:
        """Decorator form: registers ``fn`` as the training function.

        ::

            @client.train
            def train(weights, task): ...
        """
        self._train = fn
        return fn

    def evaluate(self, fn: Callable[[Dict[str, np.ndarray], Task], EvalResult]) -> Callable[..., Any]:
        """Decorator form: registers ``fn`` as the evaluation function (run on the
        coordinator's evaluation tasks, on this site's own data)."""
        self._evaluate = fn
        return fn

    def run(
        self,
        train: Optional[Callable[..., Any]] = None,
        evaluate: Optional[Callable[..., Any]] = None,
    ) -> Dict[str, Any]:
        """Enrols if needed, then serves tasks until ``idle_exit`` passes without one.

        Args:
            train: ``train(weights, task) -> TrainResult`` (or the one registered with
                the decorator).
            evaluate: Optional ``evaluate(weights, task) -> EvalResult``.

        Returns:
            What the client did: ``client_id``, ``uploads``, ``failed``, ``skipped``,
            ``evaluations`` and ``refused`` (tasks the site's rules refused).

        Raises:
            cohort.UnreachableError: The coordinator cannot be reached at the first
                contact (wrong address, port or CA).
            cohort.ApiError: The coordinator refused the client for good (a spent
                token, a revoked client: ``status`` 403, ``code`` ``forbidden``).
            KeyboardInterrupt: Ctrl-C; the client stops within a second and its
                stored credential stays valid.
        """
        train = train or self._train
        evaluate = evaluate or self._evaluate
        if train is None or not callable(train):
            raise ConfigError("run needs a train function")

        def handler(kind: str, weights: Dict[str, np.ndarray], info: Dict[str, Any]):
            task = Task(
                round=int(info["round"]),
                seed=int(info["seed"]),
                partition_id=info.get("partition_id"),
                config=info.get("config") or {},
                hyperparameters=info.get("hyperparameters") or {},
                data=self.data,
            )
            if kind == "evaluate":
                if evaluate is None:
                    raise RuntimeError("this client has no evaluate function")
                result = _check_result(evaluate(weights, task), EvalResult, "evaluate")
                metrics = {k: float(v) for k, v in (result.metrics or {}).items()}
                metrics.setdefault("loss", float(result.loss))
                return int(result.num_examples), metrics, None, b""
            result = _check_result(train(weights, task), TrainResult, "train")
            arrays = _to_numpy_dict(result.weights, "TrainResult.weights")
            tensors, parts = _describe(arrays)
            body = b"".join(memoryview(p).cast("B") for p in parts)
            metrics = {}
            for k, v in (result.metrics or {}).items():
                try:
                    metrics[str(k)] = float(v)
                except (TypeError, ValueError):
                    pass
            described = [(t["name"], t["dtype"], list(t["shape"])) for t in tensors]
            return int(result.num_examples), metrics, described, body

        return dict(
            _rust.run_edge(
                self.coordinator,
                self._ca,
                self._identity,
                self._token,
                self.state_dir,
                self.seed,
                self.idle_exit,
                self.partition_id,
                handler,
                self.insecure_http,
                dict(self._site, code_files=_code_files(train, evaluate)),
            )
        )
