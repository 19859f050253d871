"""``cohort.Admin`` against a real ``cohort serve`` (no mocks): experiments and their
lifecycle, model files, enrolment tokens and clients, a full run followed with
``watch``, and the errors (``ApiError`` with the API's status and code,
``UnreachableError``), none of which ever shows the admin token."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import cohort
from conftest import clean_env, free_port, stop_process

#: A logistic regression on 4 features and 2 classes: the edge client's built-in model.
LOGREG = {"features": 4, "classes": 2, "model": "logreg"}


def spec(name: str, **fields) -> dict:
    """A small valid experiment spec."""
    out = {"name": name, **LOGREG, "rounds": 3, "clients_per_round": 2, "min_participants": 2,
           "collect_deadline_seconds": 60}
    out.update(fields)
    return out


def logreg_weights(seed: int = 0) -> dict:
    """Initial weights of the built-in logreg model, in float64 (converted on upload)."""
    rng = np.random.default_rng(seed)
    return {
        "layers.0.weight": rng.normal(0.0, 0.1, size=(2, 4)),
        "layers.0.bias": np.zeros(2, dtype=np.float64),
    }


@pytest.fixture(scope="module")
def serve(cohort_serve):
    """The session's coordinator."""
    return cohort_serve


@pytest.fixture(scope="module")
def admin(serve) -> cohort.Admin:
    """An admin client trusting the coordinator's dev CA."""
    return cohort.Admin(serve.url, serve.token, ca_cert=serve.ca_cert, timeout=10)


def assert_no_token(exc: BaseException, token: str) -> None:
    """The admin token appears nowhere in what an exception shows."""
    for text in (str(exc), repr(exc), *map(str, exc.args)):
        assert token not in text, text
    for attr in ("message", "code"):
        assert token not in str(getattr(exc, attr, "")), attr


def test_health_and_whoami(admin):
    assert admin.health()["status"] == "ok"
    assert isinstance(admin.whoami(), dict)


def test_experiment_lifecycle(admin, serve):
    created = admin.create_experiment(spec("lifecycle"))
    exp_id = created["id"]
    assert uuid.UUID(exp_id)
    assert created["state"] == "created"
    assert created["name"] == "lifecycle"
    assert created["spec"]["rounds"] == 3

    assert exp_id in [e["id"] for e in admin.experiments()]
    assert admin.experiment(exp_id)["state"] == "created"
    assert admin.experiment(uuid.UUID(exp_id))["id"] == exp_id
    assert admin.experiment(created)["id"] == exp_id

    assert admin.start(exp_id)["state"] == "running"
    with pytest.raises(cohort.ApiError) as e:
        admin.start(exp_id)
    assert (e.value.status, e.value.code) == (409, "invalid_transition")
    assert "resume" in e.value.message
    assert_no_token(e.value, serve.token)

    assert admin.pause(exp_id)["state"] == "paused"
    with pytest.raises(cohort.ApiError) as e:
        admin.pause(exp_id)
    assert e.value.status == 409
    assert admin.resume(exp_id)["state"] == "running"
    with pytest.raises(cohort.ApiError) as e:
        admin.resume(exp_id)
    assert (e.value.status, e.value.code) == (409, "invalid_transition")

    assert admin.stop(exp_id)["state"] == "stopped"
    assert admin.experiment(exp_id)["state"] == "stopped"
    with pytest.raises(cohort.ApiError) as e:
        admin.stop(exp_id)
    assert e.value.status == 409

    # No client ever checked in: no round opened.
    assert admin.rounds(exp_id) == []
    assert isinstance(admin.jobs(exp_id), list)
    # A stopped experiment ends a watch at once.
    assert list(admin.watch(exp_id, poll=0.1, timeout=10)) == []


def test_create_with_keyword_fields_and_numpy_values(admin):
    created = admin.create_experiment(
        spec("keywords"), rounds=np.int64(5), train={"lr": np.float32(0.05)}
    )
    assert created["spec"]["rounds"] == 5
    assert created["spec"]["train"]["lr"] == pytest.approx(0.05)
    admin.stop(created["id"])


def test_invalid_experiments_are_422_naming_the_field(admin, serve):
    with pytest.raises(cohort.ApiError) as e:
        admin.create_experiment(spec("bad", rounds=0))
    assert (e.value.status, e.value.code) == (422, "invalid_experiment")
    assert "rounds" in e.value.message

    with pytest.raises(cohort.ApiError) as e:
        admin.create_experiment({"name": "missing fields"})
    assert (e.value.status, e.value.code) == (422, "invalid_body")

    with pytest.raises(cohort.ApiError) as e:
        admin.create_experiment(spec("unknown field", colour="blue"))
    assert e.value.status == 422
    assert "colour" in e.value.message
    assert_no_token(e.value, serve.token)


def test_unknown_ids_are_404_not_found(admin, serve):
    missing = str(uuid.uuid4())
    for call in (admin.experiment, admin.start, admin.pause, admin.stop, admin.rounds,
                 admin.download_model, admin.model, admin.revoke_client):
        with pytest.raises(cohort.ApiError) as e:
            call(missing)
        assert (e.value.status, e.value.code) == (404, "not_found"), call.__name__
        assert isinstance(e.value, cohort.CohortError)
        assert_no_token(e.value, serve.token)
    # Not a UUID, nor a path: the API's 400 for a malformed id, never another route.
    for odd in ("not-a-uuid", "../../health", "a b?c=d#e"):
        with pytest.raises(cohort.ApiError) as e:
            admin.experiment(odd)
        assert (e.value.status, e.value.code) == (400, "invalid_id")


def test_a_model_with_no_round_yet_is_404(admin):
    created = admin.create_experiment(spec("no model yet"))
    try:
        with pytest.raises(cohort.ApiError) as e:
            admin.download_model(created["id"])
        assert (e.value.status, e.value.code) == (404, "not_found")
    finally:
        admin.stop(created["id"])


def test_upload_model_from_a_dict_of_arrays_and_list_it(admin):
    weights = {
        "encoder.weight": np.arange(12, dtype=np.float64).reshape(3, 4) / 7,
        "encoder.bias": np.array([0.5, -1.0, 2.0], dtype=np.float16),
        "head.weight": np.asfortranarray(np.ones((2, 3), dtype=np.float32)),
        "scale": np.float32(3.0),
    }
    uploaded = admin.upload_model(weights, name="dict of arrays")
    assert uuid.UUID(uploaded["id"])
    assert uploaded["name"] == "dict of arrays"
    assert uploaded["parameters"] == 12 + 3 + 6 + 1
    # The file's order (safetensors sorts by name), not necessarily the dict's.
    assert {t["name"]: list(t["shape"]) for t in uploaded["tensors"]} == {
        "encoder.weight": [3, 4], "encoder.bias": [3], "head.weight": [2, 3], "scale": [],
    }
    assert len(uploaded["sha256"]) == 64

    listed = {m["id"]: m for m in admin.models()}
    assert listed[uploaded["id"]]["name"] == "dict of arrays"
    assert admin.model(uploaded["id"])["parameters"] == uploaded["parameters"]
    assert admin.model(uploaded)["id"] == uploaded["id"]

    # The file model's tensors go into the experiment's spec.
    exp = admin.create_experiment(spec("from a file", model="file", initial_model=uploaded,
                                       features=0, classes=0))
    assert sorted(t["name"] for t in exp["spec"]["tensors"]) == sorted(weights)
    admin.stop(exp["id"])


def test_upload_model_duck_types_a_state_dict(admin):
    class FakeTensor:
        """Looks like a torch tensor to the duck typing (``detach``, ``cpu``)."""

        def __init__(self, array):
            self.array = np.asarray(array)

        def detach(self):
            return self

        def cpu(self):
            return self

        def is_floating_point(self):
            return self.array.dtype.kind == "f"

        def float(self):
            return FakeTensor(self.array.astype(np.float32))

        def numpy(self):
            return self.array

    class FakeModule:
        def state_dict(self):
            return {"layers.0.weight": FakeTensor(np.ones((2, 4))),
                    "layers.0.bias": FakeTensor(np.zeros(2)),
                    "bn.num_batches_tracked": FakeTensor(np.array(7, dtype=np.int64))}

    uploaded = admin.upload_model(FakeModule(), name="module")
    assert uploaded["parameters"] == 8 + 2 + 1


def test_upload_model_refuses_what_is_not_a_model(admin):
    with pytest.raises(TypeError):
        admin.upload_model([1.0, 2.0], name="list")
    with pytest.raises(ValueError):
        admin.upload_model({}, name="empty")
    with pytest.raises(ValueError, match="finite"):
        admin.upload_model({"w": np.array([1.0, np.nan])}, name="nan")
    with pytest.raises(ValueError, match="finite"):
        admin.upload_model({"w": np.array([1e300])}, name="too large for float32")
    with pytest.raises(TypeError):
        admin.upload_model({"w": np.array(["a"])}, name="strings")
    with pytest.raises(cohort.ApiError) as e:
        admin.upload_model({"w": np.ones(2)}, name="")
    assert (e.value.status, e.value.code) == (422, "invalid_model")


def test_an_initial_model_of_the_wrong_shape_is_refused(admin):
    wrong = admin.upload_model({"layers.0.weight": np.ones((3, 4)),
                                "layers.0.bias": np.ones(3)}, name="wrong shape")
    with pytest.raises(cohort.ApiError) as e:
        admin.create_experiment(spec("wrong initial model", initial_model=wrong["id"]))
    assert (e.value.status, e.value.code) == (422, "invalid_experiment")
    assert "initial_model" in e.value.message


def test_issue_list_and_revoke_tokens(admin, serve):
    issued = admin.issue_token(label="site-a", expires_in_seconds=3600)
    assert issued["label"] == "site-a"
    assert isinstance(issued["token"], str) and len(issued["token"]) >= 16
    assert issued["expires_at"] is not None
    listed = {t["id"]: t for t in admin.tokens()}
    assert listed[issued["id"]]["label"] == "site-a"
    assert "token" not in listed[issued["id"]]

    default = admin.issue_token()
    assert default["label"] and default["expires_at"] is None

    admin.revoke_token(issued["id"])
    assert {t["id"]: t for t in admin.tokens()}[issued["id"]]["revoked_at"] is not None
    with pytest.raises(cohort.ApiError) as e:
        admin.revoke_token(issued["id"])
    assert e.value.status == 409

    with pytest.raises(cohort.ApiError) as e:
        admin.issue_token(label=" ")
    assert (e.value.status, e.value.code) == (422, "invalid_token_request")
    assert_no_token(e.value, serve.token)
    assert isinstance(admin.clients(), list)


def test_people_act_within_their_roles(admin, serve):
    """A person's token works as a bearer token within their role: an operator runs
    experiments but may not issue enrolment tokens; a revoked person is refused."""
    name = f"op-{time.time_ns()}"
    created = admin.create_user(name, "operator")
    assert created["role"] == "operator" and "token" in created
    operator = cohort.Admin(serve.url, created["token"], ca_cert=serve.ca_cert, timeout=10)
    assert operator.whoami() == {"name": name, "role": "operator"}
    exp = operator.create_experiment(spec("run by an operator"))
    assert operator.experiment(exp["id"])["name"] == "run by an operator"
    with pytest.raises(cohort.ApiError) as e:
        operator.issue_token("site")
    assert (e.value.status, e.value.code) == (403, "forbidden")
    assert "admin role" in e.value.message
    assert any(u["name"] == name for u in admin.users())
    assert all("token" not in u for u in admin.users())
    admin.revoke_user(created["id"])
    with pytest.raises(cohort.ApiError) as e:
        operator.experiments()
    assert e.value.status == 401
    assert_no_token(e.value, created["token"])


def test_a_wrong_token_is_401_and_never_shown(serve):
    wrong = "wrong-admin-token-that-must-not-leak-0123456789"
    bad = cohort.Admin(serve.url, wrong, ca_cert=serve.ca_cert, timeout=10)
    assert wrong not in repr(bad)
    calls = [bad.experiments, bad.clients, bad.models, lambda: bad.issue_token("x"),
             lambda: bad.create_experiment(spec("nope")),
             lambda: bad.upload_model({"w": np.ones(2)}, name="nope")]
    for call in calls:
        with pytest.raises(cohort.ApiError) as e:
            call()
        assert (e.value.status, e.value.code) == (401, "unauthorized")
        assert e.value.message
        assert_no_token(e.value, wrong)
        assert_no_token(e.value, serve.token)
    # The health check needs no token.
    assert bad.health()["status"] == "ok"


def test_a_closed_port_is_unreachable(serve):
    token = serve.token
    admin = cohort.Admin(f"https://127.0.0.1:{free_port()}", token, ca_cert=serve.ca_cert,
                         timeout=5)
    with pytest.raises(cohort.UnreachableError) as e:
        admin.experiments()
    assert isinstance(e.value, ConnectionError)
    assert isinstance(e.value, cohort.CohortError)
    assert "127.0.0.1" in str(e.value)
    assert_no_token(e.value, token)
    with pytest.raises(cohort.UnreachableError):
        admin.upload_model({"w": np.ones(2)}, name="nowhere")


def test_an_unknown_host_is_unreachable(serve):
    admin = cohort.Admin("https://cohort-coordinator.invalid:8443", serve.token, timeout=5)
    with pytest.raises(cohort.UnreachableError) as e:
        admin.experiments()
    assert_no_token(e.value, serve.token)


def test_an_untrusted_certificate_is_unreachable(serve):
    # Without the dev CA, the coordinator's certificate does not verify.
    admin = cohort.Admin(serve.url, serve.token, timeout=5)
    with pytest.raises(cohort.UnreachableError) as e:
        admin.experiments()
    assert "certificate" in str(e.value).lower()
    assert_no_token(e.value, serve.token)


def test_configuration_errors(serve, tmp_path):
    with pytest.raises(cohort.ConfigError):
        cohort.Admin("127.0.0.1:8443", serve.token)
    with pytest.raises(cohort.ConfigError) as e:
        cohort.Admin(serve.url, "")
    with pytest.raises(cohort.ConfigError) as e:
        cohort.Admin(serve.url, serve.token, ca_cert=tmp_path / "missing.pem")
    assert_no_token(e.value, serve.token)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    with pytest.raises(cohort.ConfigError):
        cohort.Admin(serve.url, serve.token, ca_cert=not_pem)


def test_watch_times_out_while_no_round_publishes(admin):
    created = admin.create_experiment(spec("waiting"))
    admin.start(created["id"])
    try:
        with pytest.raises(TimeoutError):
            for _ in admin.watch(created["id"], poll=0.1, timeout=1.0):
                pass
    finally:
        admin.stop(created["id"])


def write_site_csv(path: Path, n: int, shift: float) -> None:
    """Two linearly separable blobs with 4 features (labels 0 and 1)."""
    rows = ["x0,x1,x2,x3,label"]
    for i in range(n):
        label = i % 2
        centre = (-1.5 if label == 0 else 1.5) + shift
        rows.append(",".join(f"{centre + ((i * 7 + j * 3) % 11) * 0.05:.4f}" for j in range(4))
                    + f",{label}")
    path.write_text("\n".join(rows) + "\n")


def test_a_run_watched_to_the_end_then_downloaded(admin, serve, tmp_path):
    """Two real ``cohort edge`` processes train three rounds of an experiment started
    from an uploaded model; ``watch`` yields each round once, in order, and ends when
    the experiment finishes; the downloaded model is the trained one."""
    initial = logreg_weights()
    uploaded = admin.upload_model(initial, name="logreg init")
    exp = admin.create_experiment(spec("watched", initial_model=uploaded["id"],
                                       train={"local_epochs": 2, "lr": 0.1}))
    exp_id = exp["id"]
    sites = []
    for site in range(2):
        csv = tmp_path / f"site-{site}.csv"
        write_site_csv(csv, 40, 0.2 * site)
        token = admin.issue_token(label=f"watched site {site}")["token"]
        log = open(tmp_path / f"edge-{site}.log", "wb")
        process = subprocess.Popen(
            [serve.binary, "edge", "--coordinator", serve.url, "--ca-cert", serve.ca_cert,
             "--data", str(csv), "--state-dir", str(tmp_path / f"state-{site}"),
             "--idle-exit", "30", "--seed", str(site)],
            env=clean_env(COHORT_ENROL_TOKEN=token, RUST_LOG="warn"),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        serve.children.append(process)
        sites.append(process)
    try:
        admin.start(exp_id)
        seen = [r["round"] for r in admin.watch(exp_id, poll=0.2, timeout=240)]
    except BaseException:
        for site in range(2):
            print(f"--- edge {site}:\n" + (tmp_path / f"edge-{site}.log").read_text()[-3000:])
        print("--- serve:\n" + serve.log_tail())
        raise
    finally:
        for process in sites:
            stop_process(process, grace=5.0)

    assert seen == [1, 2, 3]
    assert admin.experiment(exp_id)["state"] == "finished"
    rounds = admin.rounds(exp_id)
    assert [r["round"] for r in rounds if r["stage"] == "published"] == [1, 2, 3]
    # Watching a finished experiment again yields the same rounds, then ends; `since`
    # skips the ones already seen.
    assert [r["round"] for r in admin.watch(exp_id, poll=0.1, timeout=10)] == [1, 2, 3]
    assert [r["round"] for r in admin.watch(exp_id, since=2)] == [3]

    model = admin.download_model(exp_id)
    assert set(model) == set(initial)
    for name, value in model.items():
        assert isinstance(value, np.ndarray)
        assert value.dtype == np.float32
        assert value.shape == initial[name].shape
        assert np.isfinite(value).all()
    assert not np.allclose(model["layers.0.weight"], initial["layers.0.weight"])

    # The two sites enrolled; revoking one shows, and a second revocation conflicts.
    mine = [c for c in admin.clients() if c["label"].startswith("watched site")]
    assert len(mine) == 2
    admin.revoke_client(mine[0]["id"])
    revoked = {c["id"]: c for c in admin.clients()}[mine[0]["id"]]
    assert revoked["revoked_at"] is not None
    with pytest.raises(cohort.ApiError) as e:
        admin.revoke_client(mine[0]["id"])
    assert (e.value.status, e.value.code) == (409, "already_revoked")

    # The audit log saw it all.
    assert admin.audit(limit=5)
    with pytest.raises(cohort.ApiError) as e:
        admin.audit(limit=0)
    assert e.value.status in (400, 422)


def test_every_public_method_has_a_docstring():
    for name in dir(cohort.Admin):
        if name.startswith("_"):
            continue
        member = getattr(cohort.Admin, name)
        if callable(member):
            doc = member.__doc__ or ""
            assert doc.strip(), name
            if "Raises:" not in doc:
                pytest.fail(f"Admin.{name} documents no Raises:")
    assert "Args:" in cohort.Admin.__doc__
