#!/usr/bin/env bash
# The edge client's footprint: the size of the device build (`--profile edge`: LTO,
# size-optimised, stripped) and its peak resident memory while it trains the built-in
# MLP on the digits in real rounds against a real `cohort serve` over TLS.
#
#   scripts/edge-footprint.sh [ROUNDS]      (default 3)
#   MODEL=mlp:1024,1024 scripts/edge-footprint.sh   (another built-in model)
#   SECURE=1 scripts/edge-footprint.sh      (three clients under SecAgg+, the largest
#                                            peak of the three is reported)
#
# Peak memory is `/usr/bin/time -v`'s "Maximum resident set size" of the whole
# cohort-edge process, enrolment to exit. The model's and the data's own sizes are
# printed beside it, so that the overhead (runtime, TLS, buffers) can be read off.
# Needs curl, jq and GNU time.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
for tool in curl jq /usr/bin/time; do
  command -v "$tool" >/dev/null || { echo "edge-footprint: $tool is needed" >&2; exit 2; }
done

# A target folder of its own: the fat-LTO build does not disturb the everyday one.
EDGE_TARGET=${EDGE_TARGET:-target/edge-footprint}
CARGO_TARGET_DIR=$EDGE_TARGET cargo build --locked --quiet --profile edge -p cohort-edge
cargo build --locked --quiet -p cohort-coordinator --bin cohort
EDGE=$EDGE_TARGET/edge/cohort-edge
COHORT=target/debug/cohort

size() { stat -c %s "$1"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }

WORK=$(mktemp -d)
SERVER=
cleanup() {
  [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

PORT=$((20000 + RANDOM % 20000))
BASE=https://127.0.0.1:$PORT
export COHORT_ADMIN_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
"$COHORT" serve --dev-tls --data-dir "$WORK/coordinator" --listen "127.0.0.1:$PORT" \
  >"$WORK/serve.log" 2>&1 &
SERVER=$!
CA=$WORK/coordinator/tls/ca.pem
api() {
  curl -sS --fail-with-body --cacert "$CA" -H "Authorization: Bearer $COHORT_ADMIN_TOKEN" \
    -H 'Content-Type: application/json' "$@"
}
for _ in $(seq 1 100); do
  [ -f "$CA" ] && curl -sf --cacert "$CA" "$BASE/api/v1/health" >/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/serve.log" >&2; exit 1; }
  sleep 0.2
done

# Plain: one site with all the training rows, the most data one client can hold here.
# Secure: SecAgg+ needs several clients; three share the rows.
if [ "${SECURE:-0}" = 1 ]; then SITES=3; SECAGG=', "secure_aggregation": {}'; else SITES=1; SECAGG=; fi
"$COHORT" partition --clients "$SITES" --seed 0 --out "$WORK/parts" >/dev/null
ROWS=$(($(wc -l <"$WORK/parts/client-0.csv") - 1))
FEATURES=64

EXP=$(api -X POST "$BASE/api/v1/admin/experiments" -d "{
  \"name\": \"footprint\", \"features\": $FEATURES, \"classes\": 10, \"model\": \"${MODEL:-mlp}\",
  \"rounds\": $ROUNDS, \"clients_per_round\": $SITES, \"min_participants\": $SITES,
  \"train\": {\"local_epochs\": 5, \"batch_size\": 16}$SECAGG}")
ID=$(jq -r .id <<<"$EXP")
PIDS=()
for site in $(seq 0 $((SITES - 1))); do
  TOKEN=$(api -X POST "$BASE/api/v1/admin/enrolment-tokens" -d "{\"label\": \"site-$site\"}" |
    jq -r .token)
  COHORT_ENROL_TOKEN=$TOKEN /usr/bin/time -v -o "$WORK/time-$site.txt" \
    "$EDGE" --coordinator "$BASE" --ca-cert "$CA" --data "$WORK/parts/client-$site.csv" \
    --state-dir "$WORK/edge-$site" --seed "$site" --idle-exit 5 \
    >"$WORK/edge-$site.log" 2>&1 &
  PIDS+=($!)
done
for _ in $(seq 1 100); do
  api "$BASE/api/v1/admin/clients" |
    jq -e --argjson n "$SITES" 'map(select(.last_seen_at != null)) | length >= $n' >/dev/null && break
  sleep 0.2
done
api -X POST "$BASE/api/v1/admin/experiments/$ID/start" >/dev/null
for site in "${!PIDS[@]}"; do
  wait "${PIDS[$site]}" || { cat "$WORK/edge-$site.log" >&2; exit 1; }
done

STATE=$(api "$BASE/api/v1/admin/experiments/$ID" | jq -r .state)
PUBLISHED=$(api "$BASE/api/v1/admin/experiments/$ID/rounds" |
  jq '[.[] | select(.stage == "published")] | length')
[ "$STATE" = finished ] && [ "$PUBLISHED" -eq "$ROUNDS" ] || {
  echo "edge-footprint: the experiment did not finish ($STATE, $PUBLISHED rounds)" >&2
  cat "$WORK"/edge-*.log >&2
  exit 1
}
PARAMS=$(api "$BASE/api/v1/admin/experiments/$ID/model" -o "$WORK/model.bin" -w '%{size_download}')
PARAMS=$((PARAMS / 4))
RSS_KIB=$(awk -F': ' '/Maximum resident set size/ { print $2 }' "$WORK"/time-*.txt | sort -n | tail -1)
WALL=$(awk -F': ' '/Elapsed \(wall clock\)/ { print $2 }' "$WORK/time-0.txt")
MODE=plain; [ "$SITES" -gt 1 ] && MODE="SecAgg+, $SITES clients"

echo "edge client binary ($EDGE, stripped): $(size "$EDGE") bytes ($(mib "$(size "$EDGE")"))"
echo "C library (libcohort_edge.so, stripped): $(size "$EDGE_TARGET/edge/libcohort_edge.so") bytes ($(mib "$(size "$EDGE_TARGET/edge/libcohort_edge.so")"))"
echo "peak resident memory ($MODE), $ROUNDS rounds of the built-in MLP on $ROWS digits rows a client: $RSS_KIB KiB ($(mib $((RSS_KIB * 1024)))), wall $WALL"
echo "  model: $PARAMS parameters = $(mib $((PARAMS * 4))) as f32; data: $ROWS x $FEATURES f32 = $(mib $((ROWS * FEATURES * 4)))"
