#!/usr/bin/env bash
# Set up, build a demo collection from the Python standard library's docstrings (no download),
# start the search service on the embedded default, and answer a query over gRPC.
#   bash scripts/demo.sh            # keeps serving on 127.0.0.1:50051 until Ctrl-C
#   bash scripts/demo.sh --once     # answers the demo queries, then stops the server
# PORT=50051 (gRPC; metrics on PORT+1000) and SEARCH_DATA_DIR=demo-data override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
DATA=${SEARCH_DATA_DIR:-demo-data}
PORT=${PORT:-50051}
PY=.venv/bin/python
if [ ! -f "$DATA/stdlib/ALIAS" ]; then
  $PY -m index_builder.cli demo-corpus --out "$DATA/stdlib-docs.jsonl"
  $PY -m index_builder.cli build --data-dir "$DATA" --collection stdlib \
      --corpus "$DATA/stdlib-docs.jsonl" --factory "HNSW32,Flat" --publish
fi
$PY -m server.main serve --data-dir "$DATA" --port "$PORT" --metrics-port $((PORT + 1000)) &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
$PY -m server.client --address "127.0.0.1:$PORT" --wait 120 --collection stdlib \
    "how do I parse a JSON string into a Python object" --top-k 3
$PY -m server.client --address "127.0.0.1:$PORT" --collection stdlib --mode lexical \
    "shutil.rmtree" --top-k 3
if [ "${1:-}" != "--once" ]; then
  echo "serving on 127.0.0.1:$PORT (metrics on :$((PORT + 1000))); Ctrl-C to stop"
  wait $SERVER
fi
