#!/usr/bin/env bash
# rowq beside two peers on this machine, in turns: each block runs rowq's drain and pickup pairs
# (the SQL floor with the in-memory drain, the latency floor with the in-memory pickup), then
# Graphile Worker's workloads and PgQueuer's on the same Postgres; the last lines are medians
# over every block (summary.mjs). A machine's speed moves by a third from one minute to the
# next, so only runs close in time compare. `make bench-peers` installs the peers and builds the
# benchmark first.
#
# PEER_BLOCKS (3); PEER_PYTHON (PgQueuer's interpreter); PEER_CARGO (bench; `test` runs rowq's
# side unoptimised, as bench-smoke does); rowq's bench settings (BENCH_N,
# BENCH_LATENCY_N, ...), which the peers read too.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
runs=$(mktemp)
trap 'rm -f "$runs"' EXIT
for block in $(seq "${PEER_BLOCKS:-3}"); do
  echo "== block $block: rowq ($(date +%T))" >&2
  BENCH_ONLY=sql-floor,drain-memory,latency-floor,latency-memory \
    cargo "${PEER_CARGO:-bench}" --locked --bench bench | tee -a "$runs"
  echo "== block $block: graphile-worker ($(date +%T))" >&2
  node "$here/graphile-worker/bench.mjs" | tee -a "$runs"
  echo "== block $block: pgqueuer ($(date +%T))" >&2
  "${PEER_PYTHON:-python3}" "$here/pgqueuer/bench.py" | tee -a "$runs"
done
node "$here/summary.mjs" "$runs" graphile-worker pgqueuer
