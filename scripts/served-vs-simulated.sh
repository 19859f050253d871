#!/usr/bin/env bash
# The same experiment served and simulated: `cohort demo` (a coordinator and 10
# `cohort-edge` processes over TLS, digits, MLP, Dirichlet(0.5)) against
# `cohort simulate` with the same settings, over several seeds, with the means.
#
# The two draw the split, the partition, the initial model and the clients' seeds from
# one seed differently, so one seed is the same distribution, not the same data: compare
# the means.
#
# Usage: scripts/served-vs-simulated.sh [STRATEGY] [ROUNDS] [SEEDS] [COHORT]
#   defaults: fedadam 30 5 target/release/cohort
set -euo pipefail
strategy=${1:-fedadam}
rounds=${2:-30}
seeds=${3:-5}
cohort=${4:-target/release/cohort}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

served_sum=0
simulated_sum=0
for seed in $(seq 0 $((seeds - 1))); do
  served=$("$cohort" demo --strategy "$strategy" --rounds "$rounds" --seed "$seed" \
    --dir "$work/demo" 2>&1 | sed -n 's/^final_test_accuracy=//p')
  simulated=$("$cohort" simulate --dataset digits --model mlp --clients 10 \
    --partition dirichlet:0.5 --rounds "$rounds" --seed "$seed" --strategy "$strategy" \
    --out "$work/sim-$seed" 2>/dev/null | sed -n 's/^final test accuracy \([0-9.]*\).*/\1/p')
  echo "$strategy rounds=$rounds seed=$seed served=$served simulated=$simulated"
  served_sum=$(python3 -c "print($served_sum + $served)")
  simulated_sum=$(python3 -c "print($simulated_sum + $simulated)")
done
python3 -c "
s, m = $served_sum / $seeds, $simulated_sum / $seeds
print(f'mean over {$seeds} seeds: served {s:.4f}, simulated {m:.4f}, difference {abs(s - m):.4f}')"
