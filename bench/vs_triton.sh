#!/usr/bin/env bash
# orchestrion against a real Triton Inference Server (2.51.0, CPU only), same 3-step ensemble.
#
# Both servers load the same ensemble (bench/vs_triton/*_models: preprocess, then classify and
# segment in parallel; max_batch_size 8, dynamic batching, INPUT FP32 [16]; Triton's steps are
# Python-backend numpy, orchestrion's are jitted JAX, or, with ORCHESTRION_MODELS=triton_models,
# Triton's own files, their Python-backend model.py run unchanged). Each server is started on
# loopback once per cache setting, perf_analyzer measures it over each protocol at each
# concurrency, and the tables (throughput, p50, p99) and the throughput ratio orchestrion /
# Triton are printed.
#
#   bench/vs_triton.sh                       # everything (about 7-8 minutes on 2 cores)
#   CONCURRENCY="1" PROTOCOLS="grpc" CACHE="off" bench/vs_triton.sh   # smoke run
#   SERVERS="triton" bench/vs_triton.sh      # one side only
#   ORCHESTRION_MODELS=triton_models bench/vs_triton.sh   # both servers, the same model files
#
# Environment: SERVERS ("triton orchestrion"), PROTOCOLS ("grpc http"), CONCURRENCY ("1 4 8"),
# CACHE ("off on"; "on" starts the server with --cache-config local,size=CACHE_SIZE and
# perf_analyzer's random input is one buffer, so those rows are cache hits),
# MEASUREMENT_INTERVAL (3000 ms), STABILITY (25 %), MAX_TRIALS (8), PA_TIMEOUT (90 s per
# perf_analyzer run: at 20k+ infer/s, cache hits, each of its windows takes longer to process
# than the last), CACHE_SIZE (1048576),
# TRITON_PORTS ("18000 18001 18002"), ORCHESTRION_PORTS ("19000 19001 19002") as HTTP gRPC
# metrics, READY_TIMEOUT (120 s), ORCHESTRION_MODELS (orchestrion_models: the folder under
# bench/vs_triton that orchestrion serves; triton_models serves it Triton's own Python-backend
# files), RESULTS (bench/.peers/results; bench/.peers/results-same-models with
# ORCHESTRION_MODELS=triton_models, so neither run overwrites the other's), CHECK (1: before
# measuring, bench/vs_triton/check_same.py checks over HTTP that the server computes the numpy
# reference), ORCHESTRION_FLAGS (more `orchestrion serve` flags, e.g. "--workers 2"; unset:
# its defaults), MIN_RATIO (unset: report only; a number: exit 1 when any row's throughput
# ratio orchestrion / Triton is below it: the regression check, e.g.
#   MIN_RATIO=1.0 CONCURRENCY="1 16" MEASUREMENT_INTERVAL=2000 bench/vs_triton.sh
# in about four minutes).
#
# First run installs, into git-ignored folders only: bench/.venv-triton (nvidia-pytriton 0.7.0,
# which carries tritonserver 2.51.0 and its Python backend) and bench/.peers (perf_analyzer
# from the tritonclient 2.51.0 wheel, its two shared libraries, a writable copy of the
# backends). Later runs reuse them. Why these pieces: pytriton's wheel (55 MB, glibc 2.35 or
# later) carries tritonserver, the Python backend, a backend stub per Python version and the
# local cache, and no other backend. perf_analyzer is not on PyPI (the `perf-analyzer` package
# there is an empty placeholder): the tritonclient 2.51.0 manylinux wheel carries the binary
# (2.60.0's needs glibc 2.38), which needs libb64 and libcudart, shipped by pytriton under
# hashed names. Triton wants the stub next to libtriton_python.so: hence the writable copy.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
HERE="$ROOT/bench/vs_triton"
VENV="$ROOT/bench/.venv-triton"
PEERS="$ROOT/bench/.peers"
ORCHESTRION_MODELS="${ORCHESTRION_MODELS:-orchestrion_models}"
ORCHESTRION_FLAGS="${ORCHESTRION_FLAGS:-}"
case "$ORCHESTRION_MODELS" in
  orchestrion_models) RESULTS="${RESULTS:-$PEERS/results}" ;;
  triton_models) RESULTS="${RESULTS:-$PEERS/results-same-models}" ;;
  *) RESULTS="${RESULTS:-$PEERS/results-$ORCHESTRION_MODELS}" ;;
esac
SERVERS="${SERVERS:-triton orchestrion}"
PROTOCOLS="${PROTOCOLS:-grpc http}"
CONCURRENCY="${CONCURRENCY:-1 4 8}"
CACHE="${CACHE:-off on}"
MEASUREMENT_INTERVAL="${MEASUREMENT_INTERVAL:-3000}"
STABILITY="${STABILITY:-25}"
MAX_TRIALS="${MAX_TRIALS:-8}"
PA_TIMEOUT="${PA_TIMEOUT:-90}"
CACHE_SIZE="${CACHE_SIZE:-1048576}"
TRITON_PORTS="${TRITON_PORTS:-18000 18001 18002}"
ORCHESTRION_PORTS="${ORCHESTRION_PORTS:-19000 19001 19002}"
READY_TIMEOUT="${READY_TIMEOUT:-120}"
CHECK="${CHECK:-1}"
HOST=127.0.0.1

log() { printf '[vs_triton %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=bench/_servers.sh
source "$ROOT/bench/_servers.sh"

# ---------------------------------------------------------------- set-up (idempotent)

setup_venv() {
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import pytriton, numpy' 2>/dev/null; then
    log "installing nvidia-pytriton 0.7.0 into $VENV (one 55 MB wheel)"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q 'nvidia-pytriton==0.7.0' numpy
  fi
  PYTRITON="$("$VENV/bin/python" -c 'import os, pytriton; print(os.path.dirname(pytriton.__file__))')"
  TRITON_LIBS="$(dirname "$PYTRITON")/nvidia_pytriton.libs"
  PYVER="$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  PYLIBDIR="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
}

setup_perf_analyzer() {
  PERF_ANALYZER="$PEERS/bin/perf_analyzer"
  mkdir -p "$PEERS/bin" "$PEERS/lib"
  if [ ! -x "$PERF_ANALYZER" ]; then
    log "extracting perf_analyzer from the tritonclient 2.51.0 wheel"
    mkdir -p "$PEERS/wheels"
    "$VENV/bin/pip" download -q --no-deps 'tritonclient==2.51.0' -d "$PEERS/wheels"
    local wheel
    wheel="$(ls "$PEERS"/wheels/tritonclient-2.51.0-*manylinux*x86_64.whl | head -n1)"
    unzip -o -q -j "$wheel" 'tritonclient-2.51.0.data/data/bin/perf_analyzer' -d "$PEERS/bin"
    chmod +x "$PERF_ANALYZER"
  fi
  # perf_analyzer needs libb64.so.0d and libcudart.so.12: pytriton ships both (hashed names).
  ln -sf "$(ls "$TRITON_LIBS"/libb64-*.so.0d | head -n1)" "$PEERS/lib/libb64.so.0d"
  ln -sf "$(ls "$TRITON_LIBS"/libcudart-*.so.12* | head -n1)" "$PEERS/lib/libcudart.so.12"
  if LD_LIBRARY_PATH="$PEERS/lib" ldd "$PERF_ANALYZER" | grep -q 'not found'; then
    LD_LIBRARY_PATH="$PEERS/lib" ldd "$PERF_ANALYZER" | grep 'not found' >&2
    die "perf_analyzer misses shared libraries"
  fi
}

setup_backends() {
  # Triton wants the Python backend's stub next to libtriton_python.so: copy the backends.
  BACKENDS="$PEERS/backends"
  if [ ! -x "$BACKENDS/python/triton_python_backend_stub" ]; then
    log "copying Triton's backends to $BACKENDS (Python $PYVER stub)"
    rm -rf "$BACKENDS"
    cp -r "$PYTRITON/tritonserver/backends" "$BACKENDS"
    cp "$PYTRITON/tritonserver/python_backend_stubs/$PYVER/triton_python_backend_stub" \
      "$BACKENDS/python/"
  fi
}

# ---------------------------------------------------------------- servers

SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# start_server NAME CACHE LOG: starts it in the background, waits for /v2/health/ready.
start_server() {
  local name=$1 cache=$2 logfile=$3 http grpc metrics
  read -r http grpc metrics <<<"$(ports_of "$name")"
  for p in $http $grpc $metrics; do
    port_free "$p" || die "port $p is taken (set ${name^^}_PORTS=\"HTTP GRPC METRICS\")"
  done
  local cache_flags=()
  [ "$cache" = on ] && cache_flags=(--cache-config "local,size=$CACHE_SIZE")
  local t0=$EPOCHREALTIME
  case "$name" in
    triton)
      # The venv's libpython first (else the stub may load another one), then pytriton's
      # libraries: the copied stub's RPATH ($ORIGIN/../../../../nvidia_pytriton.libs) no
      # longer reaches them. Started from $PEERS, not the repository root: the stubs put their
      # working directory on sys.path, and nothing of this checkout belongs on Triton's.
      (cd "$PEERS" && exec env PATH="$VENV/bin:$PATH" \
        LD_LIBRARY_PATH="$PYLIBDIR:$TRITON_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$PYTRITON/tritonserver/bin/tritonserver" \
        --model-repository="$HERE/triton_models" \
        --backend-directory="$BACKENDS" \
        --cache-directory="$PYTRITON/tritonserver/caches" \
        --http-address="$HOST" --grpc-address="$HOST" --metrics-address="$HOST" \
        --http-port="$http" --grpc-port="$grpc" --metrics-port="$metrics" \
        --allow-gpu-metrics=false --log-verbose=0 \
        "${cache_flags[@]}") >"$logfile" 2>&1 &
      ;;
    orchestrion)
      # shellcheck disable=SC2086 # ORCHESTRION_FLAGS: words, split on purpose
      "$ROOT/scripts/orchestrion" serve --model-repository "$HERE/$ORCHESTRION_MODELS" \
        --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" \
        "${cache_flags[@]}" $ORCHESTRION_FLAGS >"$logfile" 2>&1 &
      ;;
  esac
  SERVER_PID=$!
  local deadline=$((SECONDS + READY_TIMEOUT))
  until curl -sf -o /dev/null "http://$HOST:$http/v2/health/ready"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      tail -n 30 "$logfile" >&2
      log "error: $name exited before it was ready (log: $logfile)"
      SERVER_PID=""
      return 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 30 "$logfile" >&2
      log "error: $name not ready after ${READY_TIMEOUT}s (log: $logfile)"
      stop_server
      return 1
    fi
    sleep 0.5
  done
  local took
  took="$(seconds_since "$t0")"
  log "$name (cache $cache) ready in $took s, pid $SERVER_PID"
  echo "$took" >"$RESULTS/$name/startup_cache-$cache.txt"
}

ports_of() {
  case "$1" in
    triton) echo "$TRITON_PORTS" ;;
    orchestrion) echo "$ORCHESTRION_PORTS" ;;
    *) die "unknown server '$1' (triton or orchestrion)" ;;
  esac
}

# ---------------------------------------------------------------- measurement

# measure NAME CACHE: one perf_analyzer run per protocol and concurrency.
measure() {
  local name=$1 cache=$2 http grpc _metrics url proto c out
  read -r http grpc _metrics <<<"$(ports_of "$name")"
  for proto in $PROTOCOLS; do
    case "$proto" in
      grpc) url="$HOST:$grpc" ;;
      http) url="$HOST:$http" ;;
      *) die "unknown protocol '$proto' (grpc or http)" ;;
    esac
    for c in $CONCURRENCY; do
      out="$RESULTS/$name/${proto}_cache-${cache}_c${c}"
      log "$name $proto cache=$cache concurrency=$c"
      run_perf_analyzer "$out" "$url" "$proto" "$c"
    done
  done
}

# ---------------------------------------------------------------- main

t_start=$SECONDS
for name in $SERVERS; do ports_of "$name" >/dev/null; done
for proto in $PROTOCOLS; do
  case "$proto" in grpc | http) ;; *) die "unknown protocol '$proto' (grpc or http)" ;; esac
done
for cache in $CACHE; do
  case "$cache" in on | off) ;; *) die "unknown cache setting '$cache' (off or on)" ;; esac
done
case " $SERVERS " in
  *" orchestrion "*)
    [ -f "$HERE/$ORCHESTRION_MODELS/ensemble/config.pbtxt" ] ||
      die "no ensemble in $HERE/$ORCHESTRION_MODELS (orchestrion_models or triton_models)"
    log "orchestrion serves bench/vs_triton/$ORCHESTRION_MODELS"
    ;;
esac
setup_venv
setup_perf_analyzer
case " $SERVERS " in *" triton "*) setup_backends ;; esac
mkdir -p "$RESULTS"
for name in $SERVERS; do
  mkdir -p "$RESULTS/$name"
  for cache in $CACHE; do
    rm -f "$RESULTS/$name/"*"_cache-${cache}_c"* "$RESULTS/$name/startup_cache-$cache.txt"
    start_server "$name" "$cache" "$RESULTS/$name/server_cache-$cache.log" || {
      log "skipping $name with cache $cache"
      continue
    }
    if [ "$CHECK" = 1 ] && [ "$cache" = "${CACHE%% *}" ]; then
      read -r http _ <<<"$(ports_of "$name")"
      if ! "$VENV/bin/python" "$HERE/check_same.py" --http "$HOST:$http" >&2; then
        stop_server
        die "$name does not compute the reference numbers"
      fi
    fi
    measure "$name" "$cache"
    peak_rss "$SERVER_PID" >"$RESULTS/$name/rss_cache-$cache.txt"
    stop_server
  done
done
log "measured in $((SECONDS - t_start)) s; raw CSVs and logs under $RESULTS"
"$VENV/bin/python" "$HERE/report.py" "$RESULTS" \
  --servers "$SERVERS" --protocols "$PROTOCOLS" --cache "$CACHE" --concurrency "$CONCURRENCY" \
  ${MIN_RATIO:+--min-ratio "$MIN_RATIO"}
