{{- define "ringserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ringserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ringserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "ringserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* selectorLabels: call with (dict "ctx" $ "component" "gateway") */}}
{{- define "ringserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ringserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ringserve.image" -}}
{{- printf "%s/ringserve-%s:%s" .ctx.Values.image.registry .service (default .ctx.Chart.AppVersion .ctx.Values.image.tag) -}}
{{- end -}}

{{- define "ringserve.gateway" -}}{{ include "ringserve.fullname" . }}-gateway{{- end -}}
{{- define "ringserve.tokenizer" -}}{{ include "ringserve.fullname" . }}-tokenizer{{- end -}}
{{- define "ringserve.replica" -}}{{ include "ringserve.fullname" . }}-replica{{- end -}}
{{- define "ringserve.grpcApi" -}}{{ include "ringserve.fullname" . }}-grpc-api{{- end -}}
{{- define "ringserve.config" -}}{{ include "ringserve.fullname" . }}-config{{- end -}}

{{- define "ringserve.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "ringserve.fullname" .)) .Values.apiKey.existingSecret -}}
{{- end -}}
{{- define "ringserve.tlsSecret" -}}
{{- default (printf "%s-tls" (include "ringserve.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}

{{/* gRPC mutual TLS (grpcTls.*): every service's flags, the Secret's volume and its mount. */}}
{{- define "ringserve.grpcTlsDir" -}}/etc/ringserve/grpc-tls{{- end -}}
{{- define "ringserve.grpcTlsArgs" -}}
{{- if .Values.grpcTls.enabled }}
- --tls-cert-file={{ include "ringserve.grpcTlsDir" . }}/tls.crt
- --tls-key-file={{ include "ringserve.grpcTlsDir" . }}/tls.key
- --tls-ca-file={{ include "ringserve.grpcTlsDir" . }}/ca.crt
{{- end }}
{{- end -}}
{{- define "ringserve.grpcTlsMount" -}}
{{- if .Values.grpcTls.enabled }}
- name: grpc-tls
  mountPath: {{ include "ringserve.grpcTlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}
{{- define "ringserve.grpcTlsVolume" -}}
{{- if .Values.grpcTls.enabled }}
- name: grpc-tls
  secret:
    secretName: {{ required "grpcTls.existingSecret is required when grpcTls.enabled" .Values.grpcTls.existingSecret }}
{{- end }}
{{- end -}}

{{/* The probe action on a service's gRPC health: Kubernetes' gRPC probe, or under grpcTls
(which that probe cannot speak) `ringserve health` with the TLS flags. Takes (dict "ctx" $ "port" N). */}}
{{- define "ringserve.grpcProbe" -}}
{{- if .ctx.Values.grpcTls.enabled }}
exec:
  command:
    - ringserve
    - health
    - localhost:{{ .port }}
    {{- include "ringserve.grpcTlsArgs" .ctx | nindent 4 }}
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end -}}

{{/* Address of the tokenizer Service (headless: gRPC's DNS resolver sees every pod). */}}
{{- define "ringserve.tokenizerAddr" -}}
{{- printf "dns:///%s.%s.svc.cluster.local:%v" (include "ringserve.tokenizer" .) .Release.Namespace .Values.ports.tokenizer -}}
{{- end -}}

{{/* Stable DNS name of model replica pod .index behind the replica headless Service:
     call with (dict "ctx" $ "index" i). */}}
{{- define "ringserve.replicaHost" -}}
{{- printf "%s-%v.%s.%s.svc.cluster.local" (include "ringserve.replica" .ctx) .index (include "ringserve.replica" .ctx) .ctx.Release.Namespace -}}
{{- end -}}

{{- define "ringserve.modelDir" -}}/models/{{ .Values.model.name }}{{- end -}}

{{/* The model volume (and an init container for source=initContainer). */}}
{{- define "ringserve.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.initContainer.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "ringserve.modelMount" -}}
- name: model
  mountPath: /models
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end -}}

{{- define "ringserve.modelInit" -}}
{{- if eq .Values.model.source "initContainer" }}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.initContainer.image }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: {{ toJson .Values.model.initContainer.command }}
    env:
      - name: MODEL_NAME
        value: {{ .Values.model.name | quote }}
    securityContext:
      {{- toYaml .Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: /models
{{- end }}
{{- end -}}

{{- define "ringserve.podCommon" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}
