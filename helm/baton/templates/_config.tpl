{{/*
The Baton config (services/config.py BatonConfig) and the Serve config around it.

values.config is passed through, with what depends on the cluster filled in:
  server.http_host, grpc_host         0.0.0.0 (Serve's proxies listen in the pod)
  server.tls                          the mounted tls.existingSecret's files (_tls.tpl)
  router.redis.url, .password_env     from `redis`; every Ray pod gets the password from the
                                      Secret in that variable (never in the config itself)
  <role>.ray_actor_options.resources  baton_<role>: 1, which only that role's worker
                                      group offers, so replicas land on their own pods
  <role>.ray_actor_options.num_gpus   1 on a GPU group with tensor_parallel_size 1 (unless set)
  <role>.autoscaling.policy           policy_function: Baton's signal policy (the only one allowed)
Only the engine roles of config.mode are kept.
*/}}

{{- define "baton.roles" -}}
{{- if eq .Values.config.mode "colocated" -}}colocated{{- else -}}prefill,decode{{- end -}}
{{- end -}}

{{/* A role's tensor-parallel size: its engine_overrides, else the shared engine section. */}}
{{- define "baton.tensorParallelSize" -}}
{{- $root := index . 0 -}}
{{- $section := default dict (get $root.Values.config (index . 1)) -}}
{{- $shared := dig "parallel" "tensor_parallel_size" 1 (default dict $root.Values.config.engine) -}}
{{- dig "parallel" "tensor_parallel_size" $shared (default dict $section.engine_overrides) | int -}}
{{- end -}}

{{- define "baton.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $_ := required "config.engine.model.model is required: the path of the model folder inside the pods (see model.volume)" (dig "engine" "model" "model" "" $cfg) -}}
{{- $_ := set $cfg "server" (merge (dict "http_host" "0.0.0.0" "grpc_host" "0.0.0.0") (default dict $cfg.server)) -}}
{{- with include "baton.tls.server" . | fromYaml -}}
{{- $_ := set $cfg.server "tls" . -}}
{{- end -}}
{{- $roles := splitList "," (include "baton.roles" .) -}}
{{- range $role := list "colocated" "prefill" "decode" -}}
{{- if has $role $roles -}}
{{- $section := default dict (get $cfg $role) -}}
{{- $group := get $.Values.workers $role -}}
{{- $options := default dict $section.ray_actor_options -}}
{{- $pin := dict (printf "baton_%s" $role) 1 -}}
{{- $_ := set $options "resources" (merge $pin (default dict $options.resources)) -}}
{{- if and (gt (int $group.gpus) 0) (eq (include "baton.tensorParallelSize" (list $ $role) | int) 1) (not (hasKey $options "num_gpus")) -}}
{{- $_ := set $options "num_gpus" 1 -}}
{{- end -}}
{{- $_ := set $section "ray_actor_options" $options -}}
{{- with (default dict $section.autoscaling).policy -}}{{/* Serve would run its own policy without it */}}
{{- $_ := set . "policy_function" (default "baton.services.autoscaling.policy:BatonAutoscalingPolicy" .policy_function) -}}
{{- end -}}
{{- $_ := set $cfg $role $section -}}
{{- else -}}
{{- $_ := unset $cfg $role -}}
{{- end -}}
{{- end -}}
{{- $router := default dict $cfg.router -}}
{{- if eq (include "baton.redis.mode" .) "none" -}}
{{- $_ := unset $router "redis" -}}
{{- else -}}
{{- $redis := merge (dict "url" (include "baton.redis.url" .)) (default dict $router.redis) (include "baton.redis.securityConfig" . | fromYaml) -}}
{{- $_ := set $redis "password_env" (ternary (include "baton.redis.passwordEnv" .) nil (eq (include "baton.redis.hasPassword" .) "true")) -}}
{{- $_ := set $router "redis" $redis -}}
{{- end -}}
{{- $_ := set $cfg "router" $router -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
Serve's placement-group bundles for a tensor-parallel role: bundle 0 holds the replica and
rank 0, bundles 1.. one rank each (services/engine/execution/tp_executor.py reuses the replica's
group: rank i in bundle i, {CPU: 1, GPU: 1} a rank). Bundle 0 carries the role's pin.
*/}}
{{- define "baton.placementBundles" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $options := index . 2 -}}
{{- $tp := include "baton.tensorParallelSize" (list $root $role) | int -}}
{{- $rank := dict "CPU" 1 -}}
{{- if gt (int (get $root.Values.workers $role).gpus) 0 -}}
{{- $_ := set $rank "GPU" 1 -}}
{{- end -}}
{{- $replicaCpus := 1 -}}{{/* ActorOptions' default */}}
{{- if hasKey $options "num_cpus" -}}
{{- $replicaCpus = $options.num_cpus -}}
{{- end -}}
{{- $first := merge (dict "CPU" (addf 1 $replicaCpus)) $options.resources $rank -}}
{{- $bundles := list $first -}}
{{- range $i := untilStep 1 $tp 1 -}}
{{- $bundles = append $bundles $rank -}}
{{- end -}}
{{- toYaml $bundles -}}
{{- end -}}

{{- define "baton.serveConfig" -}}
{{- $cfg := include "baton.config" . | fromYaml -}}
{{- $http := dict "host" "0.0.0.0" "port" $cfg.server.http_port -}}
{{- /* baton.services.launcher.launcher.GRPC_SERVICERS: parsers that answer malformed bytes with INVALID_ARGUMENT */ -}}
{{- $servicers := list "baton.services.gateway.grpc_servicers.add_inference_servicer_to_server" "baton.services.gateway.grpc_servicers.add_admin_servicer_to_server" "baton.services.gateway.grpc_servicers.add_health_servicer_to_server" -}}
{{- $grpc := dict "port" $cfg.server.grpc_port "grpc_servicer_functions" $servicers -}}
{{- with $cfg.server.tls -}}
{{- $_ := set $http "ssl_certfile" .cert_file -}}
{{- $_ := set $http "ssl_keyfile" .key_file -}}
{{- with .client_ca_file -}}
{{- $_ := set $http "ssl_ca_certs" . -}}
{{- end -}}
{{- end -}}
{{- with $cfg.server.request_timeout_s -}}
{{- $_ := set $http "request_timeout_s" . -}}
{{- $_ := set $grpc "request_timeout_s" . -}}
{{- end -}}
{{- /* Replica counts and autoscaling go in Serve's per-deployment options, not in the
args: Serve hashes the args into the application's code version, and a new version
restarts every replica (the gateway's too) where a changed count only adds or drains
replicas of that deployment. */ -}}
{{- $args := deepCopy $cfg -}}
{{- $deployments := list -}}
{{- range $role := prepend (splitList "," (include "baton.roles" $)) "gateway" -}}
{{- $section := default dict (get $args $role) -}}
{{- $deployment := dict "name" $role -}}
{{- if $section.autoscaling -}}
{{- $given := $section.autoscaling -}}
{{- $scaling := deepCopy $given -}}
{{- $_ := unset $scaling "cold_start_timeout_s" -}}{{/* Baton's, not Serve's */}}
{{- $_ := set $deployment "autoscaling_config" $scaling -}}
{{- $_ := unset $section "autoscaling" -}}{{/* num_replicas stays: ignored with autoscaling */}}
{{- if and (eq (int $given.min_replicas) 0) (ne $role "prefill") (ne $role "gateway") -}}
{{- /* A role that scales to zero: the gateway waits for its cold start, so the args say so
(services/autoscaling/scale_to_zero.py). max_replicas 1 only satisfies the typed config: the
bounds in effect are Serve's options above, and stay out of the code version. */ -}}
{{- $wait := dict "min_replicas" 0 "max_replicas" 1 "cold_start_timeout_s" (default 60 $given.cold_start_timeout_s) -}}
{{- $_ := set $section "autoscaling" $wait -}}
{{- end -}}
{{- else -}}
{{- $_ := set $deployment "num_replicas" (default 1 $section.num_replicas) -}}
{{- $_ := unset $section "num_replicas" -}}
{{- end -}}
{{- if and (ne $role "gateway") (gt (include "baton.tensorParallelSize" (list $ $role) | int) 1) -}}
{{- $engine := default dict $cfg.engine -}}
{{- $strategy := dig "parallel" "placement_strategy" (dig "parallel" "placement_strategy" "STRICT_PACK" $engine) (default dict $section.engine_overrides) -}}
{{- $bundles := include "baton.placementBundles" (list $ $role $section.ray_actor_options) | fromYamlArray -}}
{{- $_ := set $deployment "placement_group_bundles" $bundles -}}
{{- $_ := set $deployment "placement_group_strategy" $strategy -}}
{{- end -}}
{{- $_ := set $args $role $section -}}
{{- $deployments = append $deployments $deployment -}}
{{- end -}}
{{- $app := dict "name" $cfg.name "import_path" "baton.services.serve_app.serve_entry:app" "route_prefix" "/" "args" (dict "config" $args "grace_period_s" .Values.shutdown.gracePeriodSeconds) "deployments" $deployments -}}
{{- toYaml (dict "proxy_location" "EveryNode" "http_options" $http "grpc_options" $grpc "applications" (list $app)) -}}
{{- end -}}

{{/*
Pods of a worker group: ceil(replicas / replicasPerPod), from num_replicas, or from the
autoscaling bounds (then KubeRay's autoscaler moves between min and max).
Prints "replicas,minReplicas,maxReplicas". Call with (list $ "role").
*/}}
{{- define "baton.groupSize" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $section := default dict (get $root.Values.config $role) -}}
{{- $perPod := (get $root.Values.workers $role).replicasPerPod | int -}}
{{- if $section.autoscaling -}}
{{- $min := ceil (divf $section.autoscaling.min_replicas $perPod) | int -}}
{{- $max := ceil (divf $section.autoscaling.max_replicas $perPod) | int -}}
{{- printf "%d,%d,%d" $min $min $max -}}
{{- else -}}
{{- $pods := ceil (divf (default 1 $section.num_replicas) $perPod) | int -}}{{/* 1: DeploymentConfig's default */}}
{{- printf "%d,%d,%d" $pods $pods $pods -}}
{{- end -}}
{{- end -}}

{{/* "true" when any engine role autoscales (KubeRay's in-tree autoscaler is then on). */}}
{{- define "baton.autoscaling" -}}
{{- range $role := splitList "," (include "baton.roles" $) -}}
{{- if (default dict (get $.Values.config $role)).autoscaling -}}true{{- end -}}
{{- end -}}
{{- end -}}
