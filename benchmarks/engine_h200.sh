#!/usr/bin/env bash
# The talker engine's measurements for issue #27 on one H200 (1.7B Base, random weights), from the
# repository root: prefill cost per position (packed vs per-row), the frame step in bf16 and FP8,
# FP8 fidelity, the phase/kernel profile and talker capacity with prompts arriving. Each command
# is capped at 170 s; the whole script takes about 12-15 minutes, so a 10-minute device call runs
# it in two halves: `engine_h200.sh 1` (prefill, frame step bf16 and fp8) and `engine_h200.sh 2`
# (fidelity, profile, capacity). Results: JSON and logs under $RES.
set -u
PART="${1:-all}"
RES="${RES:-benchmarks/results/engine}"
mkdir -p "$RES"
python3 -c "from qtts import pb; pb.generate(force=True)" >/dev/null
run() {  # name, then the command
    local name="$1"
    shift
    echo "== $name: $*"
    timeout 170 "$@" >"$RES/$name.log" 2>&1
    echo "exit $?"
    tail -n 25 "$RES/$name.log"
}
# shellcheck disable=SC2054  # --batches takes one comma-separated argument
STEP=(python3 -m benchmarks.talker_step --models qwen3-tts-12hz-1.7b-base --batches 1,256,512,1024 --eager-batches none)
if [[ "$PART" == all || "$PART" == 1 ]]; then
    run prefill_cost python3 -m benchmarks.prefill_cost --out "$RES/prefill_cost.json"
    run talker_step_bf16 "${STEP[@]}" --out "$RES/talker_step_bf16.json"
    run talker_step_fp8 "${STEP[@]}" --weight-dtype fp8 --out "$RES/talker_step_fp8.json"
fi
if [[ "$PART" == all || "$PART" == 2 ]]; then
    run fp8_fidelity python3 -m benchmarks.fp8_fidelity --batches 1,64,256,1024 --out "$RES/fp8_fidelity.json"
    run talker_profile python3 -m benchmarks.talker_profile --buckets 2,256,1024 --out "$RES/talker_profile.json"
    # 1,536 streams of 8 s with 300-position prompts bring ~4,600 prompt positions a step: the
    # engine's default budget (4,096) would leave a backlog whatever the speed.
    run talker_capacity python3 -m benchmarks.talker_capacity --streams 1024,1280,1536 --measure-steps 120 \
        --max-prefill-tokens 6144 --out "$RES/talker_capacity.json"
fi
