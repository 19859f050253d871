#!/usr/bin/env bash
# Personalised models against the global FedAvg model, on each client's own held-out
# split: digits and mnist10k, the built-in MLP, 50 clients, 10 a round, 50 rounds,
# partitions shards:2 (two classes a client) and dirichlet:0.1, seeds 1 to 3; FedAvg
# (with --client-holdout 0.2, the split every personalised run holds out) and fedper,
# fedrep (the output layer personal), ditto:0.001 and finetune:5. Writes the runs under
# OUT (default target/personalisation-sweep) and prints a Markdown table: per scheme,
# the mean over clients of the personalised accuracy and its 10th percentile after the
# last round, next to FedAvg's global model on the same splits, each the mean over the
# seeds. SCHEMES, DATASETS and PARTITIONS (space-separated) run a subset; FedAvg, the
# baseline, always runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/personalisation-sweep}
SEEDS=${SEEDS:-"1 2 3"}
ROUNDS=${ROUNDS:-50}
cargo build --quiet --release --locked --bin cohort
COHORT=target/release/cohort
read -r -a schemes <<< "fedavg ${SCHEMES:-fedper:layers.1 fedrep:layers.1 ditto:0.001 finetune:5}"
for dataset in ${DATASETS:-digits mnist10k}; do
  for partition in ${PARTITIONS:-shards:2 dirichlet:0.1}; do
    for scheme in "${schemes[@]}"; do
      for seed in $SEEDS; do
        if [ "$scheme" = fedavg ]; then how=(--client-holdout 0.2); else how=(--personalise "$scheme"); fi
        run="$OUT/$dataset/${partition/:/-}/${scheme//[:,]/-}/seed$seed"
        [ -f "$run/metrics.jsonl" ] && continue
        $COHORT simulate --dataset "$dataset" --model mlp --clients 50 --clients-per-round 10 \
          --rounds "$ROUNDS" --partition "$partition" --seed "$seed" "${how[@]}" \
          --out "$run" >/dev/null 2>&1
      done
    done
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def last(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l][-1]
print("| data | partition | scheme | personal mean | personal p10 | FedAvg global mean | FedAvg global p10 | gain | seeds |")
print("|---|---|---|---|---|---|---|---|---|")
for dataset in sorted(p for p in out.iterdir() if p.is_dir()):
    for part in sorted(p for p in dataset.iterdir() if p.is_dir()):
        base = [last(s) for s in sorted((part / "fedavg").iterdir())]
        g_mean = statistics.mean(r["client_accuracy_mean"] for r in base)
        g_p10 = statistics.mean(r["client_accuracy_p10"] for r in base)
        for scheme in sorted(p for p in part.iterdir() if p.is_dir() and p.name != "fedavg"):
            rows = [last(s) for s in sorted(scheme.iterdir())]
            p_mean = statistics.mean(r["personal_accuracy_mean"] for r in rows)
            p_p10 = statistics.mean(r["personal_accuracy_p10"] for r in rows)
            print(f"| {dataset.name} | {part.name} | {scheme.name} | {p_mean:.4f} | {p_p10:.4f} | {g_mean:.4f} | {g_p10:.4f} | {p_mean - g_mean:+.4f} | {len(rows)} |")
PY
