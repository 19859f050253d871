"""An integrator's client, generated from the served OpenAPI document and used unedited.

Most integrators do not hand-write a client: they run a generator on
``/api/v1/openapi.json``. This test does exactly that with ``openapi-python-client``
(PyPI), imports the generated package as it comes, and drives the whole flow through it:
create an experiment, issue tokens, enrol three clients, check in, download the model,
upload trained weights (the built-in logreg on the digits data, trained here with NumPy
through the layout each task carries), list the rounds, download the final model and
read the audit log. If the document said anything the server does not do (a query
parameter in the path, an undocumented body, a wrong type), the generated code would
fail here.

Needs ``openapi-python-client``; skipped without it unless
``COHORT_REQUIRE_OPENAPI_CLIENT=1`` (CI).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest

import cohort
from conftest import start_serve, stop_process

ROUNDS = 5
CLIENTS = 3


def generator() -> str:
    found = shutil.which("openapi-python-client")
    if found is None:
        message = "openapi-python-client is not installed (pip install openapi-python-client)"
        if os.environ.get("COHORT_REQUIRE_OPENAPI_CLIENT") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def generate(serve, workdir):
    """The served document, run through the generator; the generated package, imported."""
    context = ssl.create_default_context(cafile=serve.ca_cert)
    with urllib.request.urlopen(f"{serve.url}/api/v1/openapi.json", context=context) as r:
        document = r.read()
    path = workdir / "openapi.json"
    path.write_bytes(document)
    package = f"cohort_api_{uuid.uuid4().hex[:8]}"
    out = subprocess.run(
        [generator(), "generate", "--path", str(path), "--meta", "none",
         "--output-path", str(workdir / package)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # The generator warns about what it could not turn into code; a warning means part
    # of the API would be missing from every generated client.
    assert "Warning" not in out.stdout + out.stderr, out.stdout + out.stderr
    sys.path.insert(0, str(workdir))
    try:
        return importlib.import_module(package), package
    finally:
        sys.path.remove(str(workdir))


def submodule(package: str, name: str):
    return importlib.import_module(f"{package}.{name}")


def digits():
    """The digits data as the test split is defined (cohort.datasets, seed 0), scaled to
    [0, 1]; the training part dealt to three clients."""
    ds = cohort.datasets.load("digits")
    x_train = (ds.x_train / 16.0).astype(np.float32)
    x_test = (ds.x_test / 16.0).astype(np.float32)
    order = np.random.default_rng(7).permutation(len(ds.y_train))
    shards = [order[i::CLIENTS] for i in range(CLIENTS)]
    return [(x_train[s], ds.y_train[s]) for s in shards], (x_test, ds.y_test)


def unflatten(values: np.ndarray, tensors) -> dict:
    """The flat vector as named tensors, in the order and shapes the task gives."""
    out, at = {}, 0
    for t in tensors:
        n = int(np.prod(t.shape))
        out[t.name] = values[at : at + n].reshape(t.shape)
        at += n
    assert at == len(values), (at, len(values))
    return out


def flatten(weights: dict, tensors) -> np.ndarray:
    return np.concatenate([weights[t.name].ravel() for t in tensors]).astype("<f4")


def local_training(weights: dict, data, train) -> tuple[dict, float]:
    """SGD on softmax regression with the task's settings (built-in logreg's layout:
    ``layers.0.weight`` is ``[classes, features]``)."""
    x, y = data
    w = weights["layers.0.weight"].astype(np.float64).copy()
    b = weights["layers.0.bias"].astype(np.float64).copy()
    rng = np.random.default_rng(len(y))
    loss = 0.0
    for _ in range(train.local_epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), train.batch_size):
            idx = order[start : start + train.batch_size]
            z = x[idx] @ w.T + b
            z -= z.max(axis=1, keepdims=True)
            p = np.exp(z)
            p /= p.sum(axis=1, keepdims=True)
            loss = float(-np.log(p[np.arange(len(idx)), y[idx]] + 1e-12).mean())
            p[np.arange(len(idx)), y[idx]] -= 1.0
            p /= len(idx)
            w -= train.lr * (p.T @ x[idx])
            b -= train.lr * p.sum(axis=0)
    return {"layers.0.weight": w, "layers.0.bias": b}, loss


def accuracy(weights: dict, test) -> float:
    x, y = test
    logits = x @ weights["layers.0.weight"].T + weights["layers.0.bias"]
    return float((logits.argmax(axis=1) == y).mean())


@pytest.fixture
def serve(tmp_path):
    server = start_serve(tmp_path / "serve")
    try:
        yield server
    finally:
        stop_process(server.process)


def test_a_generated_client_runs_the_whole_flow(serve, tmp_path):
    api, package = generate(serve, tmp_path)
    models = submodule(package, "models")
    types = submodule(package, "types")
    admin_api = lambda name: submodule(package, f"api.admin.{name}")  # noqa: E731
    client_api = lambda name: submodule(package, f"api.client.{name}")  # noqa: E731
    timeout = __import__("httpx").Timeout(60.0)
    trust = ssl.create_default_context(cafile=serve.ca_cert)
    admin = api.AuthenticatedClient(
        base_url=serve.url, token=serve.token, verify_ssl=trust, timeout=timeout
    )

    experiment = admin_api("create_experiment").sync(
        client=admin,
        body=models.ExperimentSpec(
            name="generated client, digits",
            model="logreg",
            features=64,
            classes=10,
            rounds=ROUNDS,
            clients_per_round=CLIENTS,
            min_participants=CLIENTS,
            collect_deadline_seconds=120,
            train=models.TrainSettings(local_epochs=5, batch_size=16, lr=0.3),
        ),
    )
    assert isinstance(experiment, models.Experiment), experiment
    assert experiment.state == models.ExperimentState.CREATED

    anonymous = api.Client(base_url=serve.url, verify_ssl=trust, timeout=timeout)
    credentials = []
    for site in range(CLIENTS):
        issued = admin_api("create_token").sync(
            client=admin, body=models.NewEnrolmentToken(label=f"site {site}")
        )
        assert isinstance(issued, models.IssuedEnrolmentToken), issued
        enrolled = client_api("enrol").sync(
            client=anonymous, body=models.EnrolRequest(token=issued.token)
        )
        assert isinstance(enrolled, models.Enrolled), enrolled
        credentials.append(f"{enrolled.client_id}.{enrolled.secret}")

    started = admin_api("start_experiment").sync(experiment.id, client=admin)
    assert started.state == models.ExperimentState.RUNNING

    shards, test = digits()
    done = threading.Event()
    errors: list = []
    uploads: list = []

    def site(index: int) -> None:
        me = api.AuthenticatedClient(
            base_url=serve.url, token=credentials[index], verify_ssl=trust,
            timeout=timeout,
        )
        try:
            while not done.is_set():
                reply = client_api("checkin").sync(
                    client=me, body=models.CheckIn(wait_seconds=2)
                )
                assert isinstance(reply, models.CheckInReply), reply
                task = reply.task
                if task is None or isinstance(task, types.Unset):
                    continue
                assert task.upload == models.UploadForm.WEIGHTS
                downloaded = client_api("model").sync_detailed(task.experiment_id, client=me)
                assert downloaded.status_code == 200, downloaded.content
                assert int(downloaded.headers["x-cohort-round"]) == task.round_ - 1
                values = np.frombuffer(downloaded.parsed.payload.read(), dtype="<f4")
                weights, loss = local_training(
                    unflatten(values, task.tensors), shards[index], task.train
                )
                receipt = client_api("upload").sync(
                    task.experiment_id, task.round_, task.attempt, client=me,
                    body=types.File(payload=io.BytesIO(flatten(weights, task.tensors).tobytes())),
                    num_samples=len(shards[index][1]), train_loss=loss,
                    upload_id=uuid.uuid4(),
                )
                assert isinstance(receipt, models.UploadReceipt), receipt
                uploads.append((index, task.round_))
        except Exception as e:  # surfaced in the main thread
            errors.append(e)
            done.set()

    threads = [threading.Thread(target=site, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    state = None
    while time.monotonic() < deadline and not done.is_set():
        state = admin_api("get_experiment").sync(experiment.id, client=admin).state
        if state != models.ExperimentState.RUNNING:
            break
        time.sleep(0.5)
    done.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert state == models.ExperimentState.FINISHED, (state, serve.log_tail())
    assert len(uploads) == ROUNDS * CLIENTS, uploads

    rounds = admin_api("list_rounds").sync(experiment.id, client=admin)
    published = [r for r in rounds if r.stage == models.RoundStage.PUBLISHED]
    assert sorted(r.round_ for r in published) == list(range(1, ROUNDS + 1)), rounds
    assert all(r.reported == CLIENTS for r in published)

    final = admin_api("download_model").sync_detailed(experiment.id, client=admin)
    assert final.status_code == 200
    assert int(final.headers["x-cohort-round"]) == ROUNDS
    tensors = [models.TensorSpec(name="layers.0.weight", shape=[10, 64]),
               models.TensorSpec(name="layers.0.bias", shape=[10])]
    score = accuracy(
        unflatten(np.frombuffer(final.parsed.payload.read(), dtype="<f4"), tensors), test
    )
    print(f"generated client: {ROUNDS} rounds published, test accuracy {score:.4f}")
    assert score >= 0.95, score

    audit = admin_api("list_audit").sync(client=admin, limit=200)
    assert isinstance(audit, list) and audit, audit
    actions = {entry.action for entry in audit}
    assert any("experiment" in a for a in actions), actions
    json.dumps([entry.to_dict() for entry in audit])  # every entry parsed whole
