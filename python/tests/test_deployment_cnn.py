"""The deployment acceptance run: ``cohort serve`` and five sites running the PyTorch CNN
example's ``train.py edge`` (``cohort.EdgeClient``, the same ``train`` as its
simulation), SecAgg+ on, ten rounds, one site SIGKILLed during round 5. Every round
must publish, and the model downloaded with ``cohort.Admin`` must score at least 0.93 on
mnist10k's test split."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cohort
from conftest import clean_env, start_serve, stop_process

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pytorch_cnn"

torch = pytest.importorskip("torch") if os.environ.get("COHORT_REQUIRE_TORCH") != "1" else __import__("torch")

SITES = 5
ROUNDS = 10
KILLED = 3
KILL_ROUND = 5


def test_five_pytorch_sites_secure_aggregation_one_killed_in_round_5(tmp_path):
    serve = start_serve(tmp_path / "serve")
    try:
        _run(serve, tmp_path)
    finally:
        for child in serve.children:
            stop_process(child, grace=5.0)
        stop_process(serve.process)


def _run(serve, tmp_path):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import train as example  # the example's train.py: train, evaluate, initial_weights
    finally:
        sys.path.remove(str(EXAMPLE))
    admin = cohort.Admin(serve.url, serve.token, ca_cert=serve.ca_cert)
    uploaded = admin.upload_model(example.initial_weights(0), name="cnn init")
    exp = admin.create_experiment(
        {
            "name": "pytorch cnn, five sites",
            "model": "file",
            "initial_model": uploaded["id"],
            "rounds": ROUNDS,
            "clients_per_round": SITES,
            "min_participants": SITES - 1,
            "collect_deadline_seconds": 60,
            "max_round_attempts": 3,
            "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
            "secure_aggregation": {"advertise_seconds": 20, "share_seconds": 20,
                                   "unmask_seconds": 20},
        }
    )
    env = clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    sites = []
    for site in range(SITES):
        token = admin.issue_token(label=f"cnn site {site}")["token"]
        log = tmp_path / f"site-{site}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, str(EXAMPLE / "train.py"), "edge", "--coordinator", serve.url,
                 "--ca-cert", serve.ca_cert, "--token", token,
                 "--state-dir", str(tmp_path / f"state-{site}"), "--partition-id", str(site),
                 "--clients", str(SITES), "--alpha", "1.0", "--idle-exit", "90"],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        serve.children.append(process)
        sites.append((process, log))
    admin.start(exp["id"])
    published = []
    killed_at = None
    try:
        for r in admin.watch(exp["id"], poll=0.2, timeout=900):
            published.append(r["round"])
            if r["round"] == KILL_ROUND - 1 and killed_at is None:
                # Round 5 is being selected or trained now: the site dies mid-round.
                time.sleep(1.0)
                sites[KILLED][0].send_signal(signal.SIGKILL)
                killed_at = KILL_ROUND
    except BaseException:
        for _, log in sites:
            print(log.read_text(errors="replace")[-2000:])
        print(serve.log_tail())
        raise
    assert published == list(range(1, ROUNDS + 1))
    model = admin.download_model(exp["id"])
    test = example.mnist()
    score = example.evaluate(model, cohort.Task(0, 0, None, data=(test["x_test"], test["y_test"])))
    accuracy = score.metrics["accuracy"]
    print(f"final test accuracy after {ROUNDS} secure rounds with a site killed in round "
          f"{KILL_ROUND}: {accuracy:.4f}")
    assert accuracy >= 0.93
    # The killed site really died mid-experiment (and the rounds above went on without it).
    assert killed_at == KILL_ROUND
    assert sites[KILLED][0].wait(timeout=10) == -signal.SIGKILL
