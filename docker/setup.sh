#!/bin/sh
# One-shot set-up for docker-compose.yml: writes the sites' data partitions, creates and
# starts a digits experiment, and issues one enrolment token per site. Runs in the
# coordinator's network namespace, so the dev certificate's `localhost` name is right.
set -eu
base=${COHORT_BASE:-https://localhost:8443}
ca=${COHORT_CA:-/var/lib/cohort/coordinator/tls/ca.pem}
shared=${COHORT_SHARED:-/var/lib/cohort/shared}
sites=${COHORT_SITES:-3}
rounds=${COHORT_ROUNDS:-15}

if [ -f "$shared/ready" ]; then
    echo "already set up: $(cat "$shared/ready")"
    exit 0
fi
: "${COHORT_ADMIN_TOKEN:?COHORT_ADMIN_TOKEN must be set}"

api() {
    curl -fsS --cacert "$ca" \
        -H "Authorization: Bearer $COHORT_ADMIN_TOKEN" \
        -H 'Content-Type: application/json' "$@"
}

cohort partition --clients "$sites" --partition "${COHORT_PARTITION:-dirichlet:0.5}" \
    --out "$shared/data"
spec=$(printf '{"name":"compose-digits","features":64,"classes":10,"model":"mlp","rounds":%s,"clients_per_round":%s,"min_participants":%s,"collect_deadline_seconds":300}' \
    "$rounds" "$sites" "$sites")
experiment=$(api -X POST "$base/api/v1/admin/experiments" -d "$spec" | jq -r .id)
api -X POST "$base/api/v1/admin/experiments/$experiment/start" >/dev/null
mkdir -p "$shared/tokens"
i=0
while [ "$i" -lt "$sites" ]; do
    api -X POST "$base/api/v1/admin/enrolment-tokens" -d "{\"label\":\"site-$i\"}" \
        | jq -r .token >"$shared/tokens/site-$i"
    chmod 600 "$shared/tokens/site-$i"
    i=$((i + 1))
done
echo "experiment $experiment" >"$shared/ready"
echo "experiment $experiment started with $sites sites"
