#!/usr/bin/env bash
# LocalStack (SQS only) on the host, from PyPI, without Docker.
#
#   infra/localstack/localstack.sh install   create the cached virtualenv (idempotent)
#   infra/localstack/localstack.sh up        install, start in the background, wait until ready
#   infra/localstack/localstack.sh down      stop what `up` started
#   infra/localstack/localstack.sh status    exit 0 when an endpoint answers
#   infra/localstack/localstack.sh with CMD  run CMD with LocalStack up (its process id in
#                                            ROWQ_LOCALSTACK_PID); stop it afterwards if this
#                                            call started it
#
# The pins below each fix a failure seen with localstack-core 2026.3.0 (see infra/README.md):
# cbor2 6 -> "No component plugins found"; pyOpenSSL 26 -> "no attribute add_extensions";
# cryptography 50 -> "no attribute GEN_EMAIL"; service_identity is used but not declared.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${ROWQ_CACHE:-$root/.cache}
venv=$cache/localstack-venv
state=$cache/localstack
pidfile=$state/localstack.pid
logfile=$state/localstack.log
listen=${LOCALSTACK_LISTEN:-127.0.0.1:4566}
version=2026.3.0
# Secrets Manager's provider is moto's (localstack-core's `runtime` extra, which would bring all of
# moto's services); SQS needs none of it.
moto=5.1.54

say() { printf 'localstack: %s\n' "$*" >&2; }

# localstack-core 2026.3.0 needs Python 3.13: `localstack.utils.tagging` imports
# `warnings.deprecated`, new in 3.13. On 3.12 it installs, then fails at start with "No component
# plugins found" (the plugin that imports it cannot load), although the package declares >= 3.10.
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 13))' 2>/dev/null; }

find_python() {
  local candidates=(python3.13 python3.14) candidate
  if command -v pyenv >/dev/null 2>&1; then
    local pyroot; pyroot=$(pyenv root)
    candidates+=("$pyroot"/versions/3.13*/bin/python3 "$pyroot"/versions/3.14*/bin/python3)
  fi
  for candidate in "${candidates[@]}" python3; do
    candidate=$(command -v "$candidate") && new_enough "$candidate" && { echo "$candidate"; return 0; }
  done
  return 1
}

healthy() {
  python3 - "$listen" <<'PY' >/dev/null 2>&1
import json, sys, urllib.request
with urllib.request.urlopen(f"http://{sys.argv[1]}/_localstack/health", timeout=2) as r:
    services = json.load(r).get("services", {})
sys.exit(0 if services.get("sqs") in ("available", "running") else 1)
PY
}

install() {
  if [ -x "$venv/bin/python" ] && new_enough "$venv/bin/python" \
     && "$venv/bin/python" -c 'import localstack' 2>/dev/null \
     && [ "$(cat "$venv/.rowq-version" 2>/dev/null)" = "$version $moto" ]; then
    return 0
  fi
  local py
  if ! py=$(find_python); then
    say "needs Python >= 3.13 (localstack-core $version imports warnings.deprecated, new in 3.13)."
    say "install python3.13 (e.g. 'pyenv install 3.13', or your OS package) and retry."
    exit 1
  fi
  say "installing localstack-core $version into $venv with $py (about 30 s, once)"
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  printf 'cbor2<6\npyopenssl==25.1.0\ncryptography>=45.0.1,<46\n' > "$cache/localstack-constraints.txt"
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    "localstack-core[base-runtime]==$version" service_identity "moto-ext==$moto" \
    -c "$cache/localstack-constraints.txt"
  echo "$version $moto" > "$venv/.rowq-version"
}

up() {
  if healthy; then
    say "already answering on $listen"
    return 0
  fi
  install
  mkdir -p "$state/fs"
  say "starting on $listen (log: $logfile)"
  OVERRIDE_IN_DOCKER=0 SERVICES=sqs,secretsmanager GATEWAY_LISTEN="$listen" LOCALSTACK_HOST="$listen" \
  SQS_ENDPOINT_STRATEGY=path FILESYSTEM_ROOT="$state/fs" DISABLE_EVENTS=1 SKIP_SSL_CERT_DOWNLOAD=1 \
    nohup "$venv/bin/python" -m localstack.runtime.main >"$logfile" 2>&1 &
  echo $! > "$pidfile"
  for _ in $(seq 1 120); do
    if healthy; then say "ready"; return 0; fi
    if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      say "exited during start-up; last lines of $logfile:"; tail -20 "$logfile" >&2; exit 1
    fi
    sleep 0.5
  done
  say "not ready after 60 s; last lines of $logfile:"; tail -20 "$logfile" >&2
  exit 1
}

down() {
  if [ -f "$pidfile" ]; then
    local pid; pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -KILL "$pid" 2>/dev/null || true
      say "stopped"
    fi
    rm -f "$pidfile"
  fi
}

with() {
  local status=0
  if ! healthy; then
    up
    trap down EXIT # also on Ctrl-C or a failure of CMD
  fi
  # The benchmark reads LocalStack's CPU from /proc by this (when `up` started it, now or before).
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    ROWQ_LOCALSTACK_PID=$(cat "$pidfile")
    export ROWQ_LOCALSTACK_PID
  fi
  "$@" || status=$?
  return "$status"
}

case "${1:-}" in
  with) shift; with "$@" ;;
  install) install ;;
  up) up ;;
  down) down ;;
  status) healthy ;;
  *) echo "usage: $0 install|up|down|status" >&2; exit 2 ;;
esac
