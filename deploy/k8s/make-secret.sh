#!/bin/sh
# The Secret the kustomize base requires, qwen3-tts-auth, with fresh random credentials, printed as
# a manifest:
#
#   deploy/k8s/make-secret.sh | kubectl create -f -
#
# - api-keys: the gateway's API keys, one a line (/v1/ and tts.v1 need one of them);
# - internal-token: the shared secret every call between the stages carries;
# - redis-password: the password Valkey requires and speaker_cache sends.
#
# `kubectl create`, not `apply`: an existing Secret is never replaced by accident (the keys handed
# out would stop working). The namespace is the base's unless given as the first argument. Nothing
# is written anywhere else: keep the output out of version control.
set -eu
namespace="${1:-qwen3-tts}"

random() {
  LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c "$1"
}

cat <<MANIFEST
apiVersion: v1
kind: Secret
metadata:
  name: qwen3-tts-auth
  namespace: ${namespace}
  labels:
    app.kubernetes.io/part-of: qwen3-tts
type: Opaque
stringData:
  api-keys: "tts-$(random 40)"
  internal-token: "$(random 48)"
  redis-password: "$(random 32)"
MANIFEST
