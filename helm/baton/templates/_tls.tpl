{{/*
TLS on both client APIs, from values.tls (services/gateway/tls.py explains the mechanism):
  baton.tls.server   config.server.tls: the mounted Secret's files (empty without tls.existingSecret)
  baton.tls.env      the Ray containers' variables: Serve calls Baton's proxy hook, which binds
                     gRPC with these files (HTTP gets them through serveConfigV2's http_options)
*/}}
{{- define "baton.tls.server" -}}
{{- with .Values.tls.existingSecret -}}
{{- $dir := trimSuffix "/" $.Values.tls.mountPath -}}
{{- $tls := dict "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) -}}
{{- if $.Values.tls.requireClientCert -}}
{{- $_ := set $tls "client_ca_file" (printf "%s/%s" $dir $.Values.tls.caKey) -}}
{{- end -}}
{{- toYaml $tls -}}
{{- end -}}
{{- end -}}

{{- define "baton.tls.env" -}}
{{- $tls := include "baton.tls.server" . | fromYaml -}}
{{- if $tls -}}
{{- $env := list (dict "name" "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" "value" "baton.services.gateway.proxy_hook.setup_proxy") -}}
{{- $env = append $env (dict "name" "BATON_GRPC_HOST" "value" "0.0.0.0") -}}
{{- $env = append $env (dict "name" "BATON_TLS_CERT_FILE" "value" $tls.cert_file) -}}
{{- $env = append $env (dict "name" "BATON_TLS_KEY_FILE" "value" $tls.key_file) -}}
{{- with $tls.client_ca_file -}}
{{- $env = append $env (dict "name" "BATON_TLS_CLIENT_CA_FILE" "value" .) -}}
{{- end -}}
{{- toYaml $env -}}
{{- end -}}
{{- end -}}
