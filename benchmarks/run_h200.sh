#!/usr/bin/env bash
# The pending H200 measurements in two device calls, each well inside one call's 10-minute limit.
#
#   engines: talker frame step (both models, the engine run), talker capacity with prefill traffic,
#            code2wav decode, the official qwen-tts baseline. Carry: .whl .whl_ref
#   stack:   the end-to-end sweep through all four services (graph talker, slots code2wav).
#            Carry: .whl .whl_av
#
# Usage on the device machine, from the repository root (OUT defaults to $OUT, else run/h200):
#   benchmarks/run_h200.sh engines|stack
# Wheels (made here, see the device README): .whl = grpcio/protobuf/grpcio-tools/health/reflection,
# fastapi + deps, uvicorn, redis, soxr, prometheus_client; .whl_av = av; .whl_ref = the official
# package and what it pins (transformers 4.57.3, tokenizers, huggingface_hub, accelerate, librosa...).
set -uo pipefail
MODE="${1:?engines or stack}"
OUT="${OUT:-run/h200}"
mkdir -p "$OUT"
REV="$(git rev-parse --short HEAD 2>/dev/null || echo "${REVISION:-unknown}")"
export PYTHONUNBUFFERED=1

install() {  # $1: wheel folder, $2: target
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
}

case "$MODE" in
engines)
    install .whl /tmp/site && export PYTHONPATH=/tmp/site:.
    python3 -c "from qtts import pb; pb.generate(force=True)"
    timeout 200 python3 -m benchmarks.talker_step --models qwen3-tts-12hz-1.7b-base,qwen3-tts-12hz-0.6b-base \
        --engine --out "$OUT/talker_step.json" > "$OUT/talker_step.log" 2>&1
    timeout 150 python3 -m benchmarks.talker_capacity --out "$OUT/talker_capacity.json" > "$OUT/talker_capacity.log" 2>&1
    timeout 150 python3 -m benchmarks.code2wav_decode --revision "$REV" --out "$OUT/code2wav_decode.json" \
        > "$OUT/code2wav_decode.log" 2>&1
    install .whl_ref /tmp/qwen_ref
    PYTHONPATH=/tmp/qwen_ref:/tmp/site:. timeout 90 python3 -m benchmarks.official_baseline \
        --out "$OUT/official_baseline.json" > "$OUT/official_baseline.log" 2>&1
    tail -n 25 "$OUT"/*.log
    ;;
stack)
    install .whl /tmp/site && install .whl_av /tmp/site && export PYTHONPATH=/tmp/site:.
    PYTHON=python3 FIXED_LENGTH=1 CONCURRENCY="${CONCURRENCY:-1 32 128 256}" NUM_REQUESTS="${NUM_REQUESTS:-128}" \
        TIME_LIMIT=420 TALKER_ARGS="--engine graph --max-batch 512" \
        CODE2WAV_ARGS="--decode-engine slots --decode-precision bf16 --max-states 512 --max-batch 256" \
        timeout 560 benchmarks/launch_gpu_stack.sh "$OUT/stack" > "$OUT/stack.log" 2>&1
    tail -n 40 "$OUT/stack.log"
    ;;
*)
    echo "unknown mode $MODE (engines or stack)" >&2
    exit 2
    ;;
esac
