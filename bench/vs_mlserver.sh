#!/usr/bin/env bash
# orchestrion against MLServer (Seldon's KServe v2 server, latest from PyPI), the same pipeline,
# under the same perf_analyzer.
#
# The pipeline is the one of bench/vs_triton.sh: INPUT FP32 [16] -> preprocess (x * 2 + 1),
# then classify (softmax of a fixed dense 16 -> 10) and segment (tanh(x) * 0.5) in parallel.
# orchestrion serves it as the ensemble bench/vs_triton/orchestrion_models (three jitted JAX
# steps, max_batch_size 8, dynamic batching). MLServer has no ensembles: it serves the three
# steps as one custom model written in numpy, bench/vs_mlserver/models/ensemble (its own
# `predict`). Every server is started on 127.0.0.1 (each on its own ports) and checked against
# the numpy reference of bench/vs_triton/check_same.py over HTTP and gRPC
# (bench/vs_mlserver/check.py); then perf_analyzer measures them in turn, one server after
# the other for each protocol and concurrency, so that a machine shared with other work
# disturbs every server alike; the tables (throughput, p50, p99) and the throughput ratio
# orchestrion / MLServer are printed. The idle servers wait meanwhile (no load).
#
#   bench/vs_mlserver.sh                                  # everything (about 7 minutes)
#   CONCURRENCY="1" PROTOCOLS="grpc" bench/vs_mlserver.sh # a smoke run
#   SERVERS="mlserver orchestrion" bench/vs_mlserver.sh   # MLServer's defaults only
#
# Servers (SERVERS, "mlserver mlserver-lean orchestrion"):
#   mlserver       MLServer as installed: parallel_workers 1 (inference runs in one worker
#                  process, requests reach it through a queue), debug on (access logs).
#   mlserver-lean  MLServer at its fastest for a model this small: parallel_workers 0
#                  (inference on the server's own event loop), debug off (no access logs).
#   orchestrion    `orchestrion serve` with its defaults (no response cache).
#
# Environment: SERVERS (above), PROTOCOLS ("grpc http"), CONCURRENCY ("1 4 16"),
# MEASUREMENT_INTERVAL (3000 ms), STABILITY (25 %), MAX_TRIALS (8), PA_TIMEOUT (90 s per
# perf_analyzer run), HTTP_TENSOR_FORMAT (json: MLServer does not offer Triton's binary tensor
# extension, so over HTTP every server gets and returns JSON tensors; gRPC sends raw bytes),
# MLSERVER_PORTS ("20000 20001 20002"), MLSERVER_LEAN_PORTS ("20100 20101 20102"),
# ORCHESTRION_PORTS ("19100 19101 19102") as HTTP gRPC metrics, READY_TIMEOUT (120 s),
# STOP_TIMEOUT (15 s), RESULTS (bench/.peers/results-mlserver), MLSERVER_SPEC (mlserver: the
# pip requirement, latest by default).
#
# Set-up, idempotent, into git-ignored folders only: bench/.venv-mlserver (MLServer, with uvloop
# below 0.22: MLServer 1.7.1's inference workers die at start with uvloop 0.22 or later, "There
# is no current event loop in thread 'MainThread'", SeldonIO/MLServer#2286, so with a newer
# uvloop the model never loads), and perf_analyzer in bench/.peers, from bench/vs_triton.sh's
# set-up (run here with no servers when it is missing).
#
# perf_analyzer reads the model's Triton config before it measures (GET
# /v2/models/<name>/config, the ModelConfig RPC), which MLServer does not serve:
# bench/vs_mlserver/serve.py starts MLServer with those two read-only endpoints added, and
# nothing else changed (see its docstring).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
HERE="$ROOT/bench/vs_mlserver"
VENV="$ROOT/bench/.venv-mlserver"
PEERS="$ROOT/bench/.peers"
RESULTS="${RESULTS:-$PEERS/results-mlserver}"
SERVERS="${SERVERS:-mlserver mlserver-lean orchestrion}"
PROTOCOLS="${PROTOCOLS:-grpc http}"
CONCURRENCY="${CONCURRENCY:-1 4 16}"
MEASUREMENT_INTERVAL="${MEASUREMENT_INTERVAL:-3000}"
STABILITY="${STABILITY:-25}"
MAX_TRIALS="${MAX_TRIALS:-8}"
PA_TIMEOUT="${PA_TIMEOUT:-90}"
HTTP_TENSOR_FORMAT="${HTTP_TENSOR_FORMAT:-json}"
MLSERVER_PORTS="${MLSERVER_PORTS:-20000 20001 20002}"
MLSERVER_LEAN_PORTS="${MLSERVER_LEAN_PORTS:-20100 20101 20102}"
ORCHESTRION_PORTS="${ORCHESTRION_PORTS:-19100 19101 19102}"
READY_TIMEOUT="${READY_TIMEOUT:-120}"
STOP_TIMEOUT="${STOP_TIMEOUT:-15}"
MLSERVER_SPEC="${MLSERVER_SPEC:-mlserver}"
HOST=127.0.0.1

log() { printf '[vs_mlserver %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=bench/_servers.sh
source "$ROOT/bench/_servers.sh"

# ---------------------------------------------------------------- set-up (idempotent)

setup_venv() {
  if [ ! -x "$VENV/bin/python" ] ||
    ! "$VENV/bin/python" -c 'import mlserver, numpy, grpc' 2>/dev/null; then
    log "installing $MLSERVER_SPEC into $VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "$MLSERVER_SPEC" 'uvloop<0.22'
  fi
  if ! "$VENV/bin/python" -c '
import sys, uvloop
sys.exit(tuple(int(p) for p in uvloop.__version__.split(".")[:2]) >= (0, 22))' 2>/dev/null; then
    log "pinning uvloop below 0.22 in $VENV (SeldonIO/MLServer#2286)"
    "$VENV/bin/pip" install -q 'uvloop<0.22'
  fi
  MLSERVER_VERSION="$("$VENV/bin/python" -c 'import mlserver; print(mlserver.__version__)')"
}

setup_perf_analyzer() {
  PERF_ANALYZER="$PEERS/bin/perf_analyzer"
  if [ ! -x "$PERF_ANALYZER" ] || [ ! -e "$PEERS/lib/libb64.so.0d" ] ||
    [ ! -e "$PEERS/lib/libcudart.so.12" ]; then
    log "perf_analyzer missing: running bench/vs_triton.sh's set-up (no servers)"
    SERVERS=" " RESULTS="$PEERS/results-setup" "$ROOT/bench/vs_triton.sh" >/dev/null
  fi
  if LD_LIBRARY_PATH="$PEERS/lib" ldd "$PERF_ANALYZER" | grep -q 'not found'; then
    die "perf_analyzer misses shared libraries (LD_LIBRARY_PATH=$PEERS/lib)"
  fi
}

# ---------------------------------------------------------------- servers

ports_of() {
  case "$1" in
    mlserver) echo "$MLSERVER_PORTS" ;;
    mlserver-lean) echo "$MLSERVER_LEAN_PORTS" ;;
    orchestrion) echo "$ORCHESTRION_PORTS" ;;
    *) die "unknown server '$1' (mlserver, mlserver-lean or orchestrion)" ;;
  esac
}

declare -A SERVER_PIDS=()
# stop_server NAME: TERM, up to STOP_TIMEOUT seconds, then KILL what is left of its tree.
stop_server() {
  local pid="${SERVER_PIDS[$1]:-}" tree p
  [ -n "$pid" ] || return 0
  tree="$(descendants "$pid")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 $((STOP_TIMEOUT * 10))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  for p in $tree; do kill -KILL "$p" 2>/dev/null || true; done # only this server's processes
  wait "$pid" 2>/dev/null || true
  unset "SERVER_PIDS[$1]"
}
stop_all() { local name; for name in "${!SERVER_PIDS[@]}"; do stop_server "$name"; done; }
trap stop_all EXIT
trap 'exit 130' INT TERM

# start_server NAME LOG: starts it in the background, waits until its model is ready.
start_server() {
  local name=$1 logfile=$2 http grpc metrics
  read -r http grpc metrics <<<"$(ports_of "$name")"
  for p in $http $grpc $metrics; do
    port_free "$p" || die "port $p is taken (set MLSERVER_PORTS or ORCHESTRION_PORTS)"
  done
  local t0=$EPOCHREALTIME
  case "$name" in
    mlserver | mlserver-lean)
      local workers=1 debug=true
      [ "$name" = mlserver-lean ] && workers=0 debug=false
      # MLServer keeps its metrics and environments folders in its working directory.
      mkdir -p "$RESULTS/$name/cwd"
      (cd "$RESULTS/$name/cwd" && exec env MLSERVER_HOST="$HOST" MLSERVER_HTTP_PORT="$http" \
        MLSERVER_GRPC_PORT="$grpc" MLSERVER_METRICS_PORT="$metrics" \
        MLSERVER_PARALLEL_WORKERS="$workers" MLSERVER_DEBUG="$debug" \
        "$VENV/bin/python" "$HERE/serve.py" start "$HERE/models") >"$logfile" 2>&1 &
      ;;
    orchestrion)
      "$ROOT/scripts/orchestrion" serve --model-repository "$ROOT/bench/vs_triton/orchestrion_models" \
        --host "$HOST" --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" \
        >"$logfile" 2>&1 &
      ;;
  esac
  local pid=$!
  SERVER_PIDS[$name]=$pid
  local deadline=$((SECONDS + READY_TIMEOUT))
  # The model's readiness, not the server's: MLServer reports ready with no model loaded.
  until curl -sf -m 2 -o /dev/null "http://$HOST:$http/v2/models/ensemble/ready"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$logfile" >&2
      unset "SERVER_PIDS[$name]"
      log "error: $name exited before its model was ready (log: $logfile)"
      return 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 30 "$logfile" >&2
      stop_server "$name"
      log "error: $name's model not ready after ${READY_TIMEOUT}s (log: $logfile)"
      return 1
    fi
    sleep 0.5
  done
  local took
  took="$(seconds_since "$t0")"
  log "$name ready in $took s, pid $pid"
  echo "$took" >"$RESULTS/$name/startup_cache-off.txt"
}

# ---------------------------------------------------------------- measurement

# measure NAME PROTOCOL CONCURRENCY: one perf_analyzer run.
measure() {
  local name=$1 proto=$2 c=$3 http grpc _metrics url out format=()
  read -r http grpc _metrics <<<"$(ports_of "$name")"
  case "$proto" in
    grpc) url="$HOST:$grpc" ;;
    http)
      url="$HOST:$http"
      format=(--input-tensor-format "$HTTP_TENSOR_FORMAT" --output-tensor-format "$HTTP_TENSOR_FORMAT")
      ;;
  esac
  out="$RESULTS/$name/${proto}_cache-off_c${c}"
  log "$name $proto concurrency=$c"
  run_perf_analyzer "$out" "$url" "$proto" "$c" "${format[@]}"
}

# ---------------------------------------------------------------- main

t_start=$SECONDS
for name in $SERVERS; do ports_of "$name" >/dev/null; done
for proto in $PROTOCOLS; do
  case "$proto" in grpc | http) ;; *) die "unknown protocol '$proto' (grpc or http)" ;; esac
done
setup_venv
setup_perf_analyzer
log "MLServer $MLSERVER_VERSION ($VENV); orchestrion from $ROOT"
mkdir -p "$RESULTS"
started=()
for name in $SERVERS; do
  mkdir -p "$RESULTS/$name"
  rm -f "$RESULTS/$name/"*_cache-off_c* "$RESULTS/$name/"{startup,rss}_cache-off.txt
  start_server "$name" "$RESULTS/$name/server.log" || { log "skipping $name"; continue; }
  read -r http grpc _ <<<"$(ports_of "$name")"
  if ! timeout 60 "$VENV/bin/python" "$HERE/check.py" --http "$HOST:$http" --grpc "$HOST:$grpc" >&2; then
    die "$name does not compute the reference numbers"
  fi
  started+=("$name")
done
[ "${#started[@]}" -gt 0 ] || die "no server started"
for proto in $PROTOCOLS; do
  for c in $CONCURRENCY; do
    for name in "${started[@]}"; do measure "$name" "$proto" "$c"; done
  done
done
for name in "${started[@]}"; do
  peak_rss "${SERVER_PIDS[$name]}" >"$RESULTS/$name/rss_cache-off.txt"
  stop_server "$name"
done
log "measured in $((SECONDS - t_start)) s; raw CSVs and logs under $RESULTS"
"$VENV/bin/python" "$HERE/report.py" "$RESULTS" --servers "$SERVERS" --protocols "$PROTOCOLS" \
  --concurrency "$CONCURRENCY" --mlserver-version "$MLSERVER_VERSION"
