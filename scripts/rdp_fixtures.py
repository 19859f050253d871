#!/usr/bin/env python3
"""Writes aggregation/tests/fixtures/rdp_grid.json: epsilon of the Poisson-subsampled
Gaussian mechanism over a grid of (sampling rate, noise multiplier, rounds, delta), as
Google's dp_accounting RDP accountant (default orders) computes it. Cohort's accountant
is tested against this file.

    python3 -m venv /tmp/dp && /tmp/dp/bin/pip install dp-accounting==0.6.0
    /tmp/dp/bin/python scripts/rdp_fixtures.py
"""
import itertools
import json
import logging
import pathlib

import dp_accounting
from dp_accounting import rdp


def epsilon(q, sigma, rounds, delta):
    accountant = rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return accountant.get_epsilon(delta)


def main():
    # Orders whose series does not converge are dropped, as the accountant does; quietly.
    logging.getLogger("absl").setLevel(logging.ERROR)
    cases = [
        # The cases the issue names.
        (0.01, 1.1, 1000, 1e-5),
        (1.0, 5.0, 50, 1e-6),
        (0.02, 1.3, 2000, 1e-6),
    ]
    grid = itertools.product(
        [0.001, 0.01, 0.05, 0.2, 1.0],  # sampling rate
        [0.5, 0.8, 1.0, 1.5, 3.0, 10.0],  # noise multiplier
        [1, 10, 100, 1000, 10000],  # rounds
        [1e-5, 1e-8],  # delta
    )
    cases += [c for c in grid if c not in cases]
    rows = []
    for q, sigma, rounds, delta in cases:
        eps = epsilon(q, sigma, rounds, delta)
        if eps == float("inf") or eps > 1e4:
            continue
        rows.append(
            {"sampling_rate": q, "noise_multiplier": sigma, "rounds": rounds,
             "delta": delta, "epsilon": eps}
        )
    out = pathlib.Path(__file__).resolve().parent.parent / "aggregation/tests/fixtures/rdp_grid.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "source": "dp_accounting %s RdpAccountant, default orders" % getattr(
            dp_accounting, "__version__", "0.6.0"),
        "generator": "scripts/rdp_fixtures.py",
        "cases": rows,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print("%d cases -> %s" % (len(rows), out))


if __name__ == "__main__":
    main()
