{{/*
The pod template of a Ray node (head or a worker group). Call with a dict:
  root       the top-level context ($)
  component  "head", "colocated", "prefill" or "decode"
  group      the values of that node kind (head or workers.<role>)
The Ray container comes first (KubeRay starts Ray in container 0).
*/}}
{{- define "baton.rayPodTemplate" -}}
{{- $root := .root -}}
{{- $group := .group -}}
{{- $isHead := eq .component "head" -}}
{{- $cfg := $root.Values.config -}}
metadata:
  labels:
    {{- include "baton.componentLabels" (list $root .component) | nindent 4 }}
    {{- with $root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $root.Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $shutdown := $root.Values.shutdown }}
  # Kubernetes' kill comes after the preStop wait, the drain and Ray's own stop (values.yaml `shutdown`).
  terminationGracePeriodSeconds: {{ add $shutdown.preStopSeconds $shutdown.gracePeriodSeconds $shutdown.teardownSeconds }}
  {{- if $group.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" $isHead }}
      image: {{ include "baton.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      ports:
        {{- if $isHead }}
        - {name: gcs-server, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        {{- end }}
        - {name: metrics, containerPort: 8080}
        - {name: serve, containerPort: {{ $cfg.server.http_port }}}
        - {name: grpc, containerPort: {{ $cfg.server.grpc_port }}}
      {{- /* What Serve's processes read at import (services/ray_env.py SERVE_ENV); extraEnv, later, wins */ -}}
      {{- $env := prepend $root.Values.extraEnv (dict "name" "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS" "value" "1000") }}
      {{- $env = prepend $env (dict "name" "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" "value" "0.5") }}
      {{- $env = prepend $env (dict "name" "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" "value" "0") }}
      {{- $env = prepend $env (dict "name" "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" "value" (toString $root.Values.shutdown.gracePeriodSeconds)) }}
      {{- if include "baton.redis.hasPassword" $root }}
      {{- $secret := dict "name" (include "baton.redis.secretName" $root) "key" (include "baton.redis.secretKey" $root) }}
      {{- $env = prepend $env (dict "name" (include "baton.redis.passwordEnv" $root) "valueFrom" (dict "secretKeyRef" $secret)) }}
      {{- end }}
      {{- /* API keys: the variables config.server.auth names; a pod without the API-key entry does not start */ -}}
      {{- with $root.Values.apiKeys.existingSecret }}
      {{- $auth := default dict (dig "server" "auth" dict $cfg) }}
      {{- $keys := dict "name" . "key" $root.Values.apiKeys.key }}
      {{- $env = prepend $env (dict "name" (default "BATON_API_KEYS" (get $auth "api_keys_env")) "valueFrom" (dict "secretKeyRef" $keys)) }}
      {{- if $root.Values.apiKeys.adminKey }}
      {{- $adminKeys := dict "name" . "key" $root.Values.apiKeys.adminKey "optional" true }}
      {{- $env = prepend $env (dict "name" (default "BATON_ADMIN_API_KEYS" (get $auth "admin_api_keys_env")) "valueFrom" (dict "secretKeyRef" $adminKeys)) }}
      {{- end }}
      {{- end }}
      {{- $env = concat (include "baton.tls.env" $root | fromYamlArray) $env }}
      env:
        {{- toYaml $env | nindent 8 }}
      {{- if and $root.Values.tls.existingSecret (not $isHead) }}
      {{- /* KubeRay's own worker probe fetches Serve's health in plaintext: under TLS it never passes */}}
      {{- $dir := trimSuffix "/" $root.Values.tls.mountPath }}
      {{- $probe := list "python" "-m" "baton.services.gateway.health_probe" "--serve-port" (toString $cfg.server.http_port) }}
      {{- if $root.Values.tls.requireClientCert }}
      {{- $probe = concat $probe (list "--cert-file" (printf "%s/tls.crt" $dir) "--key-file" (printf "%s/tls.key" $dir)) }}
      {{- end }}
      readinessProbe:
        exec:
          command: {{ toJson $probe }}
        initialDelaySeconds: 10
        periodSeconds: 5
        timeoutSeconds: 10
        failureThreshold: 1
      {{- end }}
      {{- if gt (int $root.Values.shutdown.preStopSeconds) 0 }}
      lifecycle:
        preStop:
          sleep: {seconds: {{ $root.Values.shutdown.preStopSeconds }}}  # Kubernetes 1.31 refuses 0
      {{- end }}
      {{- $limits := dig "limits" dict (default dict $group.resources) | deepCopy }}
      {{- $requests := dig "requests" dict (default dict $group.resources) | deepCopy }}
      {{- $devices := dict }}
      {{- if gt (int (default 0 $group.gpus)) 0 }}
      {{- $_ := set $devices "nvidia.com/gpu" (int $group.gpus) }}
      {{- end }}
      {{- if and $group.rdma $group.rdma.enabled }}
      {{- $devices = merge $devices (default dict $group.rdma.resources) }}
      {{- end }}
      resources:
        {{- toYaml (dict "limits" (merge $limits $devices) "requests" (merge $requests $devices)) | nindent 8 }}
      {{- if and $group.rdma $group.rdma.enabled }}
      securityContext:
        capabilities:
          add: [IPC_LOCK]  # RDMA pins (locks) the memory it registers
      {{- end }}
      volumeMounts:
        - {name: shm, mountPath: /dev/shm}
        - {name: baton-config, mountPath: /etc/baton, readOnly: true}
        {{- if $root.Values.model.volume }}
        - {name: model, mountPath: {{ $root.Values.model.mountPath }}, readOnly: true}
        {{- end }}
        {{- if $root.Values.tls.existingSecret }}
        - {name: baton-tls, mountPath: {{ $root.Values.tls.mountPath }}, readOnly: true}
        {{- end }}
        {{- if include "baton.redis.tls" $root }}
        - {name: redis-tls, mountPath: {{ $root.Values.redis.tls.mountPath }}, readOnly: true}
        {{- end }}
        {{- with $root.Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ $group.shmSize }}}
    - name: baton-config
      configMap:
        name: {{ include "baton.componentName" (list $root "config") }}
    {{- with $root.Values.tls.existingSecret }}
    - name: baton-tls
      secret: {secretName: {{ . }}}
    {{- end }}
    {{- if include "baton.redis.tls" $root }}
    - name: redis-tls
      secret: {secretName: {{ $root.Values.redis.tls.existingSecret }}, items: [{key: ca.crt, path: ca.crt}]}
    {{- end }}
    {{- with $root.Values.model.volume }}
    - name: model
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $root.Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
