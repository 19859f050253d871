"""cohort.EdgeClient against a real ``cohort serve``: the simulation's ``train`` runs
unchanged in deployment, with everything around it (enrolment, TLS, SecAgg+ masking,
checks, retries) in Rust. Each site is a separate Python process, as at a hospital."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cohort
from conftest import clean_env, free_port, start_serve, stop_process

import softmax

HERE = Path(__file__).resolve().parent
SITE = HERE / "edge_site.py"


@pytest.fixture(scope="module")
def admin(cohort_serve):
    return cohort.Admin(cohort_serve.url, cohort_serve.token, ca_cert=cohort_serve.ca_cert)


@pytest.fixture
def own_serve(tmp_path):
    """A coordinator of the test's own: on the shared one, sites of earlier tests still
    count as online for a while and may be selected instead of this test's."""
    serve = start_serve(tmp_path / "serve")
    try:
        yield serve, cohort.Admin(serve.url, serve.token, ca_cert=serve.ca_cert)
    finally:
        for child in serve.children:
            stop_process(child, grace=5.0)
        stop_process(serve.process)


def experiment(admin, name, rounds=3, clients=3, secure=False, **fields):
    uploaded = admin.upload_model(softmax.initial_weights(), name=f"{name} init")
    spec = {
        "name": name,
        "model": "file",
        "initial_model": uploaded["id"],
        "rounds": rounds,
        "clients_per_round": clients,
        "min_participants": max(1, clients - 1),
        "collect_deadline_seconds": 60,
        "train": {"local_epochs": 2, "lr": 0.1, "batch_size": 32},
    }
    if secure:
        spec["secure_aggregation"] = {"advertise_seconds": 20, "share_seconds": 20,
                                      "unmask_seconds": 20}
    spec.update(fields)
    return admin.create_experiment(spec)


def start_site(serve, admin, tmp_path, partition, mode="ok", idle_exit=20, token=True):
    tok = admin.issue_token(label=f"py site {partition}")["token"] if token else ""
    log = tmp_path / f"site-{partition}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(SITE), serve.url, serve.ca_cert, tok,
             str(tmp_path / f"state-{partition}"), str(partition), mode, str(idle_exit)],
            env=clean_env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    serve.children.append(process)
    return process, log


def start_when_online(admin, exp_id, sites):
    """Starts the experiment once every site started has enrolled and been seen: a
    round opens as soon as ``min_participants`` sites are online, so a site whose Python
    start-up ran late (a loaded CI machine) would otherwise miss round 1, and the
    per-site counts the tests assert with it."""
    deadline = time.monotonic() + 90
    while True:
        online = [c for c in admin.clients() if c["last_seen_at"] and not c["revoked_at"]]
        if len(online) >= len(sites):
            return admin.start(exp_id)
        exited = [log for process, log in sites if process.poll() is not None]
        if exited or time.monotonic() > deadline:
            logs = [log.read_text(errors="replace")[-2000:] for _, log in sites]
            raise AssertionError(f"{len(online)} of {len(sites)} sites online", logs)
        time.sleep(0.1)


def report_of(log: Path) -> dict:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("REPORT "):
            return json.loads(line[len("REPORT "):])
    raise AssertionError(f"no report in {log}:\n{log.read_text(errors='replace')[-3000:]}")


def test_the_simulation_train_runs_unchanged_under_secure_aggregation(own_serve, tmp_path):
    cohort_serve, admin = own_serve
    exp = experiment(admin, "python sites, secure", rounds=3, clients=3, secure=True)
    sites = [start_site(cohort_serve, admin, tmp_path, p) for p in range(3)]
    start_when_online(admin, exp["id"], sites)
    try:
        seen = [r["round"] for r in admin.watch(exp["id"], poll=0.3, timeout=240)]
    except BaseException:
        for _, log in sites:
            print(log.read_text(errors="replace")[-3000:])
        print(cohort_serve.log_tail())
        raise
    for process, _ in sites:
        process.wait(timeout=60)
    assert seen == [1, 2, 3]
    reports = [report_of(log) for _, log in sites]
    assert all(r["uploads"] == 3 and r["failed"] == 0 for r in reports), reports
    model = admin.download_model(exp["id"])
    x, y, xt, yt = softmax.digits()
    score = softmax.evaluate(model, cohort.Task(0, 0, None, data=(xt, yt)))
    assert score.metrics["accuracy"] > 0.85


def test_a_personalised_experiment_keeps_each_sites_tensor_at_the_site(own_serve, tmp_path):
    """The same ``train`` and ``evaluate`` under FedPer: the bias ``b`` is each site's
    own, kept in its state directory, never in an upload; every site reports the global
    model's and its own model's accuracy for every model version."""
    cohort_serve, admin = own_serve
    exp = experiment(admin, "python sites, fedper", rounds=2, clients=3,
                     personalisation="fedper:b")
    sites = [start_site(cohort_serve, admin, tmp_path, p) for p in range(3)]
    start_when_online(admin, exp["id"], sites)
    try:
        seen = [r["round"] for r in admin.watch(exp["id"], poll=0.3, timeout=240)]
    except BaseException:
        for _, log in sites:
            print(log.read_text(errors="replace")[-3000:])
        print(cohort_serve.log_tail())
        raise
    for process, _ in sites:
        process.wait(timeout=60)
    assert seen == [1, 2]
    reports = [report_of(log) for _, log in sites]
    assert all(r["uploads"] == 2 and r["failed"] == 0 for r in reports), reports
    final = admin.download_model(exp["id"])
    # The global bias never moved (every upload carried the global's own) ...
    assert np.array_equal(final["b"], np.zeros(10, np.float32))
    # Where each tensor lies in the flat vector: the model file's order.
    at, where = 0, {}
    for t in admin.experiment(exp["id"])["spec"]["tensors"]:
        n = int(np.prod(t["shape"]))
        where[t["name"]] = slice(at, at + n)
        at += n
    uploads = sorted((cohort_serve.data_dir / "blobs" / "uploads" / exp["id"]).rglob("*.bin"))
    assert len(uploads) == 6, uploads
    for path in uploads:
        values = np.frombuffer(path.read_bytes(), dtype="<f4")
        assert values.shape == (650,)
        assert np.array_equal(values[where["b"]], np.zeros(10, np.float32)), path
        assert np.any(values[where["w"]] != 0.0)
    # ... while each site trained a bias of its own and keeps it.
    for p in range(3):
        kept = np.fromfile(tmp_path / f"state-{p}" / "personal" / f"{exp['id']}.f32", dtype="<f4")
        assert kept.shape == (650,) and np.any(kept[where["b"]] != 0.0)
    versions = admin.evaluations(exp["id"])
    assert [v["model_version"] for v in versions] == [0, 1, 2]
    for v in versions:
        assert v["per_client"]["accuracy"]["clients"] == 3, v
        assert v["per_client"]["personal_accuracy"]["clients"] == 3, v
    rows = admin.client_evaluations(exp["id"], 2)
    assert len(rows) == 3 and all("personal_accuracy" in r["metrics"] for r in rows), rows


def run_sites(serve, admin, tmp_path, exp, modes):
    """Starts one site per mode, runs ``exp`` to its end and waits for the sites to idle
    out: the rounds seen, and each site's report."""
    sites = [start_site(serve, admin, tmp_path, i, mode=mode) for i, mode in enumerate(modes)]
    start_when_online(admin, exp["id"], sites)
    try:
        seen = [r["round"] for r in admin.watch(exp["id"], poll=0.3, timeout=240)]
    except BaseException:
        for _, log in sites:
            print(log.read_text(errors="replace")[-3000:])
        raise
    for process, _ in sites:
        process.wait(timeout=60)
    return seen, [report_of(log) for _, log in sites]


def test_a_site_runs_only_the_code_it_approved(own_serve, tmp_path):
    """``approve_trainer``: a site whose functions hash to the approved value trains; a
    site that approved other code refuses every task, tells the coordinator why, and
    writes the refusal to its own log."""
    cohort_serve, admin = own_serve
    exp = experiment(admin, "python sites, governed", rounds=1, clients=2)
    seen, (approved, refused) = run_sites(cohort_serve, admin, tmp_path, exp,
                                          ["approved", "unapproved"])
    assert seen == [1]
    assert approved["uploads"] == 1 and approved["refused"] == 0, approved
    assert refused["uploads"] == 0 and refused["refused"] >= 1, refused
    reasons = [f["reason"] for r in admin.rounds(exp["id"]) for f in r.get("failures", [])]
    assert any("not the one this site approved" in r for r in reasons), reasons
    log = [json.loads(line) for line in
           (tmp_path / "state-1" / "site-log.jsonl").read_text().splitlines()]
    assert log and all(e["outcome"] == "refused" for e in log), log
    with pytest.raises(cohort.ConfigError, match="approve_trainer must be a SHA-256"):
        cohort.EdgeClient(cohort_serve.url, ca_cert=cohort_serve.ca_cert, state_dir=str(tmp_path / "x"),
                          approve_trainer="abc", idle_exit=0.1).run(softmax.train)


def test_a_site_refuses_an_experiment_reading_a_column_it_does_not_share(own_serve, tmp_path):
    """``columns``: the experiment reads ``pixels``; a site sharing it trains, a site
    sharing only the label refuses every task, tells the coordinator which column, and
    logs it."""
    cohort_serve, admin = own_serve
    exp = experiment(admin, "python sites, columns", rounds=1, clients=2, min_participants=1,
                     collect_deadline_seconds=15, columns=["pixels"])
    seen, (shared, narrow) = run_sites(cohort_serve, admin, tmp_path, exp,
                                       ["columns-shared", "columns-narrow"])
    assert seen == [1]
    assert shared["uploads"] == 1 and shared["refused"] == 0, shared
    assert narrow["uploads"] == 0 and narrow["refused"] >= 1, narrow
    reasons = [f["reason"] for r in admin.rounds(exp["id"]) for f in r.get("failures", [])]
    assert any("column `pixels`" in r for r in reasons), reasons
    log = [json.loads(line) for line in
           (tmp_path / "state-1" / "site-log.jsonl").read_text().splitlines()]
    assert log and all(e["outcome"] == "refused" and "`pixels`" in e["reason"] for e in log), log


def test_an_exception_in_train_is_reported_and_the_client_carries_on(own_serve, tmp_path):
    cohort_serve, admin = own_serve
    # A failed task does not end the collect stage early: a short deadline keeps the
    # test quick, and the sites wait longer than it without a task.
    exp = experiment(admin, "python site raises", rounds=2, clients=2, min_participants=1,
                     collect_deadline_seconds=8)
    good, good_log = start_site(cohort_serve, admin, tmp_path, 0, idle_exit=30)
    bad, bad_log = start_site(cohort_serve, admin, tmp_path, 1, mode="raise", idle_exit=30)
    start_when_online(admin, exp["id"], [(good, good_log), (bad, bad_log)])
    seen = [r["round"] for r in admin.watch(exp["id"], poll=0.3, timeout=240)]
    assert seen == [1, 2]
    bad.wait(timeout=60)
    good.wait(timeout=60)
    report = report_of(bad_log)
    assert report["failed"] == 2 and report["uploads"] == 0
    reasons = [f["reason"] for r in admin.rounds(exp["id"]) for f in r["failures"]]
    assert reasons and all("the PACS export is locked" in r for r in reasons), reasons


def test_a_bad_update_is_refused_before_it_leaves_the_site(own_serve, tmp_path):
    cohort_serve, admin = own_serve
    exp = experiment(admin, "python site bad shape", rounds=1, clients=2, min_participants=1,
                     collect_deadline_seconds=8)
    good, good_log = start_site(cohort_serve, admin, tmp_path, 0, idle_exit=30)
    bad, bad_log = start_site(cohort_serve, admin, tmp_path, 1, mode="bad-shape", idle_exit=30)
    start_when_online(admin, exp["id"], [(good, good_log), (bad, bad_log)])
    assert [r["round"] for r in admin.watch(exp["id"], poll=0.3, timeout=240)] == [1]
    bad.wait(timeout=60)
    good.wait(timeout=60)
    assert report_of(bad_log)["uploads"] == 0
    reasons = [f["reason"] for r in admin.rounds(exp["id"]) for f in r["failures"]]
    assert any("tensor `w` has shape [3, 10]" in r for r in reasons), reasons


def test_an_unreachable_coordinator_is_an_unreachable_error_at_once(tmp_path):
    port = free_port()
    client = cohort.EdgeClient(f"https://127.0.0.1:{port}", enrol_token="t",
                               state_dir=str(tmp_path / "state"))
    started = time.monotonic()
    with pytest.raises(cohort.UnreachableError):
        client.run(softmax.train)
    assert time.monotonic() - started < 15
    assert not (tmp_path / "state").exists()


def test_a_plain_http_coordinator_is_refused_without_insecure_http(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(cohort.ConfigError, match="insecure_http"):
        cohort.EdgeClient(url, enrol_token="t", state_dir=str(tmp_path / "state"))
    # With it, the client goes as far as the (absent) coordinator.
    client = cohort.EdgeClient(url, enrol_token="t", state_dir=str(tmp_path / "state"),
                               insecure_http=True)
    with pytest.raises(cohort.UnreachableError):
        client.run(softmax.train)
    # The Rust side holds the same rule, whatever the Python wrapper checked.
    with pytest.raises(cohort.ConfigError, match="insecure_http"):
        cohort._rust.run_edge(url, None, None, "t", str(tmp_path / "raw"), 0, 1.0, None,
                              lambda *a: None)


def test_a_revoked_client_gets_an_api_error_403(admin, cohort_serve, tmp_path):
    exp = experiment(admin, "python site revoked", rounds=1, clients=1)
    process, log = start_site(cohort_serve, admin, tmp_path, 0, idle_exit=5)
    process.wait(timeout=60)  # enrols, finds no running experiment, exits
    me = [c for c in admin.clients() if c["label"] == "py site 0"][-1]
    admin.revoke_client(me["id"])
    client = cohort.EdgeClient(cohort_serve.url, ca_cert=cohort_serve.ca_cert,
                               state_dir=str(tmp_path / "state-0"), idle_exit=5)
    with pytest.raises(cohort.ApiError) as err:
        client.run(softmax.train)
    assert err.value.status == 403 and err.value.code == "forbidden"
    admin.stop(exp["id"])


def test_ctrl_c_inside_train_stops_the_client_within_a_second(own_serve, tmp_path):
    _ctrl_c(own_serve[0], tmp_path)


def _ctrl_c(serve, tmp_path):
    admin = cohort.Admin(serve.url, serve.token, ca_cert=serve.ca_cert)
    exp = experiment(admin, "python site ctrl-c", rounds=1, clients=1)
    process, log = start_site(serve, admin, tmp_path, 0, mode="slow", idle_exit=60)
    admin.start(exp["id"])
    deadline = time.monotonic() + 60
    while b"training" not in log.read_bytes():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    started = time.monotonic()
    process.wait(timeout=10)
    assert time.monotonic() - started < 1.5
    assert "KeyboardInterrupt" in log.read_text()
    # The stored credential is intact: the site is still enrolled.
    assert json.loads((tmp_path / "state-0" / "credential.json").read_text())["client_id"]
    admin.stop(exp["id"])
