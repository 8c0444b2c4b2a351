{{/* One serving Deployment, for one track (docs/fleet.md, "Canary upgrades"). Called with a dict:
     .Values the values this track serves (the canary's: repository.* with canary.repository over it),
     .Release/.Chart/.Template/.Files/.Capabilities the release's, .root the release's own context, and
     .track "stable" or "canary". Both tracks get the same pod: the same fetch/pull, the same verify init
     container with the same trust policy, the same server, probes and security context. */}}
{{- define "mf.deployment" -}}
{{- $fullname := include "mf.fullname" . -}}
{{- $canary := eq .track "canary" -}}
{{- $subPath := include "mf.repositorySubPath" . -}}
{{- $source := .Values.repository.source -}}
{{- /* Where verify and serve find the repository in the models volume: the PVC/image layout folder, or
       (oci) the folder `model-factory pull` writes; s3 mirrors into the volume's root. */ -}}
{{- $mountSubPath := ternary "repository" (ternary "" $subPath (eq $source "s3")) (eq $source "oci") -}}
{{- /* With the OpenAI API on, the probes that gate traffic ask its /health (200 only while Triton is ready). */ -}}
{{- $gate := ternary (dict "path" "/health" "port" "openai") (dict "path" "/v2/health/ready" "port" "http") .Values.openai.enabled -}}
{{- if and .Values.openai.enabled (has (int .Values.openai.port) (list (int .Values.ports.http) (int .Values.ports.grpc) (int .Values.ports.metrics))) -}}
{{- fail (printf "openai.port %d is already one of ports (http, grpc, metrics): give the OpenAI API a port of its own" (int .Values.openai.port)) -}}
{{- end -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ ternary (include "mf.canaryName" .) $fullname $canary }}
  labels:
    {{- include "mf.labels" . | nindent 4 }}
    app.kubernetes.io/component: server
    {{ include "mf.trackLabel" . }}: {{ .track }}
spec:
  {{- if $canary }}
  # The canary's fixed size: the HPA / ScaledObject scale the stable track only.
  replicas: {{ .Values.canary.replicas }}
  {{- else if eq .Values.autoscaling.mode "none" }}
  replicas: {{ .Values.replicaCount }}
  {{- end }}
  selector:
    {{- include (ternary "mf.canarySelector" "mf.stableSelector" $canary) . | nindent 4 }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 0
      maxSurge: 1
  template:
    metadata:
      labels:
        {{- include "mf.selectorLabels" . | nindent 8 }}
        {{ include "mf.trackLabel" . }}: {{ .track }}
        {{- with .Values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        # A new policy, new trust files or a new admin key roll the pods (each re-verifies).
        checksum/trust: {{ include (print .root.Template.BasePath "/trust.yaml") .root | sha256sum }}
        {{- with .Values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      securityContext:
        {{- include "mf.podSecurityContext" . | nindent 8 }}
      {{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if or (gt (int .Values.gpu.count) 0) .Values.nodeSelector }}
      nodeSelector:
        {{- if gt (int .Values.gpu.count) 0 }}
        nvidia.com/gpu.product: {{ .Values.gpu.product | quote }}
        {{- end }}
        {{- with .Values.nodeSelector }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      {{- with .Values.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      topologySpreadConstraints:
        - maxSkew: {{ .Values.topologySpread.maxSkew }}
          topologyKey: {{ .Values.topologySpread.topologyKey }}
          whenUnsatisfiable: {{ .Values.topologySpread.whenUnsatisfiable }}
          labelSelector:
            {{- include (ternary "mf.canarySelector" "mf.stableSelector" $canary) . | nindent 12 }}
      # Triton's exit timeout plus the stub's shutdown.
      terminationGracePeriodSeconds: 60
      initContainers:
        {{- if eq $source "s3" }}
        {{- $url := urlParse .Values.repository.s3.endpoint }}
        # Copy the repository from the store inside the network; the next container verifies it.
        - name: fetch
          image: {{ include "mf.image" .Values.images.fetcher }}
          imagePullPolicy: {{ .Values.images.fetcher.pullPolicy }}
          command:
            - mc
            - mirror
            - --overwrite
            - --remove
            - {{ printf "src/%s/%s" .Values.repository.s3.bucket (default $subPath .Values.repository.s3.prefix) | trimSuffix "/" }}
            - /models
          env:
            - name: S3_ACCESS_KEY
              valueFrom:
                secretKeyRef:
                  name: {{ .Values.repository.s3.credentialsSecret }}
                  key: accessKey
            - name: S3_SECRET_KEY
              valueFrom:
                secretKeyRef:
                  name: {{ .Values.repository.s3.credentialsSecret }}
                  key: secretKey
            - name: MC_HOST_src
              value: {{ printf "%s://$(S3_ACCESS_KEY):$(S3_SECRET_KEY)@%s" $url.scheme $url.host | quote }}
            - name: MC_CONFIG_DIR
              value: /tmp/.mc
          securityContext:
            {{- include "mf.securityContext" . | nindent 12 }}
          volumeMounts:
            - name: models
              mountPath: /models
            - name: tmp
              mountPath: /tmp
        {{- end }}
        {{- if eq $source "oci" }}
        {{- range $i, $ref := .Values.repository.oci.references }}
        # Pull one model from the registry inside the network: nothing lands in the volume unless its
        # signature (a referrer of the manifest) is trusted by the policy and covers every file.
        - name: {{ printf "pull-%d" $i }}
          image: {{ include "mf.image" $.Values.images.server }}
          imagePullPolicy: {{ $.Values.images.server.pullPolicy }}
          command:
            - model-factory
            - pull
            - {{ $ref | quote }}
            - /work/repository
            - --policy
            - {{ include "mf.policyPath" $ }}
            {{- if $.Values.repository.oci.caSecret }}
            - --ca-file
            - /etc/model-factory/registry-ca/ca.pem
            {{- end }}
            {{- if $.Values.repository.oci.credentialsSecret }}
            - --registry-config
            - /etc/model-factory/registry-auth/config.json
            {{- end }}
          env:
            {{- include "mf.offlineEnv" $ | nindent 12 }}
          securityContext:
            {{- include "mf.securityContext" $ | nindent 12 }}
          volumeMounts:
            - name: models
              mountPath: /work
            - name: trust
              mountPath: /etc/model-factory/trust
              readOnly: true
            {{- /* pull checks the attached release against this pod's release state, then writes it to .release/ */}}
            {{- include "mf.releaseStateMount" $ | nindent 12 }}
            {{- if $.Values.repository.oci.caSecret }}
            - name: registry-ca
              mountPath: /etc/model-factory/registry-ca
              readOnly: true
            {{- end }}
            {{- if $.Values.repository.oci.credentialsSecret }}
            - name: registry-auth
              mountPath: /etc/model-factory/registry-auth
              readOnly: true
            {{- end }}
            - name: tmp
              mountPath: /tmp
        {{- end }}
        {{- end }}
        # Fail closed before the server starts: every version must verify against the policy.
        - name: verify
          image: {{ include "mf.image" .Values.images.server }}
          imagePullPolicy: {{ .Values.images.server.pullPolicy }}
          command:
            {{- include "mf.verifyCommand" . | nindent 12 }}
          env:
            {{- include "mf.offlineEnv" . | nindent 12 }}
          securityContext:
            {{- include "mf.securityContext" . | nindent 12 }}
          volumeMounts:
            - name: models
              mountPath: /models
              readOnly: true
              {{- if $mountSubPath }}
              subPath: {{ $mountSubPath }}
              {{- end }}
            - name: trust
              mountPath: /etc/model-factory/trust
              readOnly: true
            {{- include "mf.releaseStateMount" . | nindent 12 }}
            - name: tmp
              mountPath: /tmp
      containers:
        - name: server
          image: {{ include "mf.image" .Values.images.server }}
          imagePullPolicy: {{ .Values.images.server.pullPolicy }}
          command:
            - model-factory
            - serve
            - --host
            - 0.0.0.0
            - --policy
            - {{ include "mf.policyPath" . }}
            - --http-port
            - {{ .Values.ports.http | quote }}
            - --grpc-port
            - {{ .Values.ports.grpc | quote }}
            - --metrics-port
            - {{ .Values.ports.metrics | quote }}
            - --log-verbose
            - {{ .Values.serve.logVerbose | quote }}
            {{- if gt (int .Values.gpu.count) 0 }}
            - --gpu-product
            - {{ .Values.gpu.product | quote }}
            {{- end }}
            {{- if .Values.serve.accept }}
            - --accept
            {{- end }}
            {{- if .Values.serve.adminKey.enabled }}
            - --admin-key-file
            - /etc/model-factory/admin/admin-key
            {{- end }}
            {{- if .Values.openai.enabled }}
            - --openai-port
            - {{ .Values.openai.port | quote }}
            {{- end }}
            {{- range .Values.serve.extraArgs }}
            - {{ . | quote }}
            {{- end }}
            - /models
          env:
            {{- include "mf.offlineEnv" . | nindent 12 }}
            {{- with .Values.serve.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ .Values.ports.http }}
              protocol: TCP
            - name: grpc
              containerPort: {{ .Values.ports.grpc }}
              protocol: TCP
            - name: metrics
              containerPort: {{ .Values.ports.metrics }}
              protocol: TCP
            {{- if .Values.openai.enabled }}
            - name: openai
              containerPort: {{ .Values.openai.port }}
              protocol: TCP
            {{- end }}
          startupProbe:
            httpGet:
              {{- toYaml $gate | nindent 14 }}
            periodSeconds: {{ .Values.probes.startup.periodSeconds }}
            failureThreshold: {{ .Values.probes.startup.failureThreshold }}
          readinessProbe:
            httpGet:
              {{- toYaml $gate | nindent 14 }}
            periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
            failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
          livenessProbe:
            httpGet:
              path: /v2/health/live
              port: http
            periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
            failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
          resources:
            {{- $res := deepCopy .Values.serve.resources }}
            {{- if gt (int .Values.gpu.count) 0 }}
            {{- $limits := default dict $res.limits }}
            {{- $_ := set $limits "nvidia.com/gpu" (int .Values.gpu.count) }}
            {{- $_ := set $res "limits" $limits }}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          securityContext:
            {{- include "mf.securityContext" . | nindent 12 }}
          volumeMounts:
            - name: models
              mountPath: /models
              readOnly: true
              {{- if $mountSubPath }}
              subPath: {{ $mountSubPath }}
              {{- end }}
            - name: trust
              mountPath: /etc/model-factory/trust
              readOnly: true
            {{- if .Values.serve.adminKey.enabled }}
            - name: admin-key
              mountPath: /etc/model-factory/admin
              readOnly: true
            {{- end }}
            {{- include "mf.releaseStateMount" . | nindent 12 }}
            - name: tmp
              mountPath: /tmp
            - name: shm
              mountPath: /dev/shm
      volumes:
        {{- if eq $source "pvc" }}
        - name: models
          persistentVolumeClaim:
            claimName: {{ default (printf "%s-repository" $fullname) .Values.repository.pvc.existingClaim }}
            readOnly: true
        {{- else if eq $source "image" }}
        - name: models
          image:
            reference: {{ .Values.repository.image.reference }}
            pullPolicy: {{ .Values.repository.image.pullPolicy }}
        {{- else if eq $source "oci" }}
        - name: models
          emptyDir:
            sizeLimit: {{ .Values.repository.oci.sizeLimit }}
        {{- if .Values.repository.oci.caSecret }}
        - name: registry-ca
          secret:
            secretName: {{ .Values.repository.oci.caSecret }}
            defaultMode: 0440
            items:
              - key: ca.pem
                path: ca.pem
        {{- end }}
        {{- if .Values.repository.oci.credentialsSecret }}
        - name: registry-auth
          secret:
            secretName: {{ .Values.repository.oci.credentialsSecret }}
            defaultMode: 0440
            items:
              - key: .dockerconfigjson
                path: config.json
        {{- end }}
        {{- else }}
        - name: models
          emptyDir:
            sizeLimit: {{ .Values.repository.s3.sizeLimit }}
        {{- end }}
        - name: trust
          projected:
            defaultMode: 0440
            sources:
              - configMap:
                  name: {{ include "mf.policyConfigMap" . }}
                  items:
                    - key: policy.toml
                      path: policy.toml
                    {{- if .Values.release.enabled }}
                    - key: release-root.json
                      path: release-root.json
                    {{- end }}
              {{- if or .Values.trust.files .Values.trust.existingSecret }}
              - secret:
                  name: {{ include "mf.trustSecret" . }}
              {{- end }}
        {{- if .Values.serve.adminKey.enabled }}
        - name: admin-key
          secret:
            secretName: {{ include "mf.adminSecret" . }}
            defaultMode: 0440
            items:
              - key: admin-key
                path: admin-key
        {{- end }}
        {{- if .Values.release.enabled }}
        # What this pod trusts (docs/releases.md): emptyDir lives as long as the pod, a shared claim longer.
        # The canary's is always an emptyDir: its newer release written to the shared claim would make every
        # stable pod that starts afterwards refuse the stable release as a rollback.
        - name: release-state
          {{- if and (not $canary) (eq .Values.release.state.type "persistentVolumeClaim") }}
          persistentVolumeClaim:
            claimName: {{ .Values.release.state.existingClaim }}
          {{- else }}
          emptyDir: {}
          {{- end }}
        {{- end }}
        - name: tmp
          emptyDir: {}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ .Values.serve.shmSize }}
{{- end -}}
