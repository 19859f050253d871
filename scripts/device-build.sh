#!/usr/bin/env bash
# Builds, on this machine, what scripts/device-check.sh runs on a machine with an NVIDIA
# GPU (which has no Rust toolchain): the `cohort` binary and the aggregation crate's test
# binary, both with the CUDA reducer, copied into .device/ (ignored by git; carry it).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
cargo build --release --locked -p cohort-coordinator --features cuda
tests=$(cargo test --release --locked -p cohort-aggregation --features cuda --no-run \
    --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cohort_aggregation" \
            and m["profile"]["test"] and m.get("executable"):
        print(m["executable"])')
mkdir -p .device
cp target/release/cohort .device/cohort
cp "$tests" .device/aggregation-tests
strip .device/cohort .device/aggregation-tests
ls -l .device
