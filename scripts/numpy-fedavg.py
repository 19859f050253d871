#!/usr/bin/env python3
"""NumPy's FedAvg over stacked updates, the baseline `cohort bench reduce`'s `fedavg` line is
put against: `np.tensordot(w / w.sum(), X, axes=1)` on an (n, d) float32 matrix, which
NumPy hands to BLAS (gemv, every core), as the Flower harness's `np_tensordot_stacked`.

Prints one JSON line: `bench` "numpy_tensordot", `n`, `d`, `median_s`, `gbps` (n d 4 bytes
of updates read per second), the BLAS threads, NumPy's version.

    python3 scripts/numpy-fedavg.py --n 100 --d 1000000 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--d", type=float, default=1e6)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    n, d = args.n, int(args.d)
    rng = np.random.default_rng(0)
    stacked = rng.uniform(-1.0, 1.0, size=(n, d)).astype(np.float32)
    w = rng.integers(100, 1000, size=n).astype(np.float64)
    wn32 = (w / w.sum()).astype(np.float32)
    np.tensordot(wn32, stacked, axes=1)  # BLAS's threads start here, not in the first timing
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = np.tensordot(wn32, stacked, axes=1)
        times.append(time.perf_counter() - start)
    assert out.shape == (d,)
    median = float(np.median(times))
    print(
        json.dumps(
            {
                "suite": "numpy",
                "bench": "numpy_tensordot",
                "n": n,
                "d": d,
                "median_s": median,
                "gbps": n * d * 4 / median / 1e9,
                "threads": os.cpu_count(),
                "numpy": np.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
