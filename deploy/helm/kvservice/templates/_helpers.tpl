{{/* Chart name, truncated to a DNS label. */}}
{{- define "kvservice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name. */}}
{{- define "kvservice.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "kvservice.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvservice.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvservice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvservice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvservice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvservice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvservice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvservice.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Name of the peer token Secret ("" when peers use no token). */}}
{{- define "kvservice.peerTokenSecret" -}}
{{- if .Values.security.peerToken.secretName -}}
{{- .Values.security.peerToken.secretName -}}
{{- else if .Values.security.peerToken.create -}}
{{- printf "%s-peer-token" (include "kvservice.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Whether the engine API listens on TCP. */}}
{{- define "kvservice.engineTcp" -}}
{{- if or .Values.security.engineToken.secretName .Values.security.engineTLS.secretName .Values.security.insecure -}}true{{- end -}}
{{- end -}}

{{- define "kvservice.socket" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.uds.dir) .Values.uds.socketName -}}
{{- end -}}

{{/* Pod annotations: scrape hints and the user's. */}}
{{- define "kvservice.podAnnotations" -}}
{{- if .Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.ports.metrics | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The kvservice container; used by both modes. */}}
{{- define "kvservice.container" -}}
{{- $health := list "kvservice" "health" "--address" (printf "unix:%s" (include "kvservice.socket" .)) -}}
- name: kvservice
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["serve"]
  env:
    - {name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
    - {name: NODE_NAME, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
    - {name: KVSERVICE_SERVICE_NAME, value: "$(NODE_NAME)"}
    - {name: KVSERVICE_UDS_PATH, value: {{ include "kvservice.socket" . | quote }}}
    - {name: KVSERVICE_UDS_MODE, value: {{ .Values.uds.mode | quote }}}
    {{- if include "kvservice.engineTcp" . }}
    - {name: KVSERVICE_TCP_ADDRESS, value: "0.0.0.0:{{ .Values.ports.grpc }}"}
    {{- end }}
    - {name: KVSERVICE_PEER_TCP_ADDRESS, value: "0.0.0.0:{{ .Values.ports.peer }}"}
    - {name: KVSERVICE_ADVERTISE_ADDRESS, value: "$(POD_IP):{{ .Values.ports.peer }}"}
    {{- if .Values.security.insecure }}
    - {name: KVSERVICE_INSECURE, value: "true"}
    {{- end }}
    {{- with .Values.security.peerAllowlist }}
    - {name: KVSERVICE_PEER_ALLOWLIST, value: {{ . | quote }}}
    {{- end }}
    {{- if include "kvservice.peerTokenSecret" . }}
    - {name: KVSERVICE_PEER_TOKEN_FILE, value: /var/run/kvservice-secrets/peer-token/peer-token}
    {{- end }}
    {{- if .Values.security.peerTLS.secretName }}
    - {name: KVSERVICE_PEER_TLS_CERT, value: /var/run/kvservice-secrets/peer-tls/tls.crt}
    - {name: KVSERVICE_PEER_TLS_KEY, value: /var/run/kvservice-secrets/peer-tls/tls.key}
    - {name: KVSERVICE_PEER_TLS_CA, value: /var/run/kvservice-secrets/peer-tls/ca.crt}
    {{- end }}
    {{- if .Values.security.engineToken.secretName }}
    - {name: KVSERVICE_TOKEN_FILE, value: /var/run/kvservice-secrets/engine-token/token}
    {{- end }}
    {{- if .Values.security.engineTLS.secretName }}
    - {name: KVSERVICE_TLS_CERT, value: /var/run/kvservice-secrets/engine-tls/tls.crt}
    - {name: KVSERVICE_TLS_KEY, value: /var/run/kvservice-secrets/engine-tls/tls.key}
    - {name: KVSERVICE_TLS_CLIENT_CA, value: /var/run/kvservice-secrets/engine-tls/ca.crt}
    {{- end }}
    - {name: KVSERVICE_METRICS_PORT, value: {{ .Values.ports.metrics | quote }}}
    - {name: KVSERVICE_HOST_STAGING_MB, value: {{ .Values.staging.hostMb | quote }}}
    - {name: KVSERVICE_VRAM_STAGING_MB, value: {{ .Values.staging.vramMb | quote }}}
    - {name: KVSERVICE_TRANSPORT, value: {{ .Values.config.transport | quote }}}
    - {name: KVSERVICE_WORKERS_PER_PEER, value: {{ .Values.config.workersPerPeer | quote }}}
    - {name: KVSERVICE_GRACE_PERIOD_S, value: {{ .Values.config.gracePeriodS | quote }}}
    - {name: KVSERVICE_DEFAULT_DEADLINE_MS, value: {{ .Values.config.defaultDeadlineMs | quote }}}
    - {name: KVSERVICE_LOG_LEVEL, value: {{ .Values.config.logLevel | quote }}}
    - {name: KVSERVICE_LOG_FORMAT, value: {{ .Values.config.logFormat | quote }}}
    - {name: KVSERVICE_CACHE_DIR, value: /tmp/kvservice-cache}
    {{- if .Values.gpu.visibleDevices }}
    - {name: NVIDIA_VISIBLE_DEVICES, value: {{ .Values.gpu.visibleDevices | quote }}}
    {{- end }}
    {{- with .Values.config.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    {{- if include "kvservice.engineTcp" . }}
    - {name: grpc, containerPort: {{ .Values.ports.grpc }}}
    {{- end }}
    - {name: peer, containerPort: {{ .Values.ports.peer }}}
    - {name: metrics, containerPort: {{ .Values.ports.metrics }}}
  startupProbe:
    exec: {command: {{ toJson $health }}}
    {{- toYaml .Values.probes.startup | nindent 4 }}
  readinessProbe:
    exec: {command: {{ toJson $health }}}
    {{- toYaml .Values.probes.readiness | nindent 4 }}
  livenessProbe:
    exec: {command: {{ toJson $health }}}
    {{- toYaml .Values.probes.liveness | nindent 4 }}
  resources:
    {{- $res := deepCopy .Values.resources }}
    {{- if and .Values.gpu.resourceName (gt (int .Values.gpu.count) 0) }}
    {{- $_ := set $res "limits" (merge (dict .Values.gpu.resourceName .Values.gpu.count) (default dict $res.limits)) }}
    {{- end }}
    {{- toYaml $res | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: socket-dir, mountPath: {{ .Values.uds.dir | quote }}}
    - {name: tmp, mountPath: /tmp}
    {{- if or (eq .Values.mode "sidecar") .Values.mountHostShm }}
    - {name: dshm, mountPath: /dev/shm}
    {{- end }}
    {{- range $name := list "peer-token" "peer-tls" "engine-token" "engine-tls" }}
    {{- if include "kvservice.secretOf" (list $ $name) }}
    - {name: {{ $name }}, mountPath: /var/run/kvservice-secrets/{{ $name }}, readOnly: true}
    {{- end }}
    {{- end }}
{{- end -}}

{{/* The Secret behind one of the mounted credentials ("" when not configured). */}}
{{- define "kvservice.secretOf" -}}
{{- $ := index . 0 -}}
{{- $name := index . 1 -}}
{{- if eq $name "peer-token" -}}{{ include "kvservice.peerTokenSecret" $ }}
{{- else if eq $name "peer-tls" -}}{{ $.Values.security.peerTLS.secretName }}
{{- else if eq $name "engine-token" -}}{{ $.Values.security.engineToken.secretName }}
{{- else if eq $name "engine-tls" -}}{{ $.Values.security.engineTLS.secretName }}
{{- end -}}
{{- end -}}

{{/* Secret volumes of the credentials in use. */}}
{{- define "kvservice.secretVolumes" -}}
{{- range $name := list "peer-token" "peer-tls" "engine-token" "engine-tls" }}
{{- with include "kvservice.secretOf" (list $ $name) }}
- name: {{ $name }}
  secret: {secretName: {{ . }}, defaultMode: 0440}
{{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by both modes. */}}
{{- define "kvservice.podCommon" -}}
serviceAccountName: {{ include "kvservice.serviceAccountName" . }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.gpu.runtimeClassName }}
runtimeClassName: {{ .Values.gpu.runtimeClassName }}
{{- end }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
