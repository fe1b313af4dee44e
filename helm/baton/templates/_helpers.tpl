{{/*
Names and labels. Kubernetes names and label values stop at 63 characters; a component's
name keeps its suffix whole and shortens the release part instead.
*/}}

{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "baton.fullname" -}}
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

{{/* "<fullname>-<component>" within 63 characters. Call with (list $ "component"). */}}
{{- define "baton.componentName" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $prefix := include "baton.fullname" $root | trunc (int (sub 62 (len $component))) | trimSuffix "-" -}}
{{- printf "%s-%s" $prefix $component -}}
{{- end -}}

{{/*
The RayService's name. KubeRay appends "-" and 5 characters for its RayCluster and
"-serve-svc" to that for a Service, so it allows 47 characters and a DNS-1035 label.
*/}}
{{- define "baton.rayServiceName" -}}
{{- $name := include "baton.fullname" . | trunc 47 | trimSuffix "-" -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "the RayService name %q must start with a letter (KubeRay needs a DNS-1035 label): set fullnameOverride" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "baton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "baton.labels" -}}
helm.sh/chart: {{ include "baton.chart" . }}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: baton
{{- end -}}

{{/* Labels of one component's objects. Call with (list $ "component"). */}}
{{- define "baton.componentLabels" -}}
{{ include "baton.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Selector of one component's pods. Call with (list $ "component"). */}}
{{- define "baton.componentSelectorLabels" -}}
{{ include "baton.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
