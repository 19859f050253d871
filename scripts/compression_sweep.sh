#!/usr/bin/env bash
# Accuracy against bytes for each compression scheme: mnist10k, the built-in MLP
# (mlp:64, 50,890 parameters), 100 clients, Dirichlet(0.3), 10 a round, 100 rounds,
# seeds 1 to 3; plain rounds with each scheme, and secure rounds (SecAgg+) plain and with
# 4-bit uploads in 16-bit masked words. Writes the runs under OUT (default
# target/compression-sweep), the plot of seed 1 to docs/figures/compression-mnist10k-mlp.png
# (and .svg), and prints a Markdown table: bytes per update each way, their ratio to
# uncompressed rounds, and test accuracy (final, and the mean of the last 10 rounds),
# each the mean over the seeds.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/compression-sweep}
SEEDS=${SEEDS:-"1 2 3"}
ROUNDS=${ROUNDS:-100}
cargo build --quiet --release --locked --bin cohort
COHORT=target/release/cohort
common=(simulate --dataset mnist10k --model mlp --clients 100 --clients-per-round 10
  --partition dirichlet:0.3 --rounds "$ROUNDS")
declare -A schemes=(
  [none]="--compress none"
  [quantize8]="--compress quantize:8"
  [quantize4]="--compress quantize:4"
  [quantize4-up]="--compress-up quantize:4"
  [quantize2-up]="--compress-up quantize:2"
  [sign]="--compress sign"
  [topk1pct]="--compress topk:0.01"
  [secure]="--secure-aggregation --clip 0.1"
  [secure-quantize4]="--secure-aggregation --clip 0.1 --compress-up quantize:4 --word-bits 16"
)
order=(none quantize8 quantize4 quantize4-up quantize2-up sign topk1pct secure secure-quantize4)
for seed in $SEEDS; do
  for name in "${order[@]}"; do
    # shellcheck disable=SC2086
    $COHORT "${common[@]}" ${schemes[$name]} --seed "$seed" --out "$OUT/$name/seed$seed" \
      >/dev/null 2>&1
  done
done
first=$(echo "$SEEDS" | awk '{print $1}')
mkdir -p docs/figures
plotted=()
for name in none quantize8 quantize4 sign topk1pct secure-quantize4; do
  plotted+=("$OUT/$name/seed$first")
done
$COHORT compress plot --title "mnist10k, MLP, 100 clients, Dirichlet(0.3), 10 a round (seed $first)" \
  --out docs/figures/compression-mnist10k-mlp.png "${plotted[@]}" >/dev/null
python3 - "$OUT" "${order[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
def runs(name):
    for seed in sorted((out / name).iterdir()):
        rows = [json.loads(l) for l in (seed / "metrics.jsonl").read_text().splitlines() if l]
        yield json.loads((seed / "summary.json").read_text()), rows
base = {}
print("| run | bytes up / update | bytes down / update | up x fewer | up+down x fewer | final accuracy | last 10 rounds | seeds |")
print("|---|---|---|---|---|---|---|---|")
for name in names:
    got = list(runs(name))
    up = statistics.mean(s["bytes_up_per_update"] for s, _ in got)
    down = statistics.mean(s["bytes_down_per_update"] for s, _ in got)
    final = statistics.mean(r[-1]["test_accuracy"] for _, r in got)
    last10 = statistics.mean(statistics.mean(x["test_accuracy"] for x in r[-10:]) for _, r in got)
    key = "secure" if name.startswith("secure") else "none"
    if name == key:
        base[key] = (up, down)
    bu, bd = base.get(key, (up, down))
    print(f"| {name} | {up:,.0f} | {down:,.0f} | {bu / up:.2f} | {(bu + bd) / (up + down):.2f} | {final:.4f} | {last10:.4f} | {len(got)} |")
PY
