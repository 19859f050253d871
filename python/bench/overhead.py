#!/usr/bin/env python3
"""The engines' own cost per client update: a ``train`` that returns its input at once.

    python python/bench/overhead.py --engine cohort --rounds 100
    python python/bench/overhead.py --engine flower-inprocess --rounds 100
    python python/bench/overhead.py --engine flower-ray --rounds 100
    python python/bench/overhead.py --engine cohort --rounds 10,100,500    # one run each

The model is one float32 tensor of ``--params`` values (default 1,000,000: 4 MB), 100
clients, 10 a round, FedAvg, 2 workers. The clients do nothing: Cohort's
``train(weights, task)`` returns ``TrainResult(weights, 1)``; Flower's ``ClientApp``
returns the ``ArrayRecord`` it received. So a round's time is the engine's alone:
sending the model to the clients, taking the updates back, checking and averaging them.

Reported, one JSON line per run: client updates per second (``--per-round`` / round
seconds, median over the rounds after the first, which carries the workers' start-up),
the median round, the whole run's updates per second after round 1, and the peak memory
of the process tree (this process and every descendant: Cohort's workers, Ray's GCS,
raylet, agents and actors), sampled every 0.2 s by a thread and again at the end of the
rounds in ``peak_by_round``, so that one run shows whether memory grows with the rounds;
several ``--rounds`` values run one after another, each in a fresh process.

Round times: Cohort's own (its metrics' ``seconds``, run without ``evaluate``); Flower's
from its strategy's ``configure_train`` to the end of ``aggregate_train``
(``flwr.serverapp.strategy.FedAvg``, the Message API, as the reference harness's
``bench_simulation.py``). Cohort's round ends are seen on its progress lines, which this
script reads from its own standard error.

Measure Cohort with a release build of its extension (``pip install ./python`` or
``maturin develop --release``; ``env.cohort_build`` says ``dev`` for a development
build) on a quiet machine (``env.loadavg_1_5_15``).

Engines: ``cohort`` (``cohort.simulate``, ``--workers`` worker processes),
``flower-inprocess`` (Flower 1.42's ``ServerApp`` and ``ClientApp`` through an
in-process ``Grid`` with a protobuf round trip per message, ``--workers`` threads; see
``_common.py``), ``flower-ray`` (``flwr.simulation.run_simulation``, ``--workers`` Ray
actors of one CPU each).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as bench  # noqa: E402

ROUNDS: Dict[str, Dict[int, float]] = {"starts": {}, "ends": {}}


def checkpoints(rounds: int) -> List[int]:
    """Rounds after which the peak so far is noted: 1, 2, 5, 10, 20, 50, ... and the last."""
    out, base = [], 1
    while base <= rounds:
        out += [r for r in (base, 2 * base, 5 * base) if r <= rounds]
        base *= 10
    return sorted(set(out + [rounds]))


# ----------------------------------------------------------------------------- Cohort


def cohort_train(weights, task):  # noqa: ANN001, ANN201
    import cohort

    return cohort.TrainResult(weights, 1)


class _StderrRounds:
    """Reads this process's standard error through a pipe (Cohort's engine prints
    ``round N/M ...`` there after each round), passes it on, and calls ``on_round(N)``
    when a round's line appears."""

    PATTERN = re.compile(rb"^round (\d+)/\d+ ")

    def __init__(self, on_round: Any) -> None:
        self.on_round = on_round
        sys.stderr.flush()
        self.saved = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.read = read
        self.thread = threading.Thread(target=self._pump, name="stderr-rounds", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        with os.fdopen(self.read, "rb", buffering=0) as pipe:
            pending = b""
            while True:
                chunk = pipe.read(65536)
                if not chunk:
                    break
                os.write(self.saved, chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    m = self.PATTERN.match(line)
                    if m:
                        self.on_round(int(m.group(1)))

    def close(self) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)  # closes the pipe's last write end: the pump sees EOF
        self.thread.join(timeout=5)
        os.close(self.saved)


def run_cohort(a: argparse.Namespace, init: np.ndarray, on_round: Any) -> List[float]:
    import cohort

    reader = _StderrRounds(on_round)
    try:
        with tempfile.TemporaryDirectory(prefix="overhead-bench-") as out:
            result = cohort.simulate(
                cohort_train,
                None,
                initial_weights={"w": init},
                clients=a.clients,
                clients_per_round=a.per_round,
                rounds=a.rounds,
                workers=a.workers,
                seed=a.seed,
                progress=True,
                out=os.path.join(out, "run"),
            )
    finally:
        reader.close()
    if result.failures:
        raise RuntimeError(f"{len(result.failures)} failed tasks, first: {result.failures[0]}")
    return [float(r["seconds"]) for r in result.rounds]


# ----------------------------------------------------------------------------- Flower


def make_flower_apps(a: argparse.Namespace, init: np.ndarray, on_round: Any):  # noqa: ANN201
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        content = RecordDict({"arrays": msg.content["arrays"],
                              "metrics": MetricRecord({"num-examples": 1})})
        return Message(content=content, reply_to=msg)

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
            ROUNDS["starts"][server_round] = time.perf_counter()
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):  # noqa: ANN001, ANN201
            out = super().aggregate_train(server_round, replies)
            ROUNDS["ends"][server_round] = time.perf_counter()
            on_round(server_round)
            return out

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        import random

        random.seed(a.seed)
        strategy = TimedFedAvg(fraction_train=a.per_round / a.clients, fraction_evaluate=0.0,
                               min_train_nodes=a.per_round, min_available_nodes=a.clients)
        strategy.start(grid=grid, initial_arrays=ArrayRecord([init]), num_rounds=a.rounds)

    return client_app, server_app


def run_flower(a: argparse.Namespace, init: np.ndarray, on_round: Any) -> List[float]:
    client_app, server_app = make_flower_apps(a, init, on_round)
    bench.run_flower_apps(a.engine, client_app, server_app, a.clients, a.workers)
    done = sorted(ROUNDS["ends"])
    if len(done) != a.rounds:
        raise RuntimeError(f"Flower finished {len(done)} of {a.rounds} rounds")
    return [ROUNDS["ends"][r] - ROUNDS["starts"][r] for r in done]


# ------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, choices=["cohort", "flower-inprocess", "flower-ray"])
    ap.add_argument("--rounds", default="100", help="rounds, or a comma list (one fresh process each)")
    ap.add_argument("--params", type=float, default=1e6, help="model size (one float32 tensor)")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    counts = [int(float(r)) for r in a.rounds.split(",") if r.strip()]
    if len(counts) > 1:
        for n in counts:
            argv = [sys.executable, os.path.abspath(__file__), "--engine", a.engine, "--rounds", str(n),
                    "--params", str(a.params), "--clients", str(a.clients), "--per-round", str(a.per_round),
                    "--workers", str(a.workers), "--seed", str(a.seed)]
            subprocess.run(argv, check=True)
        return
    a.rounds = counts[0]
    d = int(a.params)

    env = bench.env_info()
    init = np.random.default_rng(a.seed).standard_normal(d, dtype=np.float32)
    memory = bench.TreeMemory().start()
    marks = set(checkpoints(a.rounds))

    def on_round(r: int) -> None:
        if r in marks:
            memory.sample(pss=True)
            memory.mark(str(r))

    t0 = time.perf_counter()
    try:
        if a.engine == "cohort":
            round_s = run_cohort(a, init, on_round)
        else:
            round_s = run_flower(a, init, on_round)
    finally:
        mem = memory.stop()
    total = time.perf_counter() - t0

    steady = round_s[1:] if len(round_s) > 1 else round_s
    record = {
        "bench": "overhead",
        "engine": a.engine,
        "rounds": a.rounds,
        "params": d,
        "clients": a.clients,
        "per_round": a.per_round,
        "workers": a.workers,
        "updates_per_s": a.per_round / bench.median(steady),
        "updates_per_s_total": a.per_round * len(steady) / sum(steady),
        "median_round_s": bench.median(steady),
        "round1_s": round_s[0],
        **mem,
        "peak_by_round": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in memory.marks.items()},
        "total_s": total,
        "env": env,
    }
    bench.emit(record)
    bench.log(f"{a.engine}: {record['updates_per_s']:.1f} updates/s (median round {record['median_round_s'] * 1e3:.1f} ms), "
              f"peak RSS {mem['peak_rss_mib']:.0f} MiB, PSS {mem['peak_pss_mib']:.0f} MiB; by round: "
              + ", ".join(f"{k}: {v['peak_pss_mib']:.0f}" for k, v in record["peak_by_round"].items()))


if __name__ == "__main__":
    main()
