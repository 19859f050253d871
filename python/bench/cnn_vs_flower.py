#!/usr/bin/env python3
"""Cohort and Flower side by side on the same PyTorch CNN federated experiment.

    python python/bench/cnn_vs_flower.py --engine cohort --rounds 30
    python python/bench/cnn_vs_flower.py --engine flower-inprocess --rounds 30
    python python/bench/cnn_vs_flower.py --engine flower-ray --rounds 30
    python python/bench/cnn_vs_flower.py --engine cohort --secure --rounds 30    # SecAgg+

Run one engine per process (each line above is one run); each prints one JSON line.

What is the same in every engine:

* the training code: ``fit_arrays`` in ``_cnn_task.py`` (the CNN of
  ``examples/pytorch_cnn``, 215,370 parameters; SGD, ``--epochs`` local epochs, batch
  ``--batch``, ``--lr``; batches shuffled by a ``torch.Generator`` seeded from the run's
  seed, the round and the partition). Cohort calls it from ``train(weights, task)``,
  Flower from ``NumPyClient.fit``; it reads its own partition by partition id in both.
  It is a module of its own so that every engine's workers import it once and keep its
  data (see ``_cnn_task.py`` on why that matters with Ray);
* the data: mnist10k as shipped with Cohort (8,000 training images, pixels / 255), split
  over ``--clients`` clients by Cohort's Dirichlet(``--alpha``) partitioner
  (``cohort.datasets.partition(y, "dirichlet:0.3", clients=100, seed=0)``), and the
  2,000 test images;
* the initial model (``torch.manual_seed(seed)``), FedAvg weighted by examples,
  ``--per-round`` of ``--clients`` clients a round, ``--workers`` workers (Cohort's
  worker processes; Ray actors with one CPU each; threads of the in-process grid), one
  torch thread in each (``--threads``);
* under ``--secure``, SecAgg+ over the round's clients: Cohort's
  ``secure_aggregation=True`` (for 10 clients it picks the full graph, 9 neighbours,
  threshold 5); Flower's ``SecAggPlusWorkflow`` with ``secaggplus_mod`` on the clients,
  ``num_shares=10`` (every client of the round, itself included) and
  ``reconstruction_threshold=5``, ``max_weight`` the largest partition.

Which clients a round selects is each engine's own seeded choice (Flower samples node
ids, which Ray draws at random), so the accuracies are comparable, not identical.

The engines:

* ``cohort``: ``cohort.simulate`` (the Rust round engine, a pool of Python worker
  processes);
* ``flower-inprocess``: Flower 1.42's ``ServerApp`` (legacy ``FedAvg`` strategy under
  ``DefaultWorkflow``, with ``SecAggPlusWorkflow`` as its fit workflow under
  ``--secure``) driving the ``ClientApp`` through an in-process ``Grid`` (the reference
  harness's ``LocalGrid``: a protobuf round trip per message, here delivered by a pool
  of ``--workers`` threads; see ``_common.py``). Flower's own simulation engine is Ray;
  this one shows Flower's per-message cost without it;
* ``flower-ray``: the same apps through ``flwr.simulation.run_simulation`` (Ray).

What is measured, per round: the wall-clock from the start of the round to its
aggregated model (Cohort: the round's ``seconds`` in its metrics, run without an
``evaluate`` so that no evaluation is inside it; Flower: from the strategy's
``configure_fit`` to the end of its ``aggregate_fit``, which under SecAgg+ spans all four
stages); the seconds spent inside ``fit_arrays`` (it times itself and appends a line per
call to a log file, which works across processes and under SecAgg+), summed over the
round's clients, and summed per worker (process or thread) with the busiest worker's
sum kept. Overhead = round - busiest worker's training, as a share of the round: the
time the round spends on anything but the training its critical path needs. Medians
over rounds are reported, and round 1 (worker start-up, first calls) separately. The
test accuracy of the last round's model is computed afterwards, in this process, with
the same evaluation code for every engine. Memory: the peak, sampled every 0.2 s by a
thread, of the summed RSS of this process and all its descendants (Cohort's workers;
Ray's GCS, raylet, agents and actors), and of their summed PSS (shared pages counted
once).

The JSON line: ``bench``, ``engine``, ``secure``, the settings, ``median_round_s``,
``round1_s``, ``median_train_sum_s``, ``median_busiest_worker_s``,
``median_overhead_s``, ``median_overhead_share``, ``overhead_share_total`` (summed over
rounds 2..R), ``final_accuracy``, ``peak_rss_mib``, ``peak_pss_mib``,
``peak_processes``, ``total_s`` (including start-up), ``round_s`` (every round), and
the environment (versions, load average at the start).

Notes. With in-process Flower the training threads share one interpreter: PyTorch
releases the GIL inside its kernels, but this CNN's batches of 10 spend much of their
time in Python (autograd, the optimiser), so two threads train little faster than one
and each ``fit_arrays`` call takes longer (``median_train_sum_s`` about doubles); the
overhead share then understates the cost; ``--workers 1`` gives the reference harness's
sequential grid. Measure Cohort with a release build of its extension (``pip install
./python`` or ``maturin develop --release``): ``env.cohort_build`` says ``dev`` for a
development build (Cohort's own crates at opt-level 1). Run on a
quiet machine: ``env.loadavg_1_5_15`` records the load at the start.

Needs ``torch``, ``cohort`` and ``flwr[simulation]==1.42.0``. The Flower engines follow
the approach of the reference harness in ``shared/bench/flower`` (``bench_torch_cnn.py``,
``benchlib.py``, ``bench_secagg.py``'s ``LocalGrid``), copied here rather than imported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Dict, List, Tuple

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cohort  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as bench  # noqa: E402

from _cnn_task import CFG, NAMES, accuracy, cohort_train, data, initial_arrays  # noqa: E402
import _cnn_task as task  # noqa: E402


def run_cohort(a: argparse.Namespace, init: List[np.ndarray]) -> Tuple[List[float], List[np.ndarray]]:
    with tempfile.TemporaryDirectory(prefix="cnn-bench-") as out:
        result = cohort.simulate(
            cohort_train,
            None,  # no evaluation inside the rounds: accuracy is computed afterwards
            initial_weights=dict(zip(NAMES, init)),
            client_data=None,  # fit_arrays reads its partition by partition id
            clients=a.clients,
            clients_per_round=a.per_round,
            rounds=a.rounds,
            secure_aggregation=a.secure,
            seed=a.seed,
            workers=a.workers,
            local_epochs=a.epochs,
            batch_size=a.batch,
            lr=a.lr,
            momentum=a.momentum,
            progress=a.progress,
            out=os.path.join(out, "run"),
        )
    if result.failures:
        bench.log(f"cohort: {len(result.failures)} failed tasks, first: {result.failures[0]}")
    return [float(r["seconds"]) for r in result.rounds], [result.weights[k] for k in NAMES]


# ----------------------------------------------------------------------------- Flower

FLOWER: Dict[str, Any] = {"starts": {}, "ends": {}, "last": None}


def make_flower_apps(a: argparse.Namespace, init: List[np.ndarray], max_weight: int) -> Tuple[Any, Any]:
    """The ClientApp (a NumPyClient calling fit_arrays, behind secaggplus_mod under
    --secure) and the ServerApp (legacy FedAvg under DefaultWorkflow, with
    SecAggPlusWorkflow as the fit workflow under --secure)."""
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    class BenchClient(NumPyClient):
        def __init__(self, partition: int) -> None:
            self.partition = partition

        def get_parameters(self, config):  # noqa: ANN001, ANN201
            raise RuntimeError("the strategy holds the initial parameters")

        def fit(self, parameters, config):  # noqa: ANN001, ANN201
            out, n, loss, seconds = task.fit_arrays(parameters, int(config["server_round"]), self.partition)
            return out, n, {"loss": loss, "train_s": seconds}

    def client_fn(context):  # noqa: ANN001, ANN202
        return BenchClient(int(context.node_config["partition-id"])).to_client()

    client_app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod] if a.secure else [])

    class TimedFedAvg(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201
            FLOWER["starts"][server_round] = time.perf_counter()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001, ANN201
            out = super().aggregate_fit(server_round, results, failures)
            FLOWER["ends"][server_round] = time.perf_counter()
            if failures:
                bench.log(f"flower: round {server_round}: {len(failures)} failures: {failures[:1]}")
            if out[0] is not None:
                FLOWER["last"] = parameters_to_ndarrays(out[0])
            return out

    server_app = ServerApp()
    n, k = a.clients, a.per_round

    @server_app.main()
    def main(grid, context):  # noqa: ANN001, ANN202
        random.seed(a.seed)  # Flower's client sampling
        strategy = TimedFedAvg(
            fraction_fit=k / n, fraction_evaluate=0.0, min_fit_clients=k,
            min_evaluate_clients=0, min_available_clients=n,
            initial_parameters=ndarrays_to_parameters(init),
            on_fit_config_fn=lambda r: {"server_round": r},
        )
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=a.rounds), strategy=strategy)
        fit_workflow = None
        if a.secure:
            fit_workflow = SecAggPlusWorkflow(num_shares=a.secagg_shares,
                                              reconstruction_threshold=a.secagg_threshold,
                                              max_weight=float(max_weight))
        DefaultWorkflow(fit_workflow=fit_workflow)(grid, legacy)

    return client_app, server_app


def run_flower(a: argparse.Namespace, init: List[np.ndarray], max_weight: int) -> Tuple[List[float], List[np.ndarray]]:
    client_app, server_app = make_flower_apps(a, init, max_weight)
    bench.run_flower_apps(a.engine, client_app, server_app, a.clients, a.workers)
    rounds = sorted(FLOWER["ends"])
    if len(rounds) != a.rounds or FLOWER["last"] is None:
        raise RuntimeError(f"Flower finished {len(rounds)} of {a.rounds} rounds")
    return [FLOWER["ends"][r] - FLOWER["starts"][r] for r in rounds], FLOWER["last"]


# ------------------------------------------------------------------------------- main


def per_round_training(path: str, rounds: int) -> List[Dict[str, float]]:
    """From the train log: per round, the seconds summed over clients and the busiest
    worker's sum."""
    by_round: Dict[int, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    calls: Dict[int, int] = defaultdict(int)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                by_round[int(rec["round"])][rec["worker"]] += float(rec["s"])
                calls[int(rec["round"])] += 1
    out = []
    for r in range(1, rounds + 1):
        workers = by_round.get(r, {})
        out.append({"sum": sum(workers.values()), "busiest": max(workers.values(), default=0.0),
                    "calls": calls.get(r, 0), "workers": len(workers)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, choices=["cohort", "flower-inprocess", "flower-ray"])
    ap.add_argument("--secure", action="store_true", help="SecAgg+ (Cohort's, or Flower's SecAggPlusWorkflow)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads inside each training call")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration")
    ap.add_argument("--partition-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="initial model, batch order, Cohort's selection")
    ap.add_argument("--secagg-shares", type=int, default=None,
                    help="Flower's num_shares (default: --per-round, the full graph as Cohort picks for 10)")
    ap.add_argument("--secagg-threshold", type=int, default=None,
                    help="Flower's reconstruction_threshold (default: per_round // 2, Cohort's 5 for 10)")
    ap.add_argument("--progress", action="store_true", help="Cohort's per-round lines on stderr")
    a = ap.parse_args()
    a.secagg_shares = a.secagg_shares or a.per_round
    a.secagg_threshold = a.secagg_threshold or max(2, (a.per_round - 1) // 2 + 1)

    env = bench.env_info()
    log_dir = tempfile.mkdtemp(prefix="cnn-bench-log-")
    train_log = os.path.join(log_dir, "train.jsonl")
    CFG.update(clients=a.clients, alpha=a.alpha, partition_seed=a.partition_seed, seed=a.seed,
               epochs=a.epochs, batch=a.batch, lr=a.lr, momentum=a.momentum, threads=a.threads,
               train_log=train_log)
    os.environ["CNN_BENCH_CFG"] = json.dumps(CFG)
    torch.set_num_threads(a.threads)

    init = initial_arrays(a.seed)
    max_weight = max(len(p) for p in data()["parts"])

    memory = bench.TreeMemory().start()
    t0 = time.perf_counter()
    try:
        if a.engine == "cohort":
            round_s, final = run_cohort(a, init)
        else:
            round_s, final = run_flower(a, init, max_weight)
    finally:
        mem = memory.stop()
    total = time.perf_counter() - t0

    training = per_round_training(train_log, a.rounds)
    if os.path.exists(train_log):
        os.remove(train_log)
    os.rmdir(log_dir)
    overhead = [r - t["busiest"] for r, t in zip(round_s, training)]
    share = [o / r for o, r in zip(overhead, round_s) if r > 0]
    steady = slice(1, None) if a.rounds > 1 else slice(0, None)
    record = {
        "bench": "cnn_vs_flower",
        "engine": a.engine,
        "secure": a.secure,
        "rounds": a.rounds,
        "clients": a.clients,
        "per_round": a.per_round,
        "workers": a.workers,
        "threads": a.threads,
        "epochs": a.epochs,
        "batch": a.batch,
        "lr": a.lr,
        "alpha": a.alpha,
        "seed": a.seed,
        "parameters": int(sum(x.size for x in init)),
        "median_round_s": bench.median(round_s),
        "round1_s": round_s[0] if round_s else None,
        "median_train_sum_s": bench.median([t["sum"] for t in training]),
        "median_busiest_worker_s": bench.median([t["busiest"] for t in training]),
        "median_overhead_s": bench.median(overhead),
        "median_overhead_share": bench.median(share),
        "overhead_share_total": (sum(overhead[steady]) / sum(round_s[steady])) if round_s else None,
        "final_accuracy": accuracy(final),
        **mem,
        "total_s": total,
        "train_calls": sum(t["calls"] for t in training),
        "round_s": [round(r, 4) for r in round_s],
        "busiest_worker_s": [round(t["busiest"], 4) for t in training],
        "env": env,
    }
    if a.secure and a.engine != "cohort":
        record["secagg"] = {"num_shares": a.secagg_shares, "reconstruction_threshold": a.secagg_threshold,
                            "max_weight": max_weight}
    bench.emit(record)
    bench.log(f"{a.engine}{' secure' if a.secure else ''}: round {record['median_round_s']:.3f}s "
              f"(busiest worker {record['median_busiest_worker_s']:.3f}s, overhead "
              f"{100 * (record['median_overhead_share'] or 0):.1f}%), accuracy {record['final_accuracy']:.4f}, "
              f"peak RSS {mem['peak_rss_mib']:.0f} MiB, PSS {mem['peak_pss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
