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
