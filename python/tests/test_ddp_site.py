"""A data-parallel site beneath one Cohort client (``examples/ddp_site``): its ``train``
runs PyTorch DistributedDataParallel over 2 gloo processes on the CPU, only rank 0
answers Cohort, and the update is the one a single process would produce.

What it protects:
- the site's update equals the single-process update within 1e-5 relative (the same
  batches; DDP's mean of the ranks' gradients is the batch's, also for a batch that does
  not split evenly);
- a federated run of such sites reaches the accuracy of the same run with
  single-process sites, round after round.

Skipped when PyTorch is not installed, unless ``COHORT_REQUIRE_TORCH=1``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch") if os.environ.get("COHORT_REQUIRE_TORCH") != "1" else __import__("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_site"


@pytest.fixture(scope="module")
def site():
    """The example module, importable here, in Cohort's workers and in the ranks they
    spawn (through ``PYTHONPATH``)."""
    sys.path.insert(0, str(EXAMPLE))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), old) if p)
    try:
        import ddp_site

        yield ddp_site
    finally:
        sys.path.remove(str(EXAMPLE))
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def relative_difference(a, b, start):
    num = sum(float(np.sum((a[k] - b[k]) ** 2)) for k in a) ** 0.5
    den = sum(float(np.sum((a[k] - start[k]) ** 2)) for k in a) ** 0.5
    return num / den


def test_the_data_parallel_update_is_the_single_process_update(site):
    x, y, _, _ = site.digits()
    # 150 samples in batches of 16: the last batch (6) splits 3 and 3; 137 leaves 9,
    # which splits 5 and 4.
    weights = site.initial_weights(0)
    config = {"local_epochs": 3, "batch_size": 16, "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
    for n in (150, 137):
        data = (x[:n], y[:n])
        single, single_loss = site.train_site(weights, data, config, 7, 1)
        parallel, parallel_loss = site.train_site(weights, data, config, 7, 2)
        assert relative_difference(parallel, single, weights) <= 1e-5
        assert abs(parallel_loss - single_loss) <= 1e-5 * abs(single_loss)
        # It trained: the update is not nothing.
        assert relative_difference(single, weights, {k: v * 0 for k, v in weights.items()}) > 1e-3


def test_a_federated_run_of_data_parallel_sites_learns_as_single_process_sites(site, tmp_path):
    parallel = site.simulate(site.train, clients=4, rounds=3, seed=1, out=str(tmp_path / "ddp"))
    single = site.simulate(site.train_single, clients=4, rounds=3, seed=1, out=str(tmp_path / "one"))
    assert not parallel.failures, parallel.failures
    got = [r["test_accuracy"] for r in parallel.rounds]
    want = [r["test_accuracy"] for r in single.rounds]
    assert len(got) == 3
    for a, b in zip(got, want):
        assert abs(a - b) <= 0.005, (got, want)
    assert want[-1] > 0.5, want
    assert relative_difference(parallel.weights, single.weights, site.initial_weights(1)) <= 1e-4
