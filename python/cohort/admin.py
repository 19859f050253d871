"""``cohort.Admin``: drives a coordinator's REST API (``/api/v1/admin/...``) from Python.

Standard library only (``urllib`` and ``ssl``) plus NumPy; model files are encoded and
decoded by the compiled module. Example::

    admin = cohort.Admin("https://127.0.0.1:8443", token, ca_cert="cohort-data/tls/ca.pem")
    model = admin.upload_model({"layers.0.weight": w, "layers.0.bias": b}, name="init")
    exp = admin.create_experiment({
        "name": "digits", "model": "logreg", "features": 64, "classes": 10,
        "initial_model": model["id"], "rounds": 20,
        "clients_per_round": 10, "min_participants": 8,
    })
    admin.start(exp["id"])
    for r in admin.watch(exp["id"]):
        print(r["round"], r["test_accuracy"])
    weights = admin.download_model(exp["id"])
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _rust
from ._types import ApiError, ConfigError, UnreachableError

__all__ = ["Admin"]

PathLike = Union[str, "os.PathLike[str]"]
Id = Union[str, uuid.UUID]

#: Experiment states after which no round publishes any more.
TERMINAL_STATES = frozenset({"finished", "stopped", "failed"})

_ADMIN = "/api/v1/admin"

#: The code given to each status when its body is not the coordinator's JSON error (a
#: proxy's page, say): the coordinator's own where it has one code for the status
#: (``error_code.rs``); a 409 from Cohort always says which conflict it is.
_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_body",
    429: "rate_limited",
    500: "internal",
    502: "bad_gateway",
    503: "unavailable",
    504: "gateway_timeout",
}

_NO_BODY = object()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Never follows a redirect: the admin token would go along to wherever it points.
    A 3xx answer becomes an :class:`ApiError` instead."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        """Refuses every redirect (``None``: the 3xx is raised as an HTTP error)."""
        return None


def _reason(exc: BaseException) -> str:
    """An OS or TLS error's own words (``strerror`` without the errno noise)."""
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)


def _json_default(value: Any) -> Any:
    """NumPy scalars and arrays in a spec become plain JSON numbers and lists."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _segment(value: Any, what: str) -> str:
    """One path segment: an id (a string or a UUID), or a record carrying its ``id``."""
    if isinstance(value, Mapping):
        value = value.get("id")
    if isinstance(value, uuid.UUID):
        value = str(value)
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be an id (a string or uuid.UUID), got {value!r}")
    return urllib.parse.quote(value, safe="")


def _tensors(weights: Any) -> List[Tuple[str, List[int], np.ndarray]]:
    """``(name, shape, flat float32 values)`` for every tensor of a dict of arrays, a
    PyTorch ``state_dict`` or a module (duck-typed: torch is never imported here)."""
    if hasattr(weights, "state_dict") and callable(weights.state_dict):
        weights = weights.state_dict()
    if not isinstance(weights, Mapping):
        raise TypeError(
            "weights must be a dict of tensor name to array, a PyTorch state_dict or a "
            f"module, got {type(weights).__name__}"
        )
    if not weights:
        raise ValueError("weights hold no tensors")
    out = []
    for name, value in weights.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
            value = value.detach().cpu()
            is_float = getattr(value, "is_floating_point", None)
            if callable(is_float) and is_float():
                value = value.float()  # bfloat16 and float16 have no NumPy view
            value = value.numpy()
        array = np.asarray(value)
        if array.dtype.kind not in "fiub":
            raise TypeError(f"tensor `{name}` has dtype {array.dtype}, not a real number type")
        with np.errstate(over="ignore"):
            flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
        if not np.isfinite(flat).all():
            raise ValueError(
                f"tensor `{name}` has values that are not finite as float32 (NaN, inf, or "
                "out of float32's range)"
            )
        out.append((name, [int(d) for d in array.shape], flat))
    return out


class Admin:
    """An administrator's connection to a Cohort coordinator (``cohort serve``).

    Every method is one request (or, for :meth:`watch`, a series of them) to the REST
    API under ``/api/v1/admin``, authenticated with the admin token as a bearer token.
    Replies are returned as the coordinator sends them (dicts and lists, parsed from
    JSON); see the coordinator's OpenAPI document at ``/api/v1/openapi.json``.

    Example::

        admin = cohort.Admin("https://127.0.0.1:8443", os.environ["COHORT_ADMIN_TOKEN"],
                             ca_cert="cohort-data/tls/ca.pem")
        exp = admin.create_experiment({"name": "demo", "model": "mlp:64",
                                       "features": 64, "classes": 10, "rounds": 15,
                                       "clients_per_round": 10, "min_participants": 8})
        admin.start(exp["id"])

    Args:
        url: The coordinator's base URL, ``https://host:port`` (``http://`` for a
            coordinator run with ``--insecure-http``).
        token: The admin token (``COHORT_ADMIN_TOKEN``, or the one ``cohort serve``
            printed at first start). It is sent only to ``url``, never follows a
            redirect, and never appears in an exception's message or in ``repr``.
        ca_cert: PEM file of the CA that signed the coordinator's certificate (for
            ``cohort serve --dev-tls``, ``<data dir>/tls/ca.pem``); ``None`` trusts the
            system's roots.
        timeout: Seconds each request may wait for the connection or for data.
        client_cert: PEM certificate (chain) for mutual TLS, when the coordinator runs
            with ``--client-ca``.
        client_key: The private key of ``client_cert`` (``None``: it is in
            ``client_cert``'s file).

    Raises:
        ConfigError: The URL is not ``http(s)://``, the token is empty, or a
            certificate or key file cannot be read or parsed.
    """

    def __init__(
        self,
        url: str,
        token: str,
        ca_cert: Optional[PathLike] = None,
        timeout: float = 30.0,
        *,
        client_cert: Optional[PathLike] = None,
        client_key: Optional[PathLike] = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("https://", "http://")):
            raise ConfigError(f"url must be an https:// URL, got {url!r}")
        parsed = urllib.parse.urlsplit(url)
        if not parsed.hostname:
            raise ConfigError(f"url has no host: {url!r}")
        if not isinstance(token, str) or not token.strip():
            raise ConfigError("token must be the admin token, a non-empty string")
        if "\n" in token or "\r" in token:
            raise ConfigError("token must be a single line")
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if client_key is not None and client_cert is None:
            raise ConfigError("client_key needs client_cert")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._token = token.strip()
        try:
            context = ssl.create_default_context(
                cafile=None if ca_cert is None else os.fspath(ca_cert)
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"ca_cert `{os.fspath(ca_cert)}`: {_reason(exc)}") from None
        if client_cert is not None:
            try:
                context.load_cert_chain(
                    os.fspath(client_cert),
                    None if client_key is None else os.fspath(client_key),
                )
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"client_cert `{os.fspath(client_cert)}`: {_reason(exc)}"
                ) from None
        self._opener = urllib.request.build_opener(
            urllib.request.HTTPSHandler(context=context), _NoRedirect()
        )

    def __repr__(self) -> str:
        """``cohort.Admin('https://host:port')``: the URL, never the token."""
        return f"cohort.Admin({self.url!r})"

    # ---------------------------------------------------------------- plumbing

    def _scrub(self, text: str) -> str:
        """``text`` with the admin token blanked out, wherever it came from."""
        return text.replace(self._token, "<admin token>") if self._token in text else text

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: Optional[Mapping[str, Any]] = None,
        json_body: Any = _NO_BODY,
        data: Optional[bytes] = None,
        content_type: Optional[str] = None,
        raw: bool = False,
        auth: bool = True,
    ) -> Any:
        """One request; the parsed JSON answer (``None`` when empty), or its bytes when
        ``raw``. Raises :class:`ApiError` for an answer that is not 2xx and
        :class:`UnreachableError` when no answer came."""
        url = self.url + path
        if query:
            pairs = {k: v for k, v in query.items() if v is not None}
            if pairs:
                url += "?" + urllib.parse.urlencode(pairs)
        headers = {
            "Accept": "application/octet-stream" if raw else "application/json",
            "User-Agent": f"cohort-python/{getattr(_rust, '__version__', '0')}",
        }
        if auth:
            headers["Authorization"] = "Bearer " + self._token
        if json_body is not _NO_BODY:
            data = json.dumps(json_body, default=_json_default).encode()
            content_type = "application/json"
        if content_type is not None:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            try:
                body = exc.read()
            except (OSError, http.client.HTTPException):
                body = b""
            finally:
                exc.close()
            raise self._api_error(exc.code, body, exc.reason) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            raise UnreachableError(
                self._scrub(f"cannot reach the coordinator at {self.url}: {reason}")
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            # Timed out or cut off while reading the answer.
            raise UnreachableError(
                self._scrub(
                    f"the connection to the coordinator at {self.url} failed: "
                    f"{type(exc).__name__}: {exc}"
                )
            ) from None
        if raw:
            return payload
        if not payload.strip():
            return None
        try:
            return json.loads(payload)
        except ValueError:
            raise ApiError(
                200, "invalid_response", "the coordinator's answer is not JSON"
            ) from None

    def _api_error(self, status: int, body: bytes, reason: Any) -> ApiError:
        """The :class:`ApiError` for a refused request, from the JSON error body
        ``{"error": {"code": ..., "message": ...}}`` when there is one."""
        code = _STATUS_CODES.get(status, "redirect" if 300 <= status < 400 else "http_error")
        message = ""
        try:
            detail = json.loads(body)["error"]
            code = str(detail.get("code") or code)
            message = str(detail.get("message") or "")
        except (ValueError, TypeError, KeyError, AttributeError):
            message = body.decode("utf-8", "replace").strip()[:500]
        if not message:
            message = str(reason or "request failed").lower()
        return ApiError(status, code, self._scrub(message))

    def _admin(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, _ADMIN + path, **kwargs)

    # ---------------------------------------------------------------- meta

    def health(self) -> Dict[str, Any]:
        """The coordinator's health check (``GET /api/v1/health``, no token needed).

        Returns:
            The health report, e.g. ``{"status": "ok", ...}``.

        Raises:
            ApiError: The coordinator answered with an error status.
            UnreachableError: No answer (refused, DNS, TLS, timeout).
        """
        return self._request("GET", "/api/v1/health", auth=False)

    def whoami(self) -> Dict[str, Any]:
        """Checks the admin token (``GET /api/v1/admin/whoami``).

        Returns:
            Who the coordinator takes the caller to be.

        Raises:
            ApiError: 401 ``unauthorized`` when the token is wrong.
            UnreachableError: No answer.
        """
        return self._admin("GET", "/whoami")

    # ---------------------------------------------------------------- experiments

    def create_experiment(
        self, spec: Optional[Mapping[str, Any]] = None, **fields: Any
    ) -> Dict[str, Any]:
        """Creates an experiment, in state ``created`` (start it with :meth:`start`).

        Args:
            spec: The experiment's settings, as the API's ``ExperimentSpec``: ``name``,
                ``model`` (``logreg``, ``mlp``, ``mlp:H1,...`` or ``file``),
                ``features``, ``classes``, ``rounds``, ``clients_per_round``,
                ``min_participants``, and optionally ``initial_model`` (an id from
                :meth:`upload_model`, or its reply), ``strategy``, ``train``,
                ``secure_aggregation``, ``privacy``, ``hyperparameters``, ... Unknown
                fields are refused.
            **fields: Fields to add to (or replace in) ``spec``.

        Returns:
            The created experiment: ``id``, ``name``, ``spec``, ``state``,
            ``current_round``, ``created_at``, ``updated_at``.

        Raises:
            ApiError: 422 (``invalid_experiment``, ``invalid_body``) naming the field
                that is wrong; 401 for a wrong token.
            UnreachableError: No answer.
        """
        body: Dict[str, Any] = dict(spec or {})
        body.update(fields)
        initial = body.get("initial_model")
        if isinstance(initial, Mapping):
            body["initial_model"] = initial.get("id")
        return self._admin("POST", "/experiments", json_body=body)

    def experiments(self) -> List[Dict[str, Any]]:
        """Every experiment, newest first.

        Returns:
            A list of experiments (as :meth:`experiment` returns them).

        Raises:
            ApiError: 401 for a wrong token.
            UnreachableError: No answer.
        """
        return self._admin("GET", "/experiments")

    def experiment(self, experiment_id: Id) -> Dict[str, Any]:
        """One experiment.

        Args:
            experiment_id: Its id (or the dict :meth:`create_experiment` returned).

        Returns:
            The experiment: ``id``, ``name``, ``spec``, ``state`` (``created``,
            ``running``, ``paused``, ``stopped``, ``finished`` or ``failed``),
            ``current_round``, ``created_at``, ``updated_at``.

        Raises:
            ApiError: 404 ``not_found`` for an unknown id.
            UnreachableError: No answer.
        """
        return self._admin("GET", f"/experiments/{_segment(experiment_id, 'experiment_id')}")

    def _transition(self, experiment_id: Id, action: str) -> Dict[str, Any]:
        return self._admin(
            "POST", f"/experiments/{_segment(experiment_id, 'experiment_id')}/{action}"
        )

    def start(self, experiment_id: Id) -> Dict[str, Any]:
        """Starts a created experiment: rounds begin as soon as enough clients check in.

        Args:
            experiment_id: The experiment's id.

        Returns:
            The experiment, now ``running``.

        Raises:
            ApiError: 409 ``conflict`` unless the experiment is ``created`` (a paused
                one is resumed with :meth:`resume`); 404 for an unknown id.
            UnreachableError: No answer.
        """
        return self._transition(experiment_id, "start")

    def pause(self, experiment_id: Id) -> Dict[str, Any]:
        """Pauses a running experiment: the round in progress finishes, no new one starts.

        Args:
            experiment_id: The experiment's id.

        Returns:
            The experiment, now ``paused``.

        Raises:
            ApiError: 409 ``conflict`` unless the experiment is ``running``; 404 for an
                unknown id.
            UnreachableError: No answer.
        """
        return self._transition(experiment_id, "pause")

    def resume(self, experiment_id: Id) -> Dict[str, Any]:
        """Resumes a paused experiment.

        Args:
            experiment_id: The experiment's id.

        Returns:
            The experiment, ``running`` again.

        Raises:
            ApiError: 409 ``conflict`` unless the experiment is ``paused``; 404 for an
                unknown id.
            UnreachableError: No answer.
        """
        return self._transition(experiment_id, "resume")

    def stop(self, experiment_id: Id) -> Dict[str, Any]:
        """Stops an experiment for good (from ``created``, ``running`` or ``paused``).

        Args:
            experiment_id: The experiment's id.

        Returns:
            The experiment, now ``stopped``.

        Raises:
            ApiError: 409 ``conflict`` when it is already stopped, finished or failed;
                404 for an unknown id.
            UnreachableError: No answer.
        """
        return self._transition(experiment_id, "stop")

    def rounds(self, experiment_id: Id) -> List[Dict[str, Any]]:
        """Every round attempt of an experiment, with its stage and metrics.

        Args:
            experiment_id: The experiment's id.

        Returns:
            A list of round attempts, each with ``round``, ``attempt``, ``stage``
            (``collecting``, ``aggregating``, ``published``, ``failed``, ...),
            ``selected``, ``reported``, ``dropped``, ``test_accuracy``, ``test_loss``,
            ``train_loss``, ``started_at``, ``finished_at``, ``failure``, ``epsilon``
            (against observers of the published models), ``epsilon_coordinator``
            (against the coordinator; ``None`` under central noise), ``failures`` and,
            for file models, ``client_evaluation``.

        Raises:
            ApiError: 404 for an unknown id.
            UnreachableError: No answer.
        """
        return self._admin("GET", f"/experiments/{_segment(experiment_id, 'experiment_id')}/rounds")

    def round(self, experiment_id: Id, round: int, attempt: int = 1) -> Dict[str, Any]:
        """One round attempt in detail: its participants and, for a secure round, the
        protocol's progress and who dropped out at which stage.

        Args:
            experiment_id: The experiment's id.
            round: The round number, from 1.
            attempt: The attempt, from 1.

        Returns:
            ``{"round": ..., "secure_aggregation": ..., "participants": [...]}``.

        Raises:
            ApiError: 404 for an unknown experiment, round or attempt.
            UnreachableError: No answer.
        """
        exp = _segment(experiment_id, "experiment_id")
        return self._admin("GET", f"/experiments/{exp}/rounds/{int(round)}/attempts/{int(attempt)}")

    def jobs(self, experiment_id: Id) -> List[Dict[str, Any]]:
        """The jobs of an experiment (aggregation, evaluation, publishing) and their state.

        Args:
            experiment_id: The experiment's id.

        Returns:
            A list of jobs.

        Raises:
            ApiError: 404 for an unknown id.
            UnreachableError: No answer.
        """
        return self._admin("GET", f"/experiments/{_segment(experiment_id, 'experiment_id')}/jobs")

    def privacy(self, experiment_id: Id) -> Dict[str, Any]:
        """What a differentially private experiment has spent: epsilon against its budget,
        round by round, against observers of the published models and against the
        coordinator (which knows who took part, so sampling amplifies nothing).

        Args:
            experiment_id: The experiment's id.

        Returns:
            The privacy report (``mechanism``, ``epsilon_spent`` (against observers),
            ``epsilon_spent_coordinator`` (the worst client's; ``None`` under central
            noise, with ``epsilon_coordinator_unbounded`` saying why),
            ``budget_against``, ``epsilon_budget``, ``delta``, ``rounds``, ...).

        Raises:
            ApiError: 404 for an unknown experiment or one without differential privacy.
            UnreachableError: No answer.
        """
        exp = _segment(experiment_id, "experiment_id")
        return self._admin("GET", f"/experiments/{exp}/privacy")

    def evaluations(self, experiment_id: Id) -> List[Dict[str, Any]]:
        """The clients' evaluations of every model version of an experiment with a file
        model or personalisation, each metric weighted by the examples behind it.

        Args:
            experiment_id: The experiment's id.

        Returns:
            One entry per model version (``model_version``, ``clients``,
            ``num_examples``, ``metrics``, and ``per_client``: each metric's ``mean``,
            ``p10``, ``min`` and ``max`` over the clients, each counting once; a
            personalised experiment's ``personal_accuracy`` beside the global model's
            ``accuracy``).

        Raises:
            ApiError: 404 for an unknown id.
            UnreachableError: No answer.
        """
        return self._admin(
            "GET", f"/experiments/{_segment(experiment_id, 'experiment_id')}/evaluations"
        )

    def client_evaluations(self, experiment_id: Id, model_version: int) -> List[Dict[str, Any]]:
        """Each client's evaluation of one model version (a personalised experiment's
        per-client accuracies: the global and the client's own model on its data).

        Args:
            experiment_id: The experiment's id.
            model_version: The model version (0: the initial model).

        Returns:
            One entry per client (``client_id``, ``num_examples``, ``metrics``).

        Raises:
            ApiError: 404 for an unknown id, 422 for a negative version.
            UnreachableError: No answer.
        """
        if isinstance(model_version, bool) or not isinstance(model_version, int):
            raise ConfigError(f"model_version must be an integer, got {model_version!r}")
        return self._admin(
            "GET",
            f"/experiments/{_segment(experiment_id, 'experiment_id')}/evaluations/{model_version}",
        )

    def watch(
        self,
        experiment_id: Id,
        poll: float = 1.0,
        timeout: Optional[float] = None,
        since: int = 0,
    ) -> Iterator[Dict[str, Any]]:
        """Follows an experiment: yields each published round, in order, as it publishes.

        Rounds already published when iteration starts come first. The iterator ends
        once the experiment is ``finished``, ``stopped`` or ``failed`` (after the last
        rounds it published); check :meth:`experiment`'s ``state`` to tell which.
        Failed round attempts (no quorum) are not yielded: their round runs again and
        is yielded when an attempt publishes.

        Example::

            for r in admin.watch(exp_id, timeout=3600):
                print(f"round {r['round']}: accuracy {r['test_accuracy']}")

        Args:
            experiment_id: The experiment's id.
            poll: Seconds between two looks at the experiment.
            timeout: Seconds after which to give up waiting (``None``: wait as long as
                the experiment runs).
            since: Yield only rounds numbered above this (e.g. the last round seen by
                an earlier watch).

        Returns:
            An iterator of round dicts, as :meth:`rounds` lists them, with ``stage``
            ``published``.

        Raises:
            TimeoutError: ``timeout`` seconds passed before the experiment ended.
            ApiError: 404 for an unknown id (or another refusal while polling).
            UnreachableError: The coordinator stopped answering.
        """
        if not poll > 0:
            raise ValueError(f"poll must be a positive number of seconds, got {poll!r}")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        seen = set()
        while True:
            # The state first: every round published before it was terminal is then in
            # the rounds read next, so none is missed at the end.
            state = self.experiment(experiment_id).get("state")
            published = sorted(
                (
                    r
                    for r in self.rounds(experiment_id)
                    if r.get("stage") == "published"
                    and int(r.get("round", 0)) > since
                    and (r.get("round"), r.get("attempt")) not in seen
                ),
                key=lambda r: (int(r.get("round", 0)), int(r.get("attempt", 0))),
            )
            for r in published:
                seen.add((r.get("round"), r.get("attempt")))
                yield r
            if state in TERMINAL_STATES:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                label = (
                    experiment_id.get("id") if isinstance(experiment_id, Mapping) else experiment_id
                )
                raise TimeoutError(f"experiment {label} is still {state} after {timeout} s")
            time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - now)))

    # ---------------------------------------------------------------- models

    def upload_model(self, weights: Any, name: str = "model") -> Dict[str, Any]:
        """Uploads a model file to start experiments from (``"initial_model": id``).

        The tensors are sent as a safetensors file of ``F32`` tensors (the file, and
        so the reply's ``tensors``, lists them by name). A file model (``"model": "file"``) is trained by the clients' own
        trainers; for a built-in model the tensors must be the model's
        (``layers.0.weight`` of shape ``[out, in]``, ``layers.0.bias``, ...).

        Args:
            weights: A dict of tensor name to array (any real dtype: converted to
                float32; integer tensors such as a BatchNorm's ``num_batches_tracked``
                too), a PyTorch ``state_dict``, or a module (its ``state_dict()``).
            name: A name for people, 1 to 200 characters, not blank, no control
                characters.

        Returns:
            The stored model file: ``id``, ``name``, ``tensors`` (names and shapes),
            ``parameters``, ``sha256``, ``created_at``.

        Raises:
            TypeError: ``weights`` is not a mapping of names to numeric arrays.
            ValueError: No tensors, or values that are not finite as float32.
            ApiError: 422 ``invalid_model`` (the coordinator refused the file or the
                name), 413 when larger than its ``--max-body-bytes``.
            UnreachableError: No answer.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {type(name).__name__}")
        data = bytes(_rust.save_model(_tensors(weights)))
        return self._admin(
            "POST",
            "/models",
            query={"name": name},
            data=data,
            content_type="application/octet-stream",
        )

    def models(self) -> List[Dict[str, Any]]:
        """Every uploaded model file, newest first.

        Returns:
            A list of model files (as :meth:`upload_model` returns them).

        Raises:
            ApiError: 401 for a wrong token.
            UnreachableError: No answer.
        """
        return self._admin("GET", "/models")

    def model(self, model_id: Id) -> Dict[str, Any]:
        """One uploaded model file's description.

        Args:
            model_id: Its id (or the dict :meth:`upload_model` returned).

        Returns:
            The model file (``id``, ``name``, ``tensors``, ``parameters``, ...).

        Raises:
            ApiError: 404 for an unknown id.
            UnreachableError: No answer.
        """
        return self._admin("GET", f"/models/{_segment(model_id, 'model_id')}")

    def download_model(self, experiment_id: Id) -> Dict[str, np.ndarray]:
        """The experiment's current global model (its latest published round).

        Args:
            experiment_id: The experiment's id.

        Returns:
            A dict of tensor name to float32 array, with PyTorch state-dict names and
            shapes (``torch.from_numpy`` each to load it into a module).

        Raises:
            ApiError: 404 for an unknown experiment, or one with no model yet.
            UnreachableError: No answer.
        """
        exp = _segment(experiment_id, "experiment_id")
        data = self._admin("GET", f"/experiments/{exp}/model.safetensors", raw=True)
        return dict(_rust.load_model(data))

    # ---------------------------------------------------------------- tokens, clients

    def issue_token(
        self, label: Optional[str] = None, expires_in_seconds: Optional[int] = None
    ) -> Dict[str, Any]:
        """Issues a one-time enrolment token for a new client (``cohort.EdgeClient``'s
        ``enrol_token``, ``cohort-edge --enrol-token``).

        Args:
            label: Who it is for, e.g. the site it is handed to (1 to 200
                characters, not blank, no control characters); default
                ``"issued by cohort.Admin"``.
            expires_in_seconds: Seconds until it stops working (up to ten years);
                ``None``: it never expires.

        Returns:
            ``{"id", "token", "label", "expires_at"}``: ``token`` is shown only in this
            reply (the coordinator keeps its hash).

        Raises:
            ApiError: 422 ``invalid_token_request`` for a bad label or lifetime.
            UnreachableError: No answer.
        """
        body: Dict[str, Any] = {"label": "issued by cohort.Admin" if label is None else label}
        if expires_in_seconds is not None:
            body["expires_in_seconds"] = int(expires_in_seconds)
        return self._admin("POST", "/enrolment-tokens", json_body=body)

    def tokens(self) -> List[Dict[str, Any]]:
        """Every enrolment token issued (never the tokens themselves).

        Returns:
            A list of ``{"id", "label", "created_at", "expires_at", "used_at",
            "used_by", "revoked_at"}``.

        Raises:
            ApiError: 401 for a wrong token.
            UnreachableError: No answer.
        """
        return self._admin("GET", "/enrolment-tokens")

    def revoke_token(self, token_id: Id) -> None:
        """Revokes an unused enrolment token.

        Args:
            token_id: The token's ``id`` (not the token itself).

        Raises:
            ApiError: 404 for an unknown id, 409 when already used or revoked.
            UnreachableError: No answer.
        """
        self._admin("POST", f"/enrolment-tokens/{_segment(token_id, 'token_id')}/revoke")

    def create_user(self, name: str, role: str) -> Dict[str, Any]:
        """Creates a person with a role and a token of their own (admin role).

        Args:
            name: 1 to 64 letters, digits, ``.``, ``_``, ``-`` or ``@``; unique.
            role: ``"viewer"`` (reads everything), ``"operator"`` (also runs
                experiments) or ``"admin"`` (also clients, tokens, people, models).

        Returns:
            ``{"id", "name", "role", "token"}``: ``token`` is shown only in this reply;
            ``cohort.Admin(url, token=...)`` and the dashboard (with the name) take it.

        Raises:
            ApiError: 403 without the admin role, 409 ``name_taken``, 422
                ``invalid_user`` for a bad name or role.
            UnreachableError: No answer.
        """
        return self._admin("POST", "/users", json_body={"name": name, "role": role})

    def users(self) -> List[Dict[str, Any]]:
        """Every person (never their tokens).

        Returns:
            A list of ``{"id", "name", "role", "created_at", "created_by",
            "revoked_at"}``.

        Raises:
            ApiError: 401 for a wrong token.
            UnreachableError: No answer.
        """
        return self._admin("GET", "/users")

    def revoke_user(self, user_id: Id) -> Dict[str, Any]:
        """Revokes a person: their token is refused and their dashboard sessions end.

        Args:
            user_id: The person's ``id``.

        Raises:
            ApiError: 403 without the admin role, 404 for an unknown id, 409 when
                already revoked.
            UnreachableError: No answer.
        """
        return self._admin("POST", f"/users/{_segment(user_id, 'user_id')}/revoke")

    def clients(self) -> List[Dict[str, Any]]:
        """Every enrolled client.

        Returns:
            A list of ``{"id", "label", "enrolled_at", "last_seen_at", "revoked_at"}``.

        Raises:
            ApiError: 401 for a wrong token.
            UnreachableError: No answer.
        """
        return self._admin("GET", "/clients")

    def revoke_client(self, client_id: Id) -> None:
        """Revokes a client: its credential is refused from then on.

        Args:
            client_id: The client's id.

        Raises:
            ApiError: 404 for an unknown id, 409 when already revoked.
            UnreachableError: No answer.
        """
        self._admin("POST", f"/clients/{_segment(client_id, 'client_id')}/revoke")

    def audit(
        self, limit: Optional[int] = None, before: Optional[int] = None
    ) -> List[Dict[str, Any]]:
        """The audit log, newest first, a page at a time.

        Args:
            limit: Entries to return, 1 to 1000 (default 100).
            before: Only entries older than this id (the last id of the previous page).

        Returns:
            A list of audit entries (who did what, and when).

        Raises:
            ApiError: 422 for a bad ``limit``.
            UnreachableError: No answer.
        """
        return self._admin("GET", "/audit", query={"limit": limit, "before": before})
