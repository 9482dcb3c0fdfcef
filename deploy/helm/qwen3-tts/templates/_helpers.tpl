{{/*
Names. The release prefix is cut to 40 characters so that the longest suffix
("-code2wav-headless") still fits the 63-character limit of a Service name.
*/}}
{{- define "qwen3-tts.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "qwen3-tts.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "qwen3-tts.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Name of a stage's objects. Call with (dict "root" $ "component" "talker"). */}}
{{- define "qwen3-tts.componentName" -}}
{{- printf "%s-%s" (include "qwen3-tts.fullname" .root) .component }}
{{- end }}

{{- define "qwen3-tts.selectorLabels" -}}
app.kubernetes.io/name: {{ include "qwen3-tts.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "qwen3-tts.labels" -}}
helm.sh/chart: {{ include "qwen3-tts.chart" .root }}
{{ include "qwen3-tts.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: qwen3-tts
{{- end }}

{{/*
A stage's image fields: its own `image` block over global.cpuImage (gateway, speaker-cache) or
global.image (the GPU stages). Call with (dict "root" $ "component" "talker" "values" .Values.talker).
*/}}
{{- define "qwen3-tts.imageFields" -}}
{{- $base := ternary .root.Values.global.cpuImage .root.Values.global.image (has .component (list "gateway" "speaker-cache")) }}
{{- toJson (merge (deepCopy (.values.image | default dict)) $base) }}
{{- end }}

{{/* repository@digest when a digest is given, else repository:tag (default: the appVersion). */}}
{{- define "qwen3-tts.image" -}}
{{- $img := include "qwen3-tts.imageFields" . | fromJson }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{- define "qwen3-tts.imagePullPolicy" -}}
{{- $img := include "qwen3-tts.imageFields" . | fromJson }}
{{- $img.pullPolicy | default "IfNotPresent" }}
{{- end }}

{{/* Address of a stage's ClusterIP Service. */}}
{{- define "qwen3-tts.serviceAddress" -}}
{{- printf "%s.%s.svc.%s:%v" (include "qwen3-tts.componentName" .) .root.Release.Namespace .root.Values.global.clusterDomain .port }}
{{- end }}

{{- define "qwen3-tts.code2wavHeadless" -}}
{{- printf "%s-headless" (include "qwen3-tts.componentName" (dict "root" . "component" "code2wav")) }}
{{- end }}

{{/*
The stable address of every code2wav replica, comma separated:
<statefulset>-<i>.<headless service>.<namespace>.svc.<cluster domain>:<port>, i = 0 .. replicaCount-1.
*/}}
{{- define "qwen3-tts.code2wavAddresses" -}}
{{- $sts := include "qwen3-tts.componentName" (dict "root" . "component" "code2wav") }}
{{- $svc := include "qwen3-tts.code2wavHeadless" . }}
{{- $addrs := list }}
{{- range $i := until (int .Values.code2wav.replicaCount) }}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc.%s:%v" $sts $i $svc $.Release.Namespace $.Values.global.clusterDomain $.Values.code2wav.ports.grpc) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{- define "qwen3-tts.redisSecretName" -}}
{{- if .Values.redis.enabled }}
{{- printf "%s-redis" (include "qwen3-tts.fullname" .) }}
{{- else }}
{{- required "redis.external.existingSecret is required when redis.enabled is false" .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "qwen3-tts.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.snapshot }}
{{- end }}

{{/*
Checks every stage's values once: the grace period covers the drain plus the preStop sleep, GPU
requests equal GPU limits, and code2wav is not autoscaled.
*/}}
{{- define "qwen3-tts.validate" -}}
{{- $drain := int .Values.global.maxStreamSeconds }}
{{- $sleep := int .Values.global.preStopSleepSeconds }}
{{- $checked := list "gateway" "talker" "code2wav" "speakerCache" }}
{{- if .Values.aligner.enabled }}{{- $checked = append $checked "aligner" }}{{- end }}
{{- range $name := $checked }}
{{- $c := index $.Values $name }}
{{- if le (int $c.terminationGracePeriodSeconds) (add $drain $sleep | int) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must exceed global.maxStreamSeconds + global.preStopSleepSeconds (%d)" $name $c.terminationGracePeriodSeconds (add $drain $sleep)) }}
{{- end }}
{{- $req := index ($c.resources.requests | default dict) "nvidia.com/gpu" }}
{{- $lim := index ($c.resources.limits | default dict) "nvidia.com/gpu" }}
{{- if ne (toString $req) (toString $lim) }}
{{- fail (printf "%s.resources: nvidia.com/gpu request (%v) must equal the limit (%v)" $name $req $lim) }}
{{- end }}
{{- end }}
{{- if not (index .Values.talker.resources.limits "nvidia.com/gpu") }}
{{- fail "talker.resources.limits must request nvidia.com/gpu" }}
{{- end }}
{{- if not (index .Values.code2wav.resources.limits "nvidia.com/gpu") }}
{{- fail "code2wav.resources.limits must request nvidia.com/gpu" }}
{{- end }}
{{- if .Values.code2wav.autoscaling.enabled }}
{{- fail "code2wav.autoscaling.enabled must be false: the talker addresses code2wav replicas by the rendered replicaCount" }}
{{- end }}
{{- $gwFrames := int .Values.gateway.settings.maxNewFramesLimit }}
{{- if gt (div (mul $gwFrames 2) 25 | int) $drain }}
{{- fail (printf "global.maxStreamSeconds (%d) is shorter than gateway.settings.maxNewFramesLimit (%d frames = %d s of audio)" $drain $gwFrames (div (mul $gwFrames 2) 25)) }}
{{- end }}
{{- end }}

{{/* Pod annotations: Prometheus scraping plus the stage's own. Call with (dict "root" $ "values" .Values.talker). */}}
{{- define "qwen3-tts.podAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .values.ports.metrics | quote }}
prometheus.io/path: /metrics
{{- with .values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod-level fields every stage shares. Call with (dict "root" $ "values" .Values.talker). */}}
{{- define "qwen3-tts.podCommon" -}}
terminationGracePeriodSeconds: {{ .values.terminationGracePeriodSeconds }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .root.Values.global.podSecurityContext | nindent 2 }}
{{- with .root.Values.global.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range . }}
  - {{- toYaml (omit . "labelSelector") | nindent 4 }}
    {{- /* No selector given: the stage's own pods. */}}
    labelSelector:
      {{- if .labelSelector }}
      {{- toYaml .labelSelector | nindent 6 }}
      {{- else }}
      matchLabels:
        {{- include "qwen3-tts.selectorLabels" $ | nindent 8 }}
      {{- end }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Container fields every stage shares (image, probes, resources, preStop, security). */}}
{{- define "qwen3-tts.containerCommon" -}}
image: {{ include "qwen3-tts.image" . }}
imagePullPolicy: {{ include "qwen3-tts.imagePullPolicy" . }}
securityContext:
  {{- toYaml .root.Values.global.containerSecurityContext | nindent 2 }}
resources:
  {{- toYaml .values.resources | nindent 2 }}
startupProbe:
  {{- include "qwen3-tts.probe" (dict "root" .root "probe" .values.startupProbe) | nindent 2 }}
readinessProbe:
  {{- include "qwen3-tts.probe" (dict "root" .root "probe" .values.readinessProbe) | nindent 2 }}
livenessProbe:
  {{- include "qwen3-tts.probe" (dict "root" .root "probe" .values.livenessProbe) | nindent 2 }}
lifecycle:
  # Give endpoint controllers and clients time to stop sending new streams here; SIGTERM then
  # starts the service's own drain of the streams in flight.
  preStop:
    exec:
      command: ["sleep", "{{ .root.Values.global.preStopSleepSeconds }}"]
{{- end }}

{{/* Environment every stage gets, then the stage's own `env`. */}}
{{- define "qwen3-tts.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: PYTHONUNBUFFERED
  value: "1"
- name: TTS_LOG_FORMAT
  value: {{ .root.Values.global.logFormat | default "text" | quote }}
{{- with .root.Values.global.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- include "qwen3-tts.internalTokenEnv" . }}
{{- with .values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "qwen3-tts.modelVolume" -}}
- name: models
  {{- if and .Values.model.volume.persistentVolumeClaim .Values.model.volume.hostPath }}
  {{- fail "model.volume: give either persistentVolumeClaim or hostPath, not both" }}
  {{- else if .Values.model.volume.persistentVolumeClaim }}
  persistentVolumeClaim:
    claimName: {{ required "model.volume.persistentVolumeClaim.claimName is required" .Values.model.volume.persistentVolumeClaim.claimName }}
    readOnly: true
  {{- else if .Values.model.volume.hostPath }}
  hostPath:
    {{- toYaml .Values.model.volume.hostPath | nindent 4 }}
  {{- else }}
  {{- fail "model.volume needs persistentVolumeClaim or hostPath" }}
  {{- end }}
{{- end }}

{{/* HPA scaling behaviour: scale in slowly, a removed pod drains its streams for up to its grace period. */}}
{{- define "qwen3-tts.scaleBehavior" -}}
behavior:
  scaleDown:
    stabilizationWindowSeconds: 300
    policies:
      - type: Pods
        value: 1
        periodSeconds: 120
{{- end }}

{{/*
PromQL label matchers for one stage's pods: namespace="<ns>",pod=~"<name>-.+". Works with the
chart's ServiceMonitor / PodMonitor and with annotation-based scraping that sets namespace and pod.
Call with (dict "root" $ "component" "talker").
*/}}
{{- define "qwen3-tts.podMatchers" -}}
{{- printf "namespace=\"%s\",pod=~\"%s-.+\"" .root.Release.Namespace (include "qwen3-tts.componentName" .) }}
{{- end }}

{{/*
TLS between the services. Where the Secrets are mounted in every stage's container.
*/}}
{{- define "qwen3-tts.tlsDir" -}}/etc/qwen3-tts/tls{{- end }}
{{- define "qwen3-tts.publicTlsDir" -}}/etc/qwen3-tts/public-tls{{- end }}

{{/*
The --tls-* flags of a stage as a JSON list (empty without tls.enabled). `client`: the stage dials
others (talker, gateway, the probe), so it also checks their certificates for tls.serverName.
Call with (dict "root" $ "client" true).
*/}}
{{- define "qwen3-tts.tlsFlags" -}}
{{- $t := .root.Values.tls }}
{{- $flags := list }}
{{- if $t.enabled }}
{{- $dir := include "qwen3-tts.tlsDir" . }}
{{- $flags = list (printf "--tls-cert=%s/tls.crt" $dir) (printf "--tls-key=%s/tls.key" $dir) (printf "--tls-ca=%s/ca.crt" $dir) }}
{{- if not $t.mtls }}
{{- $flags = append $flags "--tls-client-auth=none" }}
{{- end }}
{{- if .client }}
{{- $flags = append $flags (printf "--tls-server-name=%s" $t.serverName) }}
{{- end }}
{{- end }}
{{- toJson $flags }}
{{- end }}

{{/*
A probe as the values give it, except that with tls.enabled a gRPC probe (the kubelet's own speaks
plaintext only) becomes an exec of `python -m qtts.serving.probe` with the pod's certificate, and with the
gateway's public TLS an httpGet probe uses HTTPS. Call with (dict "root" $ "probe" .values.startupProbe).
*/}}
{{- define "qwen3-tts.probe" -}}
{{- $p := deepCopy .probe }}
{{- if and .root.Values.tls.enabled $p.grpc }}
{{- $g := $p.grpc }}
{{- $_ := unset $p "grpc" }}
{{- $cmd := list "python" "-m" "qtts.serving.probe" (printf "127.0.0.1:%v" $g.port) }}
{{- with $g.service }}
{{- $cmd = append $cmd (printf "--service=%s" .) }}
{{- end }}
{{- $cmd = concat $cmd (include "qwen3-tts.tlsFlags" (dict "root" .root "client" true) | fromJsonArray) }}
{{- $_ := set $p "exec" (dict "command" $cmd) }}
{{- end }}
{{- if and .root.Values.tls.publicSecretName $p.httpGet }}
{{- $_ := set $p "httpGet" (merge (dict "scheme" "HTTPS") $p.httpGet) }}
{{- end }}
{{- toYaml $p }}
{{- end }}

{{/* The volume and the mount of the tls.secretName Secret (include them with tls.enabled). */}}
{{- define "qwen3-tts.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled is true" .Values.tls.secretName }}
    # Readable by the pod's group (fsGroup) only: the private key is in it.
    defaultMode: 0440
{{- end }}

{{- define "qwen3-tts.tlsMount" -}}
- name: tls
  mountPath: {{ include "qwen3-tts.tlsDir" . }}
  readOnly: true
{{- end }}

{{/*
The env var with the shared secret of the services (auth.internalToken), named as the service
reads it (TTS_<SERVICE>_INTERNAL_TOKEN). Call with (dict "root" $ "component" "speaker-cache").
*/}}
{{- define "qwen3-tts.internalTokenEnv" -}}
{{- with include "qwen3-tts.internalTokenRef" .root }}
{{- $ref := splitList "/" . }}
- name: {{ printf "TTS_%s_INTERNAL_TOKEN" ($.component | upper | replace "-" "_") }}
  valueFrom:
    secretKeyRef:
      name: {{ index $ref 0 }}
      key: {{ index $ref 1 }}
{{- end }}
{{- end }}

{{/*
The Secret the chart generates credentials into (auth.*.generate without an existingSecret).
*/}}
{{- define "qwen3-tts.authSecretName" -}}
{{- printf "%s-auth" (include "qwen3-tts.fullname" .) }}
{{- end }}

{{/*
Where the gateway's API keys are, as "secret/key": the existing Secret, else the generated one;
empty when API keys are off (auth.apiKeys.generate false and no existingSecret).
*/}}
{{- define "qwen3-tts.apiKeysRef" -}}
{{- $a := .Values.auth.apiKeys }}
{{- if $a.existingSecret }}
{{- printf "%s/%s" $a.existingSecret $a.secretKey }}
{{- else if $a.generate }}
{{- printf "%s/api-keys" (include "qwen3-tts.authSecretName" .) }}
{{- end }}
{{- end }}

{{/*
Where the services' shared token is, as "secret/key" (as qwen3-tts.apiKeysRef).
*/}}
{{- define "qwen3-tts.internalTokenRef" -}}
{{- $t := .Values.auth.internalToken }}
{{- if $t.existingSecret }}
{{- printf "%s/%s" $t.existingSecret $t.secretKey }}
{{- else if $t.generate }}
{{- printf "%s/internal-token" (include "qwen3-tts.authSecretName" .) }}
{{- end }}
{{- end }}

{{/*
The Secret and key holding the Redis password, as "name/key"; empty when there is none (no
redis.auth, or an external Redis whose credentials are in its URL).
*/}}
{{- define "qwen3-tts.redisPasswordRef" -}}
{{- $a := .Values.redis.auth }}
{{- if $a.enabled }}
{{- if $a.existingSecret }}
{{- printf "%s/%s" $a.existingSecret $a.secretKey }}
{{- else if .Values.redis.enabled }}
{{- printf "%s-redis/redis-password" (include "qwen3-tts.fullname" .) }}
{{- end }}
{{- end }}
{{- end }}
