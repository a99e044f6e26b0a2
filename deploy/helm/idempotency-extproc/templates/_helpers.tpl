{{/* The chart's name, nameOverride applied. */}}
{{- define "idem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The objects' name: fullnameOverride, or the release name when it already holds the chart's name. */}}
{{- define "idem.fullname" -}}
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

{{- define "idem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "idem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "idem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "idem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: ext-proc
{{- end -}}

{{- define "idem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "idem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "idem.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the Redis URL. */}}
{{- define "idem.redisSecretName" -}}
{{- default (printf "%s-redis" (include "idem.fullname" .)) .Values.store.redis.existingSecret -}}
{{- end -}}

{{/* The Secret a file secret (adminToken, recordKeys, keyHashSecret) comes from: (list $ .Values.x "suffix"). */}}
{{- define "idem.fileSecretName" -}}
{{- $root := index . 0 -}}{{- $v := index . 1 -}}{{- $suffix := index . 2 -}}
{{- default (printf "%s-%s" (include "idem.fullname" $root) $suffix) $v.existingSecret -}}
{{- end -}}

{{/* The policy file: .Values.policy as YAML, or verbatim when it is a string (--set-file policy=FILE). The policy ConfigMap and the policy check hook's render it alike. */}}
{{- define "idem.policyFile" -}}
{{- if kindIs "string" .Values.policy -}}
{{- .Values.policy -}}
{{- else -}}
{{- toYaml .Values.policy -}}
{{- end -}}
{{- end -}}

{{/* The FQDN of the Service, as the mesh names its cluster. */}}
{{- define "idem.serviceFQDN" -}}
{{- printf "%s.%s.svc.%s" (include "idem.fullname" .) .Release.Namespace .Values.istio.clusterDomain -}}
{{- end -}}

{{/*
Checks that fail the render, each naming the value to change. Included by the Deployment.
*/}}
{{- define "idem.validate" -}}
{{- $s := .Values.store -}}
{{- if not (has $s.type (list "memory" "redis")) -}}
{{- fail (printf "store.type must be memory or redis, got %q" $s.type) -}}
{{- end -}}
{{- if eq $s.type "memory" -}}
{{- if gt (int .Values.replicas) 1 -}}
{{- fail (printf "store.type memory keeps records in one process: replicas must be 1, got %d (use store.type redis for more)" (int .Values.replicas)) -}}
{{- end -}}
{{- if .Values.autoscaling.enabled -}}
{{- fail "store.type memory keeps records in one process: autoscaling.enabled needs store.type redis" -}}
{{- end -}}
{{- else -}}
{{- if and (not $s.redis.existingSecret) (not $s.redis.url) -}}
{{- fail "store.type redis needs store.redis.existingSecret (a Secret with the URL) or store.redis.url" -}}
{{- end -}}
{{- if and $s.redis.existingSecret $s.redis.url -}}
{{- fail "store.redis: set existingSecret or url, not both" -}}
{{- end -}}
{{- if and $s.redis.clusterAddrs $s.redis.sentinelAddrs -}}
{{- fail "store.redis: clusterAddrs and sentinelAddrs select different deployments: set one" -}}
{{- end -}}
{{- end -}}
{{- range $name := list "adminToken" "recordKeys" "keyHashSecret" -}}
{{- $v := index $.Values $name -}}
{{- if $v.enabled -}}
{{- if and (not $v.existingSecret) (not $v.value) -}}
{{- fail (printf "%s.enabled needs %s.existingSecret or %s.value" $name $name $name) -}}
{{- end -}}
{{- if and $v.existingSecret $v.value -}}
{{- fail (printf "%s: set existingSecret or value, not both" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if .Values.istio.enabled -}}
{{- if not .Values.istio.namespace -}}
{{- fail "istio.enabled needs istio.namespace (the workloads' namespace)" -}}
{{- end -}}
{{- if not (has .Values.istio.context (list "SIDECAR_INBOUND" "GATEWAY")) -}}
{{- fail (printf "istio.context must be SIDECAR_INBOUND or GATEWAY, got %q" .Values.istio.context) -}}
{{- end -}}
{{- end -}}
{{- if .Values.envoyGateway.enabled -}}
{{- if not .Values.envoyGateway.namespace -}}
{{- fail "envoyGateway.enabled needs envoyGateway.namespace (the routes' namespace)" -}}
{{- end -}}
{{- if not .Values.envoyGateway.targetRefs -}}
{{- fail "envoyGateway.enabled needs envoyGateway.targetRefs (the HTTPRoutes to attach to)" -}}
{{- end -}}
{{- if and .Values.envoyGateway.clientTrafficPolicy.enabled (not .Values.envoyGateway.clientTrafficPolicy.gatewayName) -}}
{{- fail "envoyGateway.clientTrafficPolicy.enabled needs envoyGateway.clientTrafficPolicy.gatewayName" -}}
{{- end -}}
{{- end -}}
{{- if not (has .Values.extProc.responseBodyMode (list "BUFFERED" "STREAMED")) -}}
{{- fail (printf "extProc.responseBodyMode must be BUFFERED or STREAMED, got %q" .Values.extProc.responseBodyMode) -}}
{{- end -}}
{{- if not (has .Values.extProc.responseTrailerMode (list "SKIP" "SEND")) -}}
{{- fail (printf "extProc.responseTrailerMode must be SKIP or SEND, got %q" .Values.extProc.responseTrailerMode) -}}
{{- end -}}
{{- end -}}

{{/* The peers of a NetworkPolicy ingress rule, as YAML, from (list selectors extra): one peer of
selectors' podSelector and namespaceSelector when either is set (a podSelector alone selects pods
of the release's namespace), then the extra peers. Empty when there are none, and the rule then
admits every source. */}}
{{- define "idem.networkPolicyPeers" -}}
{{- $sel := index . 0 | default dict -}}
{{- $peers := list -}}
{{- if or $sel.podSelector $sel.namespaceSelector -}}
{{- $peer := dict -}}
{{- with $sel.podSelector }}{{ $_ := set $peer "podSelector" . }}{{ end -}}
{{- with $sel.namespaceSelector }}{{ $_ := set $peer "namespaceSelector" . }}{{ end -}}
{{- $peers = append $peers $peer -}}
{{- end -}}
{{- $peers = concat $peers (index . 1 | default list) -}}
{{- with $peers }}{{ toYaml . }}{{ end -}}
{{- end -}}
