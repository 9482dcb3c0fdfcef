#!/usr/bin/env bash
# Profile the running stack under load: waits until the talker carries at least MIN_STREAMS
# streams (its tts_active_streams gauge), then samples every service process and the benchmark
# client with py-spy for SECONDS (collapsed stacks, one file per process) and saves each service's
# /metrics. Run it in the background beside benchmarks/launch_gpu_stack.sh (default ports).
#
#   benchmarks/profile_stack.sh OUT_DIR [MIN_STREAMS] [SECONDS]
set -uo pipefail
OUT="${1:?output folder}"
MIN_STREAMS="${2:-200}"
SECONDS_TO_SAMPLE="${3:-8}"
PYSPY="${PYSPY:-py-spy}"
mkdir -p "$OUT"
fetch() {  # $1: URL -> body on stdout (empty on failure)
    python3 -c 'import sys, urllib.request
try:
    sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())
except Exception:
    pass' "$1"
}
gauge() {  # the talker's active streams, 0 while it is not up
    fetch http://127.0.0.1:9102/metrics | awk '/^tts_talker_active_streams[{ ]/ {s += $NF} END {print int(s)}'
}
for _ in $(seq 1 1200); do
    (( $(gauge) >= MIN_STREAMS )) && break
    sleep 0.5
done
echo "profiling at $(gauge) active streams" >"$OUT/profile.txt"
# Every gateway (GATEWAY_REPLICAS runs several), the talker, code2wav and the benchmark client
# (its worker processes are its children: --subprocesses). A second process of a name gets its
# pid in the file name.
for name in services.gateway services.talker services.code2wav benchmarks.client; do
    pids="$(pgrep -f -- " $name( |$)")"
    [[ "$name" == services.gateway ]] || pids="$(head -n1 <<<"$pids")"
    [[ -n "$pids" ]] || { echo "$name: no process" >>"$OUT/profile.txt"; continue; }
    first=1
    for pid in $pids; do
        file="$OUT/pyspy-${name#*.}.txt"
        (( first )) || file="$OUT/pyspy-${name#*.}-$pid.txt"
        first=0
        "$PYSPY" record --nonblocking --threads --subprocesses -r 200 -d "$SECONDS_TO_SAMPLE" -f raw \
            -o "$file" -p "$pid" >>"$OUT/profile.txt" 2>&1 &
    done
done
wait
for port in 9100 9102 9103; do
    fetch "http://127.0.0.1:$port/metrics" >"$OUT/metrics-$port.txt"
done
echo "done" >>"$OUT/profile.txt"
