"""cohort.simulate: the Rust round engine driving the user's Python functions in a pool
of worker processes. Each test protects one promise of the SDK."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import cohort

import softmax

HERE = os.path.dirname(os.path.abspath(__file__))


def run(tmp_path, train=softmax.train, **kw):
    x, y, xt, yt = softmax.digits()
    args = dict(
        evaluate=softmax.evaluate,
        initial_weights=softmax.initial_weights(),
        client_data=(x, y),
        test_data=(xt, yt),
        clients=10,
        clients_per_round=5,
        rounds=5,
        partition="dirichlet:1.0",
        workers=2,
        local_epochs=2,
        batch_size=32,
        lr=0.1,
        progress=False,
        out=str(tmp_path / "run"),
    )
    args.update(kw)
    return cohort.simulate(train, **args)


def test_softmax_on_digits_learns_and_writes_what_cohort_simulate_writes(tmp_path):
    result = run(tmp_path, rounds=8)
    assert result.accuracy > 0.85, result.rounds
    assert set(result.weights) == {"w", "b"}
    assert result.weights["w"].shape == (64, 10) and result.weights["w"].dtype == np.float32
    assert len(result.rounds) == 8 and all(r["participants"] == 5 for r in result.rounds)
    for name in ("metrics.csv", "metrics.jsonl", "summary.json", "accuracy.png", "accuracy.svg"):
        assert (tmp_path / "run" / name).is_file(), name
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trainer"] == "python" and summary["total_failed"] == 0
    assert summary["final_test_accuracy"] == pytest.approx(result.accuracy)
    # The model returned is the one evaluated last.
    again = softmax.evaluate(result.weights, cohort.Task(0, 0, None, data=softmax.digits()[2:]))
    assert again.metrics["accuracy"] == pytest.approx(result.accuracy, abs=1e-6)


def test_a_seed_repeats_a_run_exactly(tmp_path):
    a = run(tmp_path / "a", rounds=3)
    b = run(tmp_path / "b", rounds=3)
    for name in a.weights:
        np.testing.assert_array_equal(a.weights[name], b.weights[name])


def test_an_update_reaches_the_engine_alike_by_shared_memory_or_pipe_in_any_order(
    tmp_path, monkeypatch
):
    """Updates normally land in memory shared with the engine; one in another order
    is checked from there, a float64 one takes the pipe, and with
    ``COHORT_WORKER_TRANSPORT=pipes`` everything does. The models must not differ by a
    bit."""
    base = run(tmp_path / "base", rounds=2)
    others = {
        "reordered": run(tmp_path / "reordered", rounds=2, train=softmax.train_reordered),
        "float64": run(tmp_path / "float64", rounds=2, train=softmax.train_float64),
    }
    monkeypatch.setenv("COHORT_WORKER_TRANSPORT", "pipes")
    others["pipes"] = run(tmp_path / "pipes", rounds=2)
    for how, other in others.items():
        for name in base.weights:
            np.testing.assert_array_equal(base.weights[name], other.weights[name], err_msg=how)


def test_secure_aggregation_and_dp_run_with_python_clients(tmp_path):
    plain = run(tmp_path / "plain", rounds=4)
    secure = run(tmp_path / "secure", rounds=4, secure_aggregation=True)
    # SecAgg+ quantises the updates: the same run, to within rounding.
    assert abs(secure.accuracy - plain.accuracy) < 0.03
    private = run(
        tmp_path / "dp",
        rounds=3,
        clients_per_round=None,
        dp={"noise_multiplier": 0.5, "clip": 1.0, "delta": 1e-5},
    )
    eps = [r["epsilon"] for r in private.rounds]
    assert all(e is not None and e > 0 for e in eps) and eps == sorted(eps)


def test_fedbuff_runs_with_python_clients(tmp_path):
    result = run(tmp_path, mode="fedbuff", buffer_size=3, concurrency=4, rounds=4)
    assert len(result.rounds) == 4 and result.summary["mean_staleness"] is not None


def test_fedper_keeps_each_clients_tensor_off_the_aggregate_and_beats_the_global_model(tmp_path):
    """Personalisation with the same ``train``: FedPer's personal tensor (the bias) never
    reaches the aggregate, so the global bias stays the initial one; every client is
    scored on its own held-out split, and on two classes a client its own bias beats
    the global model by far."""
    result = run(tmp_path, partition="shards:2", personalise="fedper:b", client_holdout=0.25,
                 clients_per_round=10, rounds=4)
    assert np.array_equal(result.weights["b"], np.zeros(10, np.float32))
    assert np.any(result.weights["w"] != 0.0)
    last = result.rounds[-1]
    assert last["personal_accuracy_mean"] > last["client_accuracy_mean"] + 0.05, last
    assert last["personal_accuracy_p10"] >= last["client_accuracy_p10"], last
    lines = open(os.path.join(result.out, "clients.csv")).read().splitlines()
    assert lines[0] == "client,train_samples,holdout_samples,global_accuracy,personal_accuracy"
    assert len(lines) == 11


def test_fine_tuning_runs_and_schemes_a_python_train_cannot_run_are_refused(tmp_path):
    result = run(tmp_path, partition="shards:2", personalise="finetune:2", rounds=2)
    assert result.rounds[-1]["personal_accuracy_mean"] > result.rounds[-1]["client_accuracy_mean"]
    for scheme in ("fedrep:b", "ditto:0.1"):
        with pytest.raises(cohort.ConfigError, match="use fedper:TENSORS or finetune:EPOCHS"):
            run(tmp_path / scheme.replace(":", "-"), personalise=scheme)
    with pytest.raises(cohort.ConfigError, match="no layer or tensor `fc9`"):
        run(tmp_path / "bad", personalise="fedper:fc9")


@pytest.mark.parametrize(
    "train, words",
    [
        (softmax.train_wrong_shape, ["tensor `w` has shape [10, 64]", "[64, 10]"]),
        (softmax.train_nan, ["tensor `w` holds NaN"]),
        (softmax.train_missing, ["tensor `b` is missing"]),
        (softmax.train_int, ["tensor `w` has dtype int64"]),
        (softmax.train_raises, ["cannot read the scanner archive of site"]),
        (softmax.train_in_place, ["read-only"]),
    ],
)
def test_a_bad_update_is_a_clear_train_error_and_writes_nothing(tmp_path, train, words):
    with pytest.raises(cohort.TrainError) as err:
        run(tmp_path, train=train)
    for w in words:
        assert w in str(err.value)
    assert not (tmp_path / "run").exists()


def test_a_client_data_that_fails_is_a_train_error_naming_it(tmp_path):
    with pytest.raises(cohort.TrainError, match=r"/data/site-\d+\.csv: no such file"):
        run(tmp_path, client_data=softmax.client_data_fails)
    assert not (tmp_path / "run").exists()


def test_an_unknown_strategy_is_a_config_error_before_any_work(tmp_path):
    started = time.monotonic()
    with pytest.raises(cohort.ConfigError, match="fedmagic"):
        run(tmp_path, strategy="fedmagic")
    with pytest.raises(cohort.ConfigError, match="unknown field"):
        run(tmp_path, no_such_setting=3)
    with pytest.raises(cohort.ConfigError):
        run(tmp_path, partition="dirichlet:-1")
    assert time.monotonic() - started < 5
    assert not (tmp_path / "run").exists()


def test_failing_clients_are_dropouts_and_listed(tmp_path):
    result = run(tmp_path, train=softmax.train_fails_for_odd, clients_per_round=10, rounds=2)
    assert all(r["participants"] == 5 and r["dropped"] == 5 for r in result.rounds)
    assert len(result.failures) == 10
    assert {f["client"] % 2 for f in result.failures} == {1}
    assert "odd sites are down" in result.failures[0]["reason"]
    assert result.summary["total_failed"] == 10


def test_a_worker_killed_by_a_signal_fails_its_task_and_is_restarted(tmp_path):
    result = run(tmp_path, train=softmax.train_crashes_site_3, clients_per_round=10, rounds=3)
    [failure] = result.failures
    assert failure["client"] == 3 and failure["round"] == 2
    assert "signal 9" in failure["reason"]
    assert [r["participants"] for r in result.rounds] == [10, 9, 10]


def test_a_task_past_its_timeout_is_killed_and_fails(tmp_path):
    started = time.monotonic()
    result = run(
        tmp_path, train=softmax.train_hangs_site_1, clients_per_round=10, rounds=2, task_timeout=3
    )
    assert time.monotonic() - started < 40
    [failure] = result.failures
    assert failure["client"] == 1 and "timeout" in failure["reason"]


def test_without_evaluate_the_accuracy_is_nan_not_made_up(tmp_path):
    result = run(tmp_path, train=softmax.train_identity, evaluate=None, rounds=1)
    assert np.isnan(result.accuracy) and result.rounds[0]["participants"] == 5


def test_workers_see_only_their_device(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, numpy as np, cohort
            def train(weights, task):
                with open(os.environ["PROBE_OUT"] + f"/{task.partition_id}", "w") as f:
                    f.write(os.environ.get("CUDA_VISIBLE_DEVICES", "unset") + " "
                            + os.environ.get("OMP_NUM_THREADS", "unset"))
                return cohort.TrainResult(weights, 1)
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import probe  # noqa: F401

        os.environ["PROBE_OUT"] = str(tmp_path)
        cohort.simulate(
            probe.train,
            initial_weights={"w": np.zeros(3, np.float32)},
            clients=6,
            rounds=1,
            workers=2,
            devices=["cuda:1", "cpu"],
            progress=False,
            out=str(tmp_path / "run"),
        )
    finally:
        sys.path.remove(str(tmp_path))
        os.environ.pop("PROBE_OUT", None)
    seen = [(tmp_path / str(i)).read_text().split(" ") for i in range(6)]
    # Worker 0 sees GPU 1 only; worker 1 sees none (an empty CUDA_VISIBLE_DEVICES).
    assert {device for device, _ in seen} <= {"1", ""}, seen
    cores = os.cpu_count() or 1
    assert {threads for _, threads in seen} == {str(max(1, cores // 2))}


def test_ctrl_c_stops_the_run_and_its_workers_and_writes_nothing(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time, numpy as np
            sys.path.insert(0, {HERE!r})
            import cohort

            def train(weights, task):
                time.sleep(30)
                return cohort.TrainResult(weights, 1)

            if __name__ == "__main__":
                cohort.simulate(train, initial_weights={{"w": np.zeros(3, np.float32)}},
                                clients=4, rounds=2, workers=2, progress=False,
                                out=sys.argv[1])
            """
        )
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out)], start_new_session=True, stderr=subprocess.PIPE
    )
    time.sleep(4)
    workers = _children(proc.pid)
    assert workers, "the pool should be running"
    os.killpg(proc.pid, signal.SIGINT)
    started = time.monotonic()
    proc.wait(timeout=10)
    assert time.monotonic() - started < 3
    assert proc.returncode != 0
    assert b"KeyboardInterrupt" in proc.stderr.read()
    time.sleep(0.5)
    assert not any(_alive(p) for p in workers)
    assert not out.exists()


def _children(pid):
    try:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
        ).stdout
    except FileNotFoundError:
        pytest.skip("ps is not available")
    return [int(p) for p in out.split()]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_cli_runs_a_python_module(tmp_path):
    binary = os.environ.get("COHORT_BIN", os.path.join(HERE, "..", "..", "target", "debug", "cohort"))
    if not os.path.exists(binary):
        if os.environ.get("COHORT_REQUIRE_SERVE") == "1":
            pytest.fail(f"{binary} is missing")
        pytest.skip("the cohort binary is not built")
    module = tmp_path / "cli_model.py"
    module.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {HERE!r})
            import softmax
            from softmax import train, evaluate, initial_weights
            x, y, xt, yt = softmax.digits()
            import cohort
            parts = cohort.datasets.partition(y, "iid", clients=8, seed=0)
            def client_data(i):
                return x[parts[i]], y[parts[i]]
            test_data = (xt, yt)
            """
        )
    )
    out = tmp_path / "cli-run"
    proc = subprocess.run(
        [
            binary, "simulate", "--python", f"{module}:train", "--python-exe", sys.executable,
            "--clients", "8", "--clients-per-round", "4", "--rounds", "4", "--lr", "0.1",
            "--local-epochs", "2", "--batch-size", "32", "--out", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer"] == "python" and summary["rounds"] == 4
    assert summary["final_test_accuracy"] > 0.8
