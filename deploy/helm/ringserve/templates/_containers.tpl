{{/* The gateway and tokenizer containers, shared by their Deployments and, under
inferencePool.enabled, by every replica pod (a whole ring per pod). Call with a dict:
  gateway:   ctx (the root), tokenizer (its address), metricsUpstreams (URLs whose /metrics
             the gateway's /metrics appends: the pod's scheduler in a one-ring pod)
  tokenizer: ctx, replicas ("<sched addr>,<detok addr>" each) */}}
{{- define "ringserve.gatewayContainer" -}}
{{- $ctx := .ctx -}}
{{- $p := . -}}
{{- with $ctx -}}
- name: gateway
  image: {{ include "ringserve.image" (dict "ctx" $ctx "service" "gateway") }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
  envFrom:
    - configMapRef:
        name: {{ include "ringserve.config" . }}
  {{- if .Values.apiKey.enabled }}
  # Read by the gateway itself (never on its command line).
  env:
    - name: RINGSERVE_API_KEY
      valueFrom:
        secretKeyRef:
          name: {{ include "ringserve.apiKeySecret" . }}
          key: {{ .Values.apiKey.secretKey }}
  {{- end }}
  args:
    - --host=0.0.0.0
    - --port={{ .Values.ports.gateway }}
    - --tokenizer={{ $p.tokenizer }}
    - --grace-period=$(GRACE_PERIOD)
    {{- range $p.metricsUpstreams }}
    - --metrics-upstream={{ . }}
    {{- end }}
    {{- if .Values.model.servedModelName }}
    - --served-model-name=$(SERVED_MODEL_NAME)
    {{- end }}
    {{- with .Values.config.gateway }}
    {{- if .httpHeaderTimeout }}
    - --http-header-timeout=$(GATEWAY_HTTP_HEADER_TIMEOUT)
    {{- end }}
    {{- if .httpBodyTimeout }}
    - --http-body-timeout=$(GATEWAY_HTTP_BODY_TIMEOUT)
    {{- end }}
    {{- if .httpIdleTimeout }}
    - --http-idle-timeout=$(GATEWAY_HTTP_IDLE_TIMEOUT)
    {{- end }}
    - --request-timeout={{ .requestTimeout }}
    - --sse-keepalive-s={{ .sseKeepalive }}
    {{- with .maxRequestBodyBytes }}
    - --max-request-body-bytes={{ . | int }}
    {{- end }}
    {{- with .toolCallParser }}
    - --tool-call-parser={{ . }}
    {{- end }}
    {{- with .reasoningParser }}
    - --reasoning-parser={{ . }}
    {{- end }}
    - --responses-store-max={{ .responsesStoreMax | int }}
    - --responses-store-max-bytes={{ .responsesStoreMaxBytes | int }}
    {{- end }}
    {{- include "ringserve.grpcTlsArgs" . | nindent 4 }}
    {{- include "ringserve.observabilityArgs" . | nindent 4 }}
    {{- range .Values.config.gateway.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  ports:
    - name: http
      containerPort: {{ .Values.ports.gateway }}
      protocol: TCP
  # /health is 200 only while a token can get through the ring (the tokenizer's readiness,
  # with the reasons in its body); liveness uses /metrics, which answers whenever the
  # gateway process does, whatever its peers do (no API key needed for either).
  readinessProbe:
    httpGet:
      path: /health
      port: http
    periodSeconds: 5
    failureThreshold: 2
  livenessProbe:
    httpGet:
      path: /metrics
      port: http
    periodSeconds: 10
    failureThreshold: 3
  startupProbe:
    httpGet:
      path: /metrics
      port: http
    periodSeconds: 2
    failureThreshold: 30
  resources:
    {{- toYaml .Values.gateway.resources | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    {{- include "ringserve.grpcTlsMount" . | nindent 4 }}
{{- end }}
{{- end -}}

{{- define "ringserve.tokenizerContainer" -}}
{{- $ctx := .ctx -}}
{{- $p := . -}}
{{- with $ctx -}}
- name: tokenizer
  image: {{ include "ringserve.image" (dict "ctx" $ctx "service" "tokenizer") }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
  envFrom:
    - configMapRef:
        name: {{ include "ringserve.config" . }}
  env:
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    {{- if .Values.apiKey.enabled }}
    # Read by the tokenizer itself (never on its command line): every RPC of its
    # Tokenizer service needs one of these keys.
    - name: RINGSERVE_API_KEY
      valueFrom:
        secretKeyRef:
          name: {{ include "ringserve.apiKeySecret" . }}
          key: {{ .Values.apiKey.secretKey }}
    {{- end }}
    {{- include "ringserve.internalAuthEnv" . | nindent 4 }}
  # Its model replicas (scheduler,detokenizer); it picks one per request (least outstanding
  # work, then prefix affinity).
  args:
    - --host=0.0.0.0
    - --port={{ .Values.ports.tokenizer }}
    - --model=$(MODEL_DIR)
    {{- range $p.replicas }}
    - --replica={{ . }}
    {{- end }}
    - --instance-id=$(POD_NAME)
    - --served-model-name=$(SERVED_MODEL_NAME)
    - --grace-period=$(GRACE_PERIOD)
    - --metrics-port={{ .Values.ports.tokenizerMetrics }}
    {{- if .Values.config.contextLength }}
    - --context-length=$(CONTEXT_LENGTH)
    {{- end }}
    {{- if .Values.config.allowSpecialTokensInMessages }}
    - --allow-special-tokens-in-messages
    {{- end }}
    {{- with .Values.config.tokenizer }}
    {{- if .readinessCheckInterval }}
    - --readiness-check-interval=$(TOKENIZER_READINESS_CHECK_INTERVAL)
    {{- end }}
    {{- if .readinessCheckTimeout }}
    - --readiness-check-timeout=$(TOKENIZER_READINESS_CHECK_TIMEOUT)
    {{- end }}
    {{- if .readinessStallTimeout }}
    - --readiness-stall-timeout=$(TOKENIZER_READINESS_STALL_TIMEOUT)
    {{- end }}
    {{- end }}
    {{- include "ringserve.grpcTlsArgs" . | nindent 4 }}
    {{- include "ringserve.observabilityArgs" . | nindent 4 }}
    {{- include "ringserve.internalAuthArgs" . | nindent 4 }}
    {{- include "ringserve.chatTemplateArgs" . | nindent 4 }}
    {{- range .Values.config.tokenizer.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ .Values.ports.tokenizer }}
      protocol: TCP
    - name: metrics
      containerPort: {{ .Values.ports.tokenizerMetrics }}
      protocol: TCP
  # Readiness: SERVING only while a token can get through one of its replicas (links up,
  # peers answering their health checks, outputs not stalled). Liveness and startup ask
  # the "liveness" health service, SERVING from start to shutdown: a stalled or
  # loading replica makes the tokenizer unready, never restarts it.
  readinessProbe:
    {{- include "ringserve.grpcProbe" (dict "ctx" $ctx "port" .Values.ports.tokenizer) | nindent 4 }}
    periodSeconds: 5
    failureThreshold: 2
  livenessProbe:
    {{- include "ringserve.grpcProbe" (dict "ctx" $ctx "port" .Values.ports.tokenizer "service" "liveness") | nindent 4 }}
    periodSeconds: 10
    failureThreshold: 12
  startupProbe:
    {{- include "ringserve.grpcProbe" (dict "ctx" $ctx "port" .Values.ports.tokenizer "service" "liveness") | nindent 4 }}
    periodSeconds: 5
    failureThreshold: 120
  resources:
    {{- toYaml .Values.tokenizer.resources | nindent 4 }}
  volumeMounts:
    {{- include "ringserve.modelMount" (dict "ctx" $ctx "readOnly" true) | nindent 4 }}
    - name: tmp
      mountPath: /tmp
    {{- include "ringserve.grpcTlsMount" . | nindent 4 }}
    {{- include "ringserve.chatTemplateMount" . | nindent 4 }}
{{- end }}
{{- end -}}
