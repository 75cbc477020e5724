#!/usr/bin/env bash
# `make dev` / `make demo`: find or start a Postgres server, make sure an SQS endpoint answers
# (LocalStack on the host unless one is already up at AWS_ENDPOINT_URL), then run
# `rowq dev` or `rowq demo` in the foreground; stop what this script started on exit.
#
# Postgres, in order: DATABASE_URL if set and reachable; the server at 127.0.0.1:5432
# (database rowq_dev, created if missing); a throw-away cluster under .cache/pg started with
# the server binaries (initdb/pg_ctl) if they are installed.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cache=${ROWQ_CACHE:-$root/.cache}
rowq=${ROWQ_BIN:-$root/target/debug/rowq}
local_port=${ROWQ_DEV_PG_PORT:-5432}
throwaway_port=${ROWQ_DEV_THROWAWAY_PORT:-54329}
say() { printf 'dev: %s\n' "$*" >&2; }

export AWS_ENDPOINT_URL=${AWS_ENDPOINT_URL:-http://127.0.0.1:4566}
export AWS_REGION=${AWS_REGION:-us-east-1}
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-test}
export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-test}

answers() { # host port
  timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
}

url_host_port() { # url -> "host port"
  python3 - "$1" <<'PY'
import sys, urllib.parse
u = urllib.parse.urlsplit(sys.argv[1])
print(u.hostname or "127.0.0.1", u.port or 5432)
PY
}

pg_bin() {
  command -v "$1" 2>/dev/null && return 0
  local found
  found=$(printf '%s\n' /usr/lib/postgresql/*/bin/"$1" | sort -V | tail -1)
  [ -x "$found" ] && echo "$found"
}

started_pg=""
cleanup() {
  if [ -n "$started_pg" ]; then
    say "stopping the throw-away Postgres"
    as_pg "$(pg_bin pg_ctl)" -D "$cache/pg/data" -m fast stop >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

as_pg() { # initdb and postgres refuse to run as root
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

# Sets `database` (not echoed: a subshell could not record that it started a server).
choose_database() {
  if [ -n "${DATABASE_URL:-}" ]; then
    # shellcheck disable=SC2046
    if answers $(url_host_port "$DATABASE_URL"); then
      database=$DATABASE_URL; return
    fi
    say "DATABASE_URL does not answer; looking for a local server"
  fi
  if answers 127.0.0.1 "$local_port"; then
    database="postgres://postgres@127.0.0.1:$local_port/rowq_dev"; return
  fi
  local initdb pg_ctl
  initdb=$(pg_bin initdb) || true
  pg_ctl=$(pg_bin pg_ctl) || true
  if [ -z "$initdb" ] || [ -z "$pg_ctl" ]; then
    say "no Postgres answers at 127.0.0.1:$local_port and initdb/pg_ctl are not installed."
    say "start a server, set DATABASE_URL, or install the server binaries (Debian: apt-get install postgresql)."
    exit 1
  fi
  mkdir -p "$cache/pg"
  [ "$(id -u)" = 0 ] && chown postgres "$cache/pg"
  if [ ! -f "$cache/pg/data/PG_VERSION" ]; then
    say "creating a throw-away cluster in $cache/pg/data"
    as_pg "$initdb" -D "$cache/pg/data" -U postgres --auth=trust >/dev/null
  fi
  say "starting the throw-away Postgres on 127.0.0.1:$throwaway_port"
  as_pg "$pg_ctl" -D "$cache/pg/data" -l "$cache/pg/log" -w \
    -o "-p $throwaway_port -k $cache/pg -c listen_addresses=127.0.0.1" start >/dev/null
  started_pg=1
  database="postgres://postgres@127.0.0.1:$throwaway_port/rowq_dev"
}

database=""
choose_database
say "database: $database"

# shellcheck disable=SC2046
if answers $(url_host_port "$AWS_ENDPOINT_URL"); then
  say "SQS endpoint already answering at $AWS_ENDPOINT_URL"
  "$rowq" --database-url "$database" "$@"
else
  "$root/infra/localstack/localstack.sh" with "$rowq" --database-url "$database" "$@"
fi
