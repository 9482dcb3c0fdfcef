#!/usr/bin/env bash
# One device call of the recent sessions, whole: install the wheels, then fresh stacks with the
# talker flags of the headline (`stacks`), or the engines alone (`engines`). The `run` tool's
# command line is then short, e.g. (carry [".whl"], REVISION the commit sent):
#
#   REVISION=abc1234 STACKS="open open" RATES="100 150" OPEN_DURATION=15 \
#       STACK_TALKER_2="--prefill-coalesce-from-load 0.45" bash benchmarks/device_call.sh stacks
#   REVISION=abc1234 STACKS="http" CLIENT_PROCESSES=8 GATEWAY_REPLICAS=4 CONC="768 1024" \
#       bash benchmarks/device_call.sh stacks
#   REVISION=abc1234 bash benchmarks/device_call.sh engines
#   REVISION=abc1234 CONC=1024 STACK_TALKER_2="--admission-engine-costs overlap --admission-step-fit typical" \
#       bash benchmarks/device_call.sh headline
#
# headline: stacks with the #26 headline's conditions (ADMISSION_TRACE=1, CLIENT_PROCESSES=8,
# GATEWAY_REPLICAS=4, and EXTRA_T="--kv-cache-dtype fp8" on an H100), each kept where set.
# stacks: STACKS (http, grpc, grpcts, open; one fresh stack each, in order), CONC (closed-loop
# levels, default "768 1024"), RATES and OPEN_DURATION (open loop), BUDGET (seconds this call
# may run, default 575) and NEED (seconds a stack needs to start another, default 240),
# STACK_TALKER_n and STACK_CODE2WAV_n (more talker or code2wav flags for the n-th stack: an A/B
# on one machine), EXTRA_T (more talker flags for every stack), CLIENT_PROCESSES,
# GATEWAY_REPLICAS, STACK_CLIENT_ARGS (more client flags for every stack, e.g. --retry-after),
# STACK_TREE_n (the n-th stack runs another revision's tree: .ab/<rev> from
# benchmarks/ab_tree.sh, carried as ".ab"; hosts differ between calls, so an A/B of two revisions
# belongs in one call), PROFILE_STACKS="<n> ..." (py-spy samples every service and the client of
# those stacks for PROFILE_S=4 s once the talker carries PROFILE_AT=50 streams: a closed-loop
# level's opening burst; carry .whl_prof, from `python -m benchmarks.device_wheels --prof`).
# Every stack runs 30 idle requests first (IDLE_FIRST).
# engines: ENGINE_STREAMS, ENGINE_STEPS (run_h200.sh engines).
# Results: $OUT/s (stacks) or $OUT/e (engines), as run_h200.sh packs them.
# The tree sent is at most 64 MiB: with .whl carried, move benchmarks/results/ (about 45 MB, read
# by nothing here) out of the tree for the call and back after it.
set -uo pipefail
MODE="${1:?stacks, headline or engines}"
export REVISION=${REVISION:?set REVISION to the revision of the tree sent}
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "gpu $GPU_NAME"
export PYTHONUNBUFFERED=1
S=$SECONDS
if [[ "$MODE" == headline ]]; then
    # The #26 headline's conditions of the 2026-12-07 sessions, so a call needs only REVISION and
    # CONC (and STACKS, STACK_TALKER_n, STACK_TREE_n to vary them): the admission trace, the client
    # in 8 processes, four gateways, and on an H100 the 8-bit KV cache (with the bf16 one its 80 GB
    # held 667 streams' KV slots beside the decoder, fewer than the levels). Each set value is kept.
    export ADMISSION_TRACE="${ADMISSION_TRACE:-1}" CLIENT_PROCESSES="${CLIENT_PROCESSES:-8}" \
        GATEWAY_REPLICAS="${GATEWAY_REPLICAS:-4}"
    if [[ "$GPU_NAME" == *H100* && -z "${EXTRA_T+set}" ]]; then
        export EXTRA_T="--kv-cache-dtype fp8"
    fi
    echo "headline: trace $ADMISSION_TRACE, $CLIENT_PROCESSES client processes, $GATEWAY_REPLICAS gateways, talker flags added: ${EXTRA_T:-none}"
    MODE=stacks
fi
case "$MODE" in
stacks)
    # (run_h200.sh stacks installs .whl into /tmp/site and sets PYTHONPATH itself.)
    # The headline's talker flags (BENCHMARKS.md, `T`), with the admission's uncontended step fit.
    T="--engine graph --max-batch 1024 --max-len 512 --max-queue 2048 --prefill-buckets 64,128,192,256,320,384,448,512 --first-audio-budget-ms 6000 --admission-step-fit uncontended ${EXTRA_T:-}"
    OUT=$OUT/s BUDGET=${BUDGET:-575} NEED=${NEED:-240} IDLE_FIRST=${IDLE_FIRST:-30} STACKS="${STACKS:-http http}" \
        CONCURRENCY="${CONC:-768 1024}" TALKER_ARGS="$T" \
        benchmarks/run_h200.sh stacks 2>&1 | grep -v "^$" | tail -70
    ;;
engines)
    OUT=$OUT/e ENGINE_STREAMS="${ENGINE_STREAMS:-1536}" ENGINE_STEPS="${ENGINE_STEPS:-capacity decode step prefill aligner}" \
        benchmarks/run_h200.sh engines 2>&1 | grep -v "^$" | tail -150
    ;;
*)
    echo "unknown mode $MODE: stacks, headline or engines" >&2
    exit 2
    ;;
esac
echo "done at $((SECONDS - S)) s"
