# Helpers that bench/vs_triton.sh and bench/vs_mlserver.sh share (sourced, not run).
# They expect HOST, PEERS, PERF_ANALYZER, PA_TIMEOUT, MEASUREMENT_INTERVAL, STABILITY,
# MAX_TRIALS and a log function.

# port_free PORT: nothing listens on HOST:PORT.
port_free() { ! (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

# descendants PID: the process and every process below it (8 levels at most), one per line.
descendants() {
  local frontier=("$1") next p child depth
  echo "$1"
  for depth in $(seq 1 8); do
    next=()
    for p in "${frontier[@]}"; do
      for child in $(pgrep -P "$p" 2>/dev/null); do next+=("$child"); echo "$child"; done
    done
    [ "${#next[@]}" -gt 0 ] || break
    frontier=("${next[@]}")
  done
}

# peak_rss PID: peak resident memory in KiB (each process's VmHWM) summed over the process
# tree (Triton's python-backend stubs, MLServer's workers are processes of their own), and
# the number of processes.
peak_rss() {
  local total=0 count=0 p hwm
  for p in $(descendants "$1"); do
    hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
    [ -n "$hwm" ] && total=$((total + hwm)) && count=$((count + 1))
  done
  echo "$total $count"
}

# seconds_since T0: seconds since $EPOCHREALTIME was T0, one decimal.
seconds_since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# run_perf_analyzer OUT URL PROTOCOL CONCURRENCY [MORE FLAGS...]: one perf_analyzer run on
# the model "ensemble", batch 1, random inputs; OUT.csv (its -f file) and OUT.log. -v logs
# each window ("Pass [n]"): the reports fall back on the last one when no window
# stabilised. stdbuf keeps the log complete when timeout stops it.
run_perf_analyzer() {
  local out=$1 url=$2 proto=$3 c=$4
  shift 4
  rm -f "$out.csv"
  if ! LD_LIBRARY_PATH="$PEERS/lib" timeout "$PA_TIMEOUT" stdbuf -oL "$PERF_ANALYZER" \
    -m ensemble -u "$url" -i "$proto" -b 1 --concurrency-range "$c:$c" \
    --input-data random --measurement-interval "$MEASUREMENT_INTERVAL" \
    --stability-percentage "$STABILITY" --max-trials "$MAX_TRIALS" -v "$@" \
    -f "$out.csv" >"$out.log" 2>&1; then
    log "perf_analyzer did not finish a stable measurement (log: $out.log):"
    grep -E 'Pass \[|Failed|error|Error' "$out.log" | tail -n 3 >&2 || true
  fi
}
