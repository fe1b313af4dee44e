{{/*
Where Baton's router finds Redis:
  external  redis.external.url is set: that Redis, nothing rendered for it
  inchart   redis.enabled: the StatefulSet + Service of this release
  none      neither: no router.redis in the config (load-only placement, no prefix index)
*/}}
{{- define "baton.redis.mode" -}}
{{- if .Values.redis.external.url -}}external
{{- else if .Values.redis.enabled -}}inchart
{{- else -}}none
{{- end -}}
{{- end -}}

{{- define "baton.redis.fullname" -}}
{{- include "baton.componentName" (list . "redis") -}}
{{- end -}}

{{- define "baton.redis.url" -}}
{{- $mode := include "baton.redis.mode" . -}}
{{- if eq $mode "external" -}}
{{- .Values.redis.external.url -}}
{{- else if eq $mode "inchart" -}}
{{- printf "%s://%s.%s.svc:%d" (ternary "rediss" "redis" .Values.redis.tls.enabled) (include "baton.redis.fullname" .) .Release.Namespace (int .Values.redis.port) -}}
{{- end -}}
{{- end -}}

{{/* "true" when Baton reads a Redis password from a Secret. */}}
{{- define "baton.redis.hasPassword" -}}
{{- if and .Values.redis.auth.enabled (ne (include "baton.redis.mode" .) "none") -}}
{{- if and (eq (include "baton.redis.mode" .) "external") (not .Values.redis.auth.password) (not .Values.redis.auth.existingSecret) -}}
{{- fail "redis.external.url is set with redis.auth.enabled: give redis.auth.password or redis.auth.existingSecret, or set redis.auth.enabled=false" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* "true" when this release creates the Secret (no existingSecret). */}}
{{- define "baton.redis.createSecret" -}}
{{- if and (include "baton.redis.hasPassword" .) (not .Values.redis.auth.existingSecret) -}}true{{- end -}}
{{- end -}}

{{- define "baton.redis.secretName" -}}
{{- default (include "baton.redis.fullname" .) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "baton.redis.secretKey" -}}
{{- if .Values.redis.auth.existingSecret -}}{{ .Values.redis.auth.existingSecretKey }}{{- else -}}redis-password{{- end -}}
{{- end -}}

{{/* The variable that carries the password into every Baton process (RedisConfig.password_env). */}}
{{- define "baton.redis.passwordEnv" -}}BATON_REDIS_PASSWORD{{- end -}}

{{/* "true" when Baton reaches Redis over TLS with the CA of redis.tls.existingSecret. */}}
{{- define "baton.redis.tls" -}}
{{- if and .Values.redis.tls.enabled (ne (include "baton.redis.mode" .) "none") -}}
{{- if not .Values.redis.tls.existingSecret -}}
{{- fail "redis.tls.enabled needs redis.tls.existingSecret: a Secret with ca.crt (and, for the in-chart Redis, tls.crt and tls.key)" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The router's RedisConfig fields for the ACL user and TLS (merged under the user's router.redis). */}}
{{- define "baton.redis.securityConfig" -}}
{{- $fields := dict -}}
{{- with .Values.redis.auth.username -}}
{{- $_ := set $fields "username" . -}}
{{- end -}}
{{- if include "baton.redis.tls" . -}}
{{- $_ := set $fields "tls" true -}}
{{- $_ := set $fields "tls_ca_file" (printf "%s/ca.crt" (trimSuffix "/" .Values.redis.tls.mountPath)) -}}
{{- end -}}
{{- toYaml $fields -}}
{{- end -}}
