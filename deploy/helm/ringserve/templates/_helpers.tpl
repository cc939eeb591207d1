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

{{/* selectorLabels: call with (dict "ctx" $ "component" "gateway"). Under
inferencePool.enabled every replica pod runs a whole ring, so the gateway's and the
tokenizer's Services, NetworkPolicies and PodDisruptionBudgets select the replica pods. */}}
{{- define "ringserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ringserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ include "ringserve.podsOf" . }}
{{- with include "ringserve.disaggregationMode" .ctx }}
ringserve.io/disaggregation-mode: {{ . }}
{{- end }}
{{- end -}}

{{/* The component whose pods run .component's container: (dict "ctx" $ "component" c). */}}
{{- define "ringserve.podsOf" -}}
{{- if and .ctx.Values.inferencePool.enabled (has .component (list "gateway" "tokenizer")) -}}
replica
{{- else -}}
{{ .component }}
{{- end -}}
{{- end -}}

{{/* A service's image, repository:tag: call with (dict "ctx" $ "service" "gateway"). The
repository defaults to <image.registry>/ringserve-<service>, as `make images` tags it; the
scheduler's default tag carries its variant: <tag>-cpu or <tag>-cuda. */}}
{{- define "ringserve.image" -}}
{{- $img := index .ctx.Values.image .service -}}
{{- $tag := default .ctx.Chart.AppVersion .ctx.Values.image.tag -}}
{{- if eq .service "scheduler" -}}
{{- $tag = printf "%s-%s" $tag (include "ringserve.schedulerVariant" .ctx) -}}
{{- end -}}
{{- $repository := default (printf "%s/ringserve-%s" .ctx.Values.image.registry .service) $img.repository -}}
{{- printf "%s:%s" $repository (default $tag $img.tag) -}}
{{- end -}}

{{- define "ringserve.schedulerVariant" -}}
{{- default (ternary "cuda" "cpu" .Values.replica.gpu.enabled) .Values.image.scheduler.variant -}}
{{- end -}}

{{- define "ringserve.gateway" -}}{{ include "ringserve.fullname" . }}-gateway{{- end -}}
{{- define "ringserve.tokenizer" -}}{{ include "ringserve.fullname" . }}-tokenizer{{- end -}}
{{/* A model replica set's name: <fullname>-replica, or in a set's context (ringserve.setContext)
<fullname>-prefill / -decode. */}}
{{- define "ringserve.replica" -}}{{ include "ringserve.fullname" . }}-{{ default "replica" .Values.replica.set }}{{- end -}}

{{/* The model replica sets: one, "replica", or under disaggregation.enabled a "prefill" and a
"decode" set (docs/disaggregation.md), as a JSON list. */}}
{{- define "ringserve.replicaSets" -}}
{{- if .Values.disaggregation.enabled }}["prefill", "decode"]{{ else }}["replica"]{{ end -}}
{{- end -}}

{{/* Fills .out with the root context of one replica set: (dict "ctx" $ "set" name "out" (dict)).
Its .Values.replica is replica.* overridden by disaggregation.<set>.* (mergeOverwrite: an empty
value there, {} [] "" 0, leaves replica's), plus "set", the set's name; everything else is $'s. */}}
{{- define "ringserve.setContext" -}}
{{- $r := deepCopy .ctx.Values.replica -}}
{{- if ne .set "replica" -}}
{{- $r = mergeOverwrite $r (deepCopy (index .ctx.Values.disaggregation .set)) -}}
{{- end -}}
{{- $_ := set $r "set" .set -}}
{{- $_ := set .out "Values" (merge (dict "replica" $r) .ctx.Values) -}}
{{- $_ := merge .out .ctx -}}
{{- end -}}

{{/* A set context's --disaggregation-mode: prefill or decode; "" for the replica set and the root. */}}
{{- define "ringserve.disaggregationMode" -}}
{{- with .Values.replica.set }}{{ if ne . "replica" }}{{ . }}{{ end }}{{ end -}}
{{- end -}}
{{- define "ringserve.grpcApi" -}}{{ include "ringserve.fullname" . }}-grpc-api{{- end -}}
{{- define "ringserve.config" -}}{{ include "ringserve.fullname" . }}-config{{- end -}}

{{- define "ringserve.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "ringserve.fullname" .)) .Values.apiKey.existingSecret -}}
{{- end -}}
{{- define "ringserve.internalAuthSecret" -}}
{{- default (printf "%s-internal-token" (include "ringserve.fullname" .)) .Values.internalAuth.existingSecret -}}
{{- end -}}
{{/* The internal credential of a tokenizer, scheduler or detokenizer container: its env entry
(read by the service itself, never on its command line), or, when disabled, the opt-out flag. */}}
{{- define "ringserve.internalAuthEnv" -}}
{{- if .Values.internalAuth.enabled }}
- name: RINGSERVE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "ringserve.internalAuthSecret" . }}
      key: {{ .Values.internalAuth.secretKey }}
{{- end }}
{{- end -}}
{{- define "ringserve.internalAuthArgs" -}}
{{- if not .Values.internalAuth.enabled }}
- --insecure-skip-internal-auth
{{- end }}
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
{{- define "ringserve.observabilityArgs" -}}
{{- if .Values.config.logRequests }}
- --log-requests
{{- end }}
{{- with .Values.config.tracing.otlpTracesEndpoint }}
- --otlp-traces-endpoint={{ . }}
{{- end }}
{{- with .Values.config.tracing.sampleRatio }}
- --otlp-traces-sample-ratio={{ . }}
{{- end }}
{{- end -}}
{{- define "ringserve.grpcTlsMount" -}}
{{- if .Values.grpcTls.enabled }}
- name: grpc-tls
  mountPath: {{ include "ringserve.grpcTlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}
{{/* The chat template (config.tokenizer.chatTemplate or .chatTemplateConfigMap), mounted in
the tokenizer containers: the volume, its mount and the flag. */}}
{{- define "ringserve.chatTemplateDir" -}}/etc/ringserve/chat-template{{- end -}}
{{- define "ringserve.chatTemplateConfigMap" -}}
{{- with .Values.config.tokenizer -}}
{{- if .chatTemplate -}}
{{ include "ringserve.fullname" $ }}-chat-template
{{- else -}}
{{ .chatTemplateConfigMap.name }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- define "ringserve.chatTemplateVolume" -}}
{{- with include "ringserve.chatTemplateConfigMap" . }}
- name: chat-template
  configMap:
    name: {{ . }}
{{- end }}
{{- end -}}
{{- define "ringserve.chatTemplateMount" -}}
{{- if include "ringserve.chatTemplateConfigMap" . }}
- name: chat-template
  mountPath: {{ include "ringserve.chatTemplateDir" . }}
  readOnly: true
{{- end }}
{{- end -}}
{{- define "ringserve.chatTemplateArgs" -}}
{{- if include "ringserve.chatTemplateConfigMap" . }}
- --chat-template={{ include "ringserve.chatTemplateDir" . }}/{{ .Values.config.tokenizer.chatTemplateConfigMap.key }}
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
(which that probe cannot speak) `ringserve health` with the TLS flags. Takes (dict "ctx" $ "port" N),
and "service" "liveness" for the health service that stays SERVING while the process lives. */}}
{{- define "ringserve.grpcProbe" -}}
{{- if .ctx.Values.grpcTls.enabled }}
exec:
  command:
    - ringserve
    - health
    - localhost:{{ .port }}
    {{- with .service }}
    - --service={{ . }}
    {{- end }}
    {{- include "ringserve.grpcTlsArgs" .ctx | nindent 4 }}
{{- else }}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
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

{{/* The tokenizer Deployment's --replica values, a YAML list: every model replica pod
     (<sched>,<detok>) by its StatefulSet DNS name; when an autoscaler sizes the StatefulSet,
     every name up to its maxReplicas (the tokenizer sends only to replicas that are up). Under
     disaggregation.enabled the prefill set's pods, then the decode set's: each scheduler reports
     its mode in its LoadReport and the tokenizer pairs them. */}}
{{- define "ringserve.replicaAddrs" -}}
{{- range $set := include "ringserve.replicaSets" . | fromJsonArray }}
{{- $c := dict }}
{{- include "ringserve.setContext" (dict "ctx" $ "set" $set "out" $c) }}
{{- $r := $c.Values.replica }}
{{- $n := ternary $r.autoscaling.maxReplicas $r.replicas (ne $r.autoscaling.mode "") }}
{{- range $i := until (int $n) }}
{{- $host := include "ringserve.replicaHost" (dict "ctx" $c "index" $i) }}
- {{ printf "%s:%v,%s:%v" $host $.Values.ports.scheduler $host $.Values.ports.detokenizer }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "ringserve.modelDir" -}}/models/{{ .Values.model.name }}{{- end -}}

{{- define "ringserve.modelClaim" -}}
{{- default (printf "%s-models" (include "ringserve.fullname" .)) .Values.model.volume.pvc.existingClaim -}}
{{- end -}}

{{/* The model volume. Read-only where nothing is prepared into it (source hf). */}}
{{- define "ringserve.modelVolume" -}}
{{- $v := .Values.model.volume -}}
- name: model
{{- if eq $v.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "ringserve.modelClaim" . }}
    {{- if eq .Values.model.source "hf" }}
    readOnly: true
    {{- end }}
{{- else if eq $v.type "hostPath" }}
  hostPath:
    path: {{ $v.hostPath.path }}
    type: {{ ternary "Directory" "DirectoryOrCreate" (eq .Values.model.source "hf") }}
{{- else }}
{{- if ne .Values.model.source "image" }}
{{- fail "model.volume.type=emptyDir needs model.source=image: every pod fills its own emptyDir" }}
{{- end }}
  emptyDir:
    sizeLimit: {{ $v.emptyDir.sizeLimit }}
{{- end }}
{{- end -}}

{{/* Mount of the model volume at /models: call with (dict "ctx" $ "readOnly" bool). */}}
{{- define "ringserve.modelMount" -}}
- name: model
  mountPath: /models
  {{- if .readOnly }}
  readOnly: true
  {{- end }}
{{- if and (eq .ctx.Values.model.volume.type "pvc") .ctx.Values.model.volume.pvc.subPath }}
  subPath: {{ .ctx.Values.model.volume.pvc.subPath }}
{{- end }}
{{- end -}}

{{/* `ringserve prepare-model`'s source flags (see model.source in values.yaml). */}}
{{- define "ringserve.modelSourceArgs" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "registry" }}
- --registry={{ required "model.registry.requirement is required when model.source=registry" $m.registry.requirement }}
- --file={{ required "model.registry.file is required when model.source=registry" $m.registry.file }}
{{- else if eq $m.source "gguf" }}
{{- if $m.gguf.url }}
- --gguf-url={{ $m.gguf.url }}
{{- else }}
- --gguf=/models/{{ required "model.gguf.path or model.gguf.url is required when model.source=gguf" $m.gguf.path }}
{{- end }}
{{- else }}
- --hf
{{- end }}
{{- end -}}

{{/* The init container that makes /models/<name> ready before a service starts: call with
(dict "ctx" $ "role" "replica"|"tokenizer"). Replica pods prepare the model (the scheduler
image has torch and gguf) under a lock; tokenizer pods wait for it; source=image copies it
in every pod. */}}
{{- define "ringserve.modelInit" -}}
{{- $c := .ctx -}}
{{- $m := $c.Values.model -}}
initContainers:
{{- if eq $m.source "image" }}
  - name: copy-model
    image: {{ printf "%s:%s" (required "model.image.repository is required when model.source=image" $m.image.repository) (required "model.image.tag is required when model.source=image" $m.image.tag) }}
    command: {{ toJson $m.image.command }}
{{- else if eq .role "replica" }}
  - name: prepare-model
    image: {{ include "ringserve.image" (dict "ctx" $c "service" "scheduler") }}
    command: ["ringserve", "prepare-model"]
    args:
      - --dir={{ include "ringserve.modelDir" $c }}
      {{- include "ringserve.modelSourceArgs" $c | nindent 6 }}
{{- else }}
  - name: wait-model
    image: {{ include "ringserve.image" (dict "ctx" $c "service" "tokenizer") }}
    command: ["ringserve", "prepare-model"]
    args:
      - --dir={{ include "ringserve.modelDir" $c }}
      - --wait
{{- end }}
    imagePullPolicy: {{ $c.Values.image.pullPolicy }}
    env:
      - name: MODEL_DIR
        value: {{ include "ringserve.modelDir" $c | quote }}
      # pip and transformers write their caches under $HOME: the /tmp emptyDir.
      - name: HOME
        value: /tmp
      - name: PIP_NO_CACHE_DIR
        value: "1"
      {{- with $m.registry.indexUrl }}
      - name: PIP_INDEX_URL
        value: {{ . | quote }}
      {{- end }}
    securityContext:
      {{- toYaml $c.Values.containerSecurityContext | nindent 6 }}
    # Within what the pod's own containers ask for (a conversion holds the model in fp32).
    resources:
      {{- toYaml (ternary $c.Values.replica.scheduler.resources $c.Values.tokenizer.resources (eq .role "replica")) | nindent 6 }}
    volumeMounts:
      {{- $writes := or (eq $m.source "image") (and (eq .role "replica") (ne $m.source "hf")) }}
      {{- include "ringserve.modelMount" (dict "ctx" $c "readOnly" (not $writes)) | nindent 6 }}
      - name: tmp
        mountPath: /tmp
{{- end -}}

{{/* Whether the model pods must share a node: the chart's own ReadWriteOnce claim. */}}
{{- define "ringserve.modelOnOneNode" -}}
{{- $v := .Values.model.volume -}}
{{- if and (eq $v.type "pvc") (not $v.pvc.existingClaim) (has "ReadWriteOnce" $v.pvc.accessModes) }}true{{ end -}}
{{- end -}}

{{/* Pod affinity of a pod that mounts the model: call with (dict "ctx" $ "affinity" values).
The given affinity, else, on a ReadWriteOnce claim, every model pod on one node. */}}
{{- define "ringserve.modelPodAffinity" -}}
{{- if .affinity }}
affinity:
  {{- toYaml .affinity | nindent 2 }}
{{- else if include "ringserve.modelOnOneNode" .ctx }}
affinity:
  podAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - labelSelector:
          matchLabels:
            app.kubernetes.io/instance: {{ .ctx.Release.Name }}
            ringserve.io/model-volume: {{ include "ringserve.modelClaim" .ctx }}
        topologyKey: kubernetes.io/hostname
{{- end }}
{{- end -}}

{{/* The pod label that affinity matches. */}}
{{- define "ringserve.modelPodLabel" -}}
{{- if include "ringserve.modelOnOneNode" . }}
ringserve.io/model-volume: {{ include "ringserve.modelClaim" . }}
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
