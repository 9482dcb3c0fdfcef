#!/usr/bin/env bash
# One command on a GPU machine: start the whole stack with full-size random (dummy) weights, wait
# until the gateway is healthy, run a closed-loop concurrency sweep through it, write the results,
# and stop the stack.
#
#   benchmarks/launch_gpu_stack.sh [OUT_DIR] [--] [extra tts-bench flags ...]
#
# Settings (environment):
#   MODEL            shipped config or snapshot folder   (configs/qwen3-tts-12hz-1.7b-base)
#   CONCURRENCY      sweep levels                        ("1 8 32 64")
#   NUM_REQUESTS     requests per level                  (64)
#   ROUNDS           at least ROUNDS x c requests per level (0)
#   MAX_NEW_TOKENS   frames per request, 12.5 per second (125 = 10 s of audio)
#   PROTOCOL         http or grpc                        (http)
#   TIME_LIMIT       hard limit of the sweep, seconds    (1800)
#   STARTUP_TIMEOUT  seconds to wait for health          (900)
#   CODE2WAV_REPLICAS                                    (1)
#   CODE2WAV_DEVICES devices the replicas take in turn   ("": DEVICE), e.g. "cuda:1,cuda:2"
#   DEVICE / DTYPE / LOAD_FORMAT                         (cuda / bfloat16 / dummy)
#   LAUNCHER_ARGS    extra flags for services.launcher   ("")
#   TALKER_ARGS / CODE2WAV_ARGS / GATEWAY_ARGS  flags passed through to those services, e.g.
#                    TALKER_ARGS="--engine graph" CODE2WAV_ARGS="--decode-engine slots"
#   ALIGNER          1: also start the aligner stage (word timestamps), on the full-size
#                    forced aligner with dummy weights on DEVICE / DTYPE unless ALIGNER_ARGS says
#                    otherwise; the gateway then serves word_timestamps   (0)
#   ALIGNER_ARGS     flags for services.aligner (setting it implies ALIGNER=1)
#                    ("--model qwen3-forcedaligner-0.6b --load-format dummy --device DEVICE --dtype DTYPE")
#                    A sweep with timestamps on: ALIGNER=1 PROTOCOL=grpc ... -- --word-timestamps
#   THEN_ARGS        client flags of a second sweep on the same stack, into OUT/then   ("")
#   AND_BACK         1: then the first sweep again, into OUT/back   (0)
#   IDLE_FIRST       N: before the sweep, N requests of 2 s one at a time on the idle stack, into
#                    OUT/idle, with every service's metrics scraped right after them, so idle
#                    first audio and its hops (the first-chunk hop histograms) stand apart from
#                    the loaded levels'   (0: none)
#   PYTHON           interpreter with the project installed (python)
#   GATEWAY_REPLICAS gateways in front of the talker (1), HTTP on HTTP_PORT, +1, ...; the client
#                    sends request i to gateway i mod N, as a Service over gateway pods would
#   CLIENT_PROCESSES client processes per level (1); one Python client can fall behind hundreds
#                    of streams, and its lag reads as gaps
#   REFUSAL_PROBE_S  with CLIENT_PROCESSES > 1: the idle parent sends a 1-frame request this often
#                    and times it alone (each level's `probe`: refusal latency without a loaded
#                    client process in it); 0: none   (0.1)
#   ADMISSION_TRACE  1: the talker writes its admission decisions to OUT/admission-trace.jsonl
#                    (--admission-trace; benchmarks/admission_timeline.py reads it)   (0)
#   MPS              1: run the services under an NVIDIA MPS daemon (started here, stopped at
#                    the end), so the talker's and code2wav's kernels share the GPU instead of
#                    taking turns in time slices between the two processes' contexts   (0)
#   STALL_DUMP_MS    every service logs its event loop thread's Python stack when the loop is
#                    this late (TTS_STALL_DUMP_MS, qtts/serving/loop_lag.py; at most 20 a
#                    process); stack_summary groups them; 0: off   (200)
# The results folder gets results.json/.md, the PNG plots, launcher.log and the services' logs.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

OUT="run/bench/gpu-$(date -u +%Y%m%dT%H%M%SZ)"
if [[ $# -gt 0 && "$1" != -* ]]; then
    OUT="$1"
    shift
fi
if [[ "${1:-}" == "--" ]]; then
    shift
fi
MODEL="${MODEL:-configs/qwen3-tts-12hz-1.7b-base}"
CONCURRENCY="${CONCURRENCY:-1 8 32 64}"
NUM_REQUESTS="${NUM_REQUESTS:-64}"
ROUNDS="${ROUNDS:-0}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-125}"
PROTOCOL="${PROTOCOL:-http}"
TIME_LIMIT="${TIME_LIMIT:-1800}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-900}"
CODE2WAV_REPLICAS="${CODE2WAV_REPLICAS:-1}"
DEVICE="${DEVICE:-cuda}"
DTYPE="${DTYPE:-bfloat16}"
LOAD_FORMAT="${LOAD_FORMAT:-dummy}"
WEIGHTS=real
[[ "$LOAD_FORMAT" == dummy ]] && WEIGHTS=dummy
# Random weights end speech at random: fix every request's length unless told otherwise.
FIXED_LENGTH="${FIXED_LENGTH-$([[ "$WEIGHTS" == dummy ]] && echo 1 || true)}"
LAUNCHER_ARGS="${LAUNCHER_ARGS:-}"
ALIGNER="${ALIGNER:-0}"
[[ -n "${ALIGNER_ARGS:-}" ]] && ALIGNER=1
ALIGNER_ARGS="${ALIGNER_ARGS:-"--model qwen3-forcedaligner-0.6b --load-format dummy --device $DEVICE --dtype $DTYPE"}"
ALIGNER_FLAGS=()
if [[ "$ALIGNER" == 1 ]]; then
    ALIGNER_FLAGS=(--aligner --aligner-args "$ALIGNER_ARGS")
fi
PYTHON="${PYTHON:-python}"
HTTP_PORT=8000
GRPC_PORT=50051

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
echo "results: $OUT"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>/dev/null || true
GPU_NAME="$(head -n1 "$OUT/gpu.txt" 2>/dev/null | cut -d, -f1)"
GPU_NAME="${GPU_NAME:-unknown}"

MPS_STARTED=0
if [[ "${MPS:-0}" == 1 ]]; then
    if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
        export CUDA_MPS_PIPE_DIRECTORY="$OUT/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$OUT/mps/log"
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        if nvidia-cuda-mps-control -d; then
            MPS_STARTED=1
            echo "mps: on" >>"$OUT/gpu.txt"
        else
            echo "MPS=1: nvidia-cuda-mps-control -d failed; running without MPS" >&2
        fi
    else
        echo "MPS=1: nvidia-cuda-mps-control is not installed; running without MPS" >&2
    fi
fi

export TTS_STALL_DUMP_MS="${STALL_DUMP_MS:-200}"
if [[ "${ADMISSION_TRACE:-0}" == 1 ]]; then
    TALKER_ARGS="${TALKER_ARGS:-} --admission-trace $OUT/admission-trace.jsonl"
fi
# shellcheck disable=SC2086  # LAUNCHER_ARGS is a list of flags
"$PYTHON" -m services.launcher \
    --model "$MODEL" --load-format "$LOAD_FORMAT" --device "$DEVICE" --dtype "$DTYPE" \
    --code2wav-replicas "$CODE2WAV_REPLICAS" --code2wav-devices "${CODE2WAV_DEVICES:-}" \
    --gateway-replicas "${GATEWAY_REPLICAS:-1}" \
    --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" \
    --log-dir "$OUT/logs" --startup-timeout "$STARTUP_TIMEOUT" \
    --talker-args "${TALKER_ARGS:-}" --code2wav-args "${CODE2WAV_ARGS:-}" --gateway-args "${GATEWAY_ARGS:-}" \
    "${ALIGNER_FLAGS[@]}" $LAUNCHER_ARGS \
    >"$OUT/launcher.log" 2>&1 &
LAUNCHER_PID=$!

stop_stack() {
    if kill -0 "$LAUNCHER_PID" 2>/dev/null; then
        echo "stopping the stack (pid $LAUNCHER_PID)"
        kill -TERM "$LAUNCHER_PID" 2>/dev/null || true
        # The launcher drains and stops its services itself; give it time, then insist.
        for _ in $(seq 1 60); do
            kill -0 "$LAUNCHER_PID" 2>/dev/null || break
            sleep 1
        done
        kill -KILL "$LAUNCHER_PID" 2>/dev/null || true
    fi
    wait "$LAUNCHER_PID" 2>/dev/null || true
    if [[ "$MPS_STARTED" == 1 ]]; then
        echo quit | nvidia-cuda-mps-control || true
    fi
}
trap stop_stack EXIT

healthy() {
    "$PYTHON" - "$HTTP_PORT" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=5) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

echo "waiting for every service to be SERVING and the gateway healthy (up to ${STARTUP_TIMEOUT}s) ..."
START=$(date +%s)
# The launcher prints "stack is up" once every service (each code2wav replica too) is SERVING;
# the gateway alone turns healthy as soon as the talker answers.
until grep -q "stack is up" "$OUT/launcher.log" 2>/dev/null && healthy; do
    if ! kill -0 "$LAUNCHER_PID" 2>/dev/null; then
        echo "the stack exited during start-up; launcher.log:" >&2
        tail -n 60 "$OUT/launcher.log" >&2
        exit 1
    fi
    if (( $(date +%s) - START > STARTUP_TIMEOUT )); then
        echo "the gateway was not healthy after ${STARTUP_TIMEOUT}s; launcher.log:" >&2
        tail -n 60 "$OUT/launcher.log" >&2
        exit 1
    fi
    sleep 2
done
echo "stack healthy after $(( $(date +%s) - START ))s"

GATEWAY_URLS="http://127.0.0.1:$HTTP_PORT"
GRPC_TARGETS="127.0.0.1:$GRPC_PORT"  # gateway i > 0 listens on HTTP_PORT + i and GRPC_PORT + 10 + i
for ((i = 1; i < ${GATEWAY_REPLICAS:-1}; i++)); do
    GATEWAY_URLS+=",http://127.0.0.1:$((HTTP_PORT + i))"
    GRPC_TARGETS+=",127.0.0.1:$((GRPC_PORT + 10 + i))"
done
# The text tokenizer the talker's dummy load uses (the real BPE vocabulary when it is installed).
TOKENIZER="$("$PYTHON" -c 'from qtts.model.bpe_vocab import dummy_tokenizer_label; print(dummy_tokenizer_label())' 2>/dev/null || echo unknown)"
sweep() {  # $1: results folder; the rest: extra client flags
    local out="$1"
    shift
    # The host before and after the sweep (benchmarks/host_probe.py): a Python loop's time and the
    # CPU's use, steal included, into $out/host-cpu.json, so stacks of one call are read with theirs.
    mkdir -p "$out"
    "$PYTHON" -m benchmarks.host_probe snap "$out/host-before.json" || true
    _sweep "$out" "$@"  # (a failing sweep ends the script, as it did before the probe)
    { "$PYTHON" -m benchmarks.host_probe snap "$out/host-after.json" &&
        "$PYTHON" -m benchmarks.host_probe report "$out/host-before.json" "$out/host-after.json" \
            --out "$out/host-cpu.json" && rm -f "$out/host-before.json" "$out/host-after.json"; } || true
}
_sweep() {
    local out="$1"
    shift
    # shellcheck disable=SC2086  # CONCURRENCY is a list of levels
    "$PYTHON" -m benchmarks.client \
        --protocol "$PROTOCOL" --url "$GATEWAY_URLS" --grpc-target "$GRPC_TARGETS" \
        --task-type voice_clone --concurrency $CONCURRENCY --num-requests "$NUM_REQUESTS" --rounds "$ROUNDS" \
        --max-new-tokens "$MAX_NEW_TOKENS" ${FIXED_LENGTH:+--fixed-length} --time-limit "$TIME_LIMIT" --warmup 4 \
        --gpu "$GPU_NAME" --weights "$WEIGHTS" --tokenizer "$TOKENIZER" --tag "gpu-sweep" --out "$out" \
        --processes "${CLIENT_PROCESSES:-1}" --refusal-probe-s "${REFUSAL_PROBE_S:-0.1}" "$@"
}
# Server-side view: every service's Prometheus metrics page, into $1.
scrape() {
    "$PYTHON" - "$1" "${GATEWAY_REPLICAS:-1}" "$ALIGNER" <<'PY' || true
import sys, urllib.request
extra = [(f"gateway-{i}", 9110 + i) for i in range(1, int(sys.argv[2]))]
extra += [("aligner", 9101)] if sys.argv[3] == "1" else []
for name, port in (("gateway", 9100), ("talker", 9102), ("code2wav", 9103), *extra):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            open(f"{sys.argv[1]}/metrics-{name}.txt", "wb").write(r.read())
    except Exception as exc:  # noqa: BLE001 - a missing scrape must not fail the run
        print(f"metrics of {name} (:{port}) not scraped: {exc}", file=sys.stderr)
PY
}
if (( ${IDLE_FIRST:-0} > 0 )); then
    # One client process, one request at a time, 25 frames each; its own warm-up as any sweep's.
    CONCURRENCY=1 NUM_REQUESTS="$IDLE_FIRST" ROUNDS=0 MAX_NEW_TOKENS=25 CLIENT_PROCESSES=1 REFUSAL_PROBE_S=0 \
        sweep "$OUT/idle" "$@"
    scrape "$OUT/idle"
fi
sweep "$OUT" "$@"
# THEN_ARGS: the same sweep again on this stack with these flags added, into $OUT/then (e.g.
# ALIGNER=1 PROTOCOL=grpc THEN_ARGS=--word-timestamps: timestamps off, then on, one stack).
if [[ -n "${THEN_ARGS:-}" ]]; then
    # shellcheck disable=SC2086  # THEN_ARGS is a list of flags
    sweep "$OUT/then" "$@" $THEN_ARGS
    # AND_BACK=1: the first sweep once more, into $OUT/back, so that neither setting has only
    # the warmer stack (off, on, off: the two offs bracket the on).
    if [[ "${AND_BACK:-0}" == 1 ]]; then
        sweep "$OUT/back" "$@"
    fi
fi

# Server-side view of the run: every service's Prometheus metrics once the sweeps are done (counts
# since the stack started: the idle requests' too, when IDLE_FIRST ran them).
scrape "$OUT"
