#!/usr/bin/env bash
# Accuracy against epsilon under distributed differential privacy (Skellam noise added
# by the clients under secure aggregation): digits, 100 clients, 20 per round (Poisson
# sampling), Dirichlet(0.5), 40 rounds planned, L2 clip 0.5, delta 1e-5, budgets 2, 4
# and 8 with the noise multiplier `cohort privacy noise` gives for 40 rounds; plus the
# same run without DP. Writes the runs and the plot under OUT (default
# target/dp-sweep), and prints one line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/dp-sweep}
SEED=${SEED:-1}
cargo build --quiet -p cohort-coordinator --bin cohort
COHORT=target/debug/cohort
common=(simulate --dataset digits --clients 100 --clients-per-round 20
  --partition dirichlet:0.5 --rounds 40 --secure-aggregation --seed "$SEED")
runs=()
for eps in 2 4 8; do
  sigma=$($COHORT privacy noise --sampling-rate 0.2 --rounds 40 --epsilon "$eps" --delta 1e-5 | tail -1)
  $COHORT "${common[@]}" --dp-clip 0.5 --dp-noise-multiplier "$sigma" --dp-epsilon "$eps" \
    --out "$OUT/eps$eps" >/dev/null 2>&1
  runs+=("$OUT/eps$eps")
done
$COHORT "${common[@]}" --out "$OUT/no-dp" >/dev/null 2>&1
runs+=("$OUT/no-dp")
$COHORT privacy plot --title "digits, distributed DP under secure aggregation (delta 1e-5)" \
  --out "$OUT/accuracy-vs-epsilon.png" "${runs[@]}"
