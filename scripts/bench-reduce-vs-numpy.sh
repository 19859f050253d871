#!/usr/bin/env bash
# `cohort bench reduce` and NumPy's tensordot over the same n x d updates, in turns in
# one run, so that the two FedAvg figures share the machine's state (this machine is
# shared and its memory speed moves between runs):
#
#   scripts/bench-reduce-vs-numpy.sh [N] [D] [TURNS]      (default 100 1000000 3)
#
# Prints every JSON line of both, then one summary line per turn (`reduce_vs_numpy`):
# the probe, Cohort's fedavg (from memory and in cache), masked_sum and mask expansion
# figures, and NumPy's tensordot GB/s. Needs a release `cohort`
# (`cargo build --release --bin cohort`, or COHORT_BIN) and NumPy.
set -euo pipefail
n=${1:-100}
d=${2:-1000000}
turns=${3:-3}
here=$(cd "$(dirname "$0")" && pwd)
cohort=${COHORT_BIN:-$here/../target/release/cohort}
for turn in $(seq 1 "$turns"); do
  ours=$("$cohort" bench reduce --n "$n" --d "$d" --reducer cpu 2>/dev/null)
  theirs=$(python3 "$here/numpy-fedavg.py" --n "$n" --d "$d")
  printf '%s\n%s\n' "$ours" "$theirs"
  printf '%s\n%s\n' "$ours" "$theirs" | python3 -c '
import json, sys
rows = {r["bench"]: r for r in map(json.loads, sys.stdin)}
f, c, m, x = rows["fedavg"], rows["fedavg_in_cache"], rows["masked_sum"], rows["mask_expand"]
np_ = rows["numpy_tensordot"]
print(json.dumps({"bench": "reduce_vs_numpy", "turn": int(sys.argv[1]),
    "probe_read_gbps": f["probe_read_gbps"], "probe_pattern": f["probe_pattern"],
    "fedavg_gbps": f["gbps"], "fedavg_ratio": f["ratio"],
    "fedavg_ratio_paired": f["ratio_paired"], "fedavg_in_cache_gbps": c["gbps"],
    "masked_sum_gbps": m["gbps"], "masked_sum_ratio": m["ratio"],
    "masked_sum_ratio_paired": m["ratio_paired"],
    "mask_expand_gbps_per_core": x["gbps_per_core"],
    "chacha20_crate_gbps": x["chacha20_crate_gbps"], "rand_chacha_gbps": x["rand_chacha_gbps"],
    "numpy_tensordot_gbps": np_["gbps"], "fedavg_over_numpy": f["gbps"] / np_["gbps"]}))
' "$turn"
done
