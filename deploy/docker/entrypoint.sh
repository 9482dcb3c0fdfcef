#!/bin/sh
# qtts-entrypoint SERVICE [FLAGS...]: runs `python -m services.SERVICE FLAGS...` as PID 1, so the
# service itself receives SIGTERM and drains its streams.
set -eu

usage() {
    echo "usage: qtts-entrypoint {gateway|talker|code2wav|speaker_cache|aligner} [flags...]" >&2
}

if [ "$#" -lt 1 ]; then
    usage
    exit 64
fi
service=$1
shift
case "$service" in
    gateway | talker | code2wav | speaker_cache | aligner) ;;
    speaker-cache) service=speaker_cache ;;
    -h | --help)
        usage
        exit 0
        ;;
    *)
        echo "qtts-entrypoint: unknown service '$service'" >&2
        usage
        exit 64
        ;;
esac
exec python -m "services.$service" "$@"
