{{/* Names and labels. */}}
{{- define "mf.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mf.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "mf.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mf.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end -}}

{{/* The serving tracks (docs/fleet.md, "Canary upgrades"): every serving pod carries
     model-factory.io/track (stable or canary). The pool (the Service in canary.traffic.split=replicas, the
     NetworkPolicy, the monitors) selects both with mf.selectorLabels; each Deployment, its PDB and its
     autoscaler select one track. The stable track's selector excludes canary pods rather than naming its
     own track, so it also selects the pods of a ReplicaSet made before the track label existed (the
     migration in docs/fleet.md adopts them). */}}
{{- define "mf.trackLabel" -}}model-factory.io/track{{- end -}}

{{- define "mf.stableSelector" -}}
matchLabels:
  {{- include "mf.selectorLabels" . | nindent 2 }}
matchExpressions:
  - key: {{ include "mf.trackLabel" . }}
    operator: NotIn
    values:
      - canary
{{- end -}}

{{- define "mf.canarySelector" -}}
matchLabels:
  {{- include "mf.selectorLabels" . | nindent 2 }}
  {{ include "mf.trackLabel" . }}: canary
{{- end -}}

{{/* The canary track's name (Deployment, Service, PDB): <fullname>-canary, within 63 characters. */}}
{{- define "mf.canaryName" -}}
{{- printf "%s-canary" (include "mf.fullname" . | trunc 56 | trimSuffix "-") -}}
{{- end -}}

{{/* Whether the Gateway API routes split the traffic (canary on, canary.traffic.split=gateway): "true" or "". */}}
{{- define "mf.gatewaySplit" -}}
{{- if and .Values.canary.enabled (eq .Values.canary.traffic.split "gateway") -}}true{{- end -}}
{{- end -}}

{{- define "mf.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "mf.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* An image by digest: repository@sha256:... */}}
{{- define "mf.image" -}}
{{- printf "%s@%s" .repository .digest -}}
{{- end -}}

{{/* Folder of the repository volume served by this release. */}}
{{- define "mf.repositorySubPath" -}}
{{- if .Values.repository.subPath -}}
{{- .Values.repository.subPath -}}
{{- else if gt (int .Values.gpu.count) 0 -}}
{{- printf "%s/trt-%s" .Values.gpu.product .Values.tensorrtVersion -}}
{{- end -}}
{{- end -}}

{{- define "mf.policyConfigMap" -}}
{{- default (printf "%s-trust-policy" (include "mf.fullname" .)) .Values.trust.existingConfigMap -}}
{{- end -}}

{{- define "mf.trustSecret" -}}
{{- default (printf "%s-trust" (include "mf.fullname" .)) .Values.trust.existingSecret -}}
{{- end -}}

{{- define "mf.adminSecret" -}}
{{- default (printf "%s-admin-key" (include "mf.fullname" .)) .Values.serve.adminKey.existingSecret -}}
{{- end -}}

{{/* Where the policy and its trust files are mounted (one projected volume). */}}
{{- define "mf.policyPath" -}}/etc/model-factory/trust/policy.toml{{- end -}}

{{/* Where the release state volume is mounted (the policy's [release] state_dir). */}}
{{- define "mf.releaseStateDir" -}}/var/lib/model-factory/release{{- end -}}

{{/* The release state mount, for the verify init container and the server. */}}
{{- define "mf.releaseStateMount" -}}
{{- if .Values.release.enabled }}
- name: release-state
  mountPath: {{ include "mf.releaseStateDir" . }}
{{- end }}
{{- end -}}

{{/* The exact verify command of the init container (tests run it from the rendered manifest). */}}
{{- define "mf.verifyCommand" -}}
- model-factory
- verify
- --policy
- {{ include "mf.policyPath" . }}
- --json
- /models
{{- end -}}

{{/* The adapter rules' PromQL: Triton's queue time per second over `denominator` per second, per pod
     (nv_inference_compute_infer_duration_us: the queue-to-compute ratio; nv_inference_request_success:
     the mean queue time per request, in microseconds). */}}
{{- define "mf.ratioQuery" -}}
{{- $w := .window -}}
{{- $m := .matchers -}}
{{- $g := .groupBy -}}
{{- $d := default "nv_inference_compute_infer_duration_us" .denominator -}}
sum(rate(nv_inference_queue_duration_us{ {{- $m -}} }[{{ $w }}])) by ({{ $g }}) / clamp_min(sum(rate({{ $d }}{ {{- $m -}} }[{{ $w }}])) by ({{ $g }}), 1)
{{- end -}}

{{- define "mf.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "mf.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Environment every model-factory container gets: no network lookups, nothing written to the image. */}}
{{- define "mf.offlineEnv" -}}
- name: HOME
  value: /tmp
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
{{- end -}}

{{/* The Service ports (the release's Service and the canary's). .h2c: the gRPC port says it speaks HTTP/2
     cleartext (appProtocol kubernetes.io/h2c), for the gateway behind a GRPCRoute. */}}
{{- define "mf.servicePorts" -}}
- name: http
  port: {{ .Values.ports.http }}
  targetPort: http
  protocol: TCP
- name: grpc
  port: {{ .Values.ports.grpc }}
  targetPort: grpc
  protocol: TCP
  {{- if .h2c }}
  appProtocol: kubernetes.io/h2c
  {{- end }}
- name: metrics
  port: {{ .Values.ports.metrics }}
  targetPort: metrics
  protocol: TCP
{{- if .Values.openai.enabled }}
- name: openai
  port: {{ .Values.openai.port }}
  targetPort: openai
  protocol: TCP
{{- end }}
{{- end -}}

{{/* The Gateway API Inference Extension (docs/fleet.md, "LLM fleets behind an InferencePool"): the pool's name
     (the release's), its endpoint picker's (<fullname>-epp) and the picker's pod labels. */}}
{{- define "mf.eppName" -}}
{{- printf "%s-epp" (include "mf.fullname" . | trunc 59 | trimSuffix "-") -}}
{{- end -}}

{{- define "mf.eppSelectorLabels" -}}
app.kubernetes.io/name: {{ include "mf.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end -}}

{{/* Checks of inferencePool.* the schema cannot make (they depend on other values). */}}
{{- define "mf.inferencePoolChecks" -}}
{{- $pool := .Values.inferencePool -}}
{{- if not .Values.openai.enabled -}}
{{- fail "inferencePool.enabled needs openai.enabled: the pool's target port is the OpenAI API's (its /v1 routes and /metrics)" -}}
{{- end -}}
{{- if include "mf.gatewaySplit" . -}}
{{- fail "inferencePool.enabled with canary.traffic.split=gateway: two routes would claim /v1. Use canary.traffic.split=replicas (the pool then selects both tracks and the picker balances them)" -}}
{{- end -}}
{{- if not $pool.httpRoute.parentRefs -}}
{{- fail "inferencePool.httpRoute.parentRefs is empty: name the Gateway listener the HTTPRoute to the pool attaches to" -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $pool.objectives -}}
{{- if hasKey $seen .name -}}
{{- fail (printf "inferencePool.objectives: %q is listed twice" .name) -}}
{{- end -}}
{{- $_ := set $seen .name true -}}
{{- end -}}
{{- end -}}
