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
{{- /* The values start-up reads from the Secrets the chart makes, checked as start-up checks
them and with its messages, never showing a secret. Secrets named by existingSecret are not
read here (nor by the hook). */ -}}
{{- $secret := dict -}}
{{- range $name := list "adminToken" "recordKeys" "keyHashSecret" -}}
{{- $v := index $.Values $name -}}
{{- if and $v.enabled $v.value (not $v.existingSecret) -}}
{{- $_ := set $secret $name (trimSuffix "\r" (trimSuffix "\n" ($v.value | toString))) -}}
{{- end -}}
{{- end -}}
{{- with get $secret "adminToken" -}}
{{- if regexMatch "[[:cntrl:] ]" . -}}
{{- fail "adminToken.value: the token holds spaces or control characters; write it alone on one line" -}}
{{- end -}}
{{- end -}}
{{- with get $secret "keyHashSecret" -}}
{{- if lt (len .) 32 -}}
{{- fail (printf "keyHashSecret.value holds %d bytes; at least 32 are needed (for example from head -c 32 /dev/urandom)" (len .)) -}}
{{- end -}}
{{- end -}}
{{- with get $secret "recordKeys" -}}
{{- $keys := 0 -}}
{{- range $i, $line := splitList "\n" (trimPrefix "\ufeff" .) -}}
{{- $line = trim $line -}}
{{- if and $line (not (hasPrefix "#" $line)) -}}
{{- if not (contains ":" $line) -}}
{{- fail (printf "recordKeys.value: seal: line %d: want <id>:<base64 of 32 bytes>, found no ':'" (add1 $i)) -}}
{{- end -}}
{{- $id := trim (index (splitn ":" 2 $line) "_0") -}}
{{- $key := trim (index (splitn ":" 2 $line) "_1") -}}
{{- if not (regexMatch "^[A-Za-z0-9._-]{1,32}$" $id) -}}
{{- fail (printf "recordKeys.value: seal: line %d: the key id (%d characters before the ':') must be 1 to 32 characters of A-Z a-z 0-9 . _ -" (add1 $i) (len $id)) -}}
{{- end -}}
{{- if not (regexMatch "^[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048](=)?$" $key) -}}
{{- fail (printf "recordKeys.value: seal: line %d: key %q: want the standard base64 of 32 bytes" (add1 $i) $id) -}}
{{- end -}}
{{- $keys = add1 $keys -}}
{{- end -}}
{{- end -}}
{{- if eq $keys 0 -}}
{{- fail "recordKeys.value: seal: no keys: want one line <id>:<base64 of 32 bytes> per key, the active one first" -}}
{{- end -}}
{{- end -}}
{{- if and (eq $s.type "redis") $s.redis.url $s.redis.clusterAddrs -}}
{{- $db := trimPrefix "/" (get (urlParse $s.redis.url) "path") -}}
{{- if and $db (ne $db "0") -}}
{{- fail (printf "store.redis.url: cache: redis: Cluster has only database 0, the url selects %s" $db) -}}
{{- end -}}
{{- end -}}
{{- if .Values.istio.enabled -}}
{{- if not .Values.istio.namespace -}}
{{- fail "istio.enabled needs istio.namespace (the workloads' namespace)" -}}
{{- end -}}
{{- if not (has .Values.istio.context (list "SIDECAR_INBOUND" "GATEWAY")) -}}
{{- fail (printf "istio.context must be SIDECAR_INBOUND or GATEWAY, got %q" .Values.istio.context) -}}
{{- end -}}
{{- if and .Values.istio.grpcRoutes (ne .Values.istio.context "GATEWAY") -}}
{{- fail (printf "istio.grpcRoutes needs istio.context GATEWAY, got %q: in a sidecar Istio names the inbound routes itself, so the names %v would match no route and the gRPC methods would keep the filter's processing modes" .Values.istio.context .Values.istio.grpcRoutes) -}}
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
{{- if .Values.sidecar.enabled -}}
{{- if eq .Values.istio.enabled .Values.envoyGateway.enabled -}}
{{- fail "sidecar.enabled runs the processor in one gateway's pods: enable one of envoyGateway.enabled and istio.enabled" -}}
{{- end -}}
{{- if and (eq $s.type "memory") (gt (int .Values.sidecar.gatewayReplicas) 1) -}}
{{- fail (printf "sidecar.gatewayReplicas is %d with store.type memory: each gateway pod would keep its own records, and a retry that reaches another pod runs again; use store.type redis, or one gateway pod" (int .Values.sidecar.gatewayReplicas)) -}}
{{- end -}}
{{- if and .Values.istio.enabled (ne .Values.istio.context "GATEWAY") -}}
{{- fail "sidecar.enabled with istio.enabled runs the processor in a gateway's pods: istio.context must be GATEWAY" -}}
{{- end -}}
{{- if and .Values.istio.enabled (not .Values.istio.workloadSelector) -}}
{{- fail "sidecar.enabled with istio.enabled needs istio.workloadSelector: the labels of the gateway pods the chart renders" -}}
{{- end -}}
{{- if and .Values.istio.enabled (ne .Values.istio.namespace .Release.Namespace) -}}
{{- fail (printf "sidecar.enabled with istio.enabled renders the gateway Deployment in the release's namespace %q, and the EnvoyFilter's workloadSelector matches pods of istio.namespace %q only: install the release in istio.namespace" .Release.Namespace .Values.istio.namespace) -}}
{{- end -}}
{{- if and .Values.istio.enabled (lt (int .Values.terminationGracePeriodSeconds) (add (int .Values.sidecar.istio.preStopSleepSeconds) 15)) -}}
{{- fail (printf "terminationGracePeriodSeconds %d is shorter than sidecar.istio.preStopSleepSeconds %d and the processor's 15 s drain" (int .Values.terminationGracePeriodSeconds) (int .Values.sidecar.istio.preStopSleepSeconds)) -}}
{{- end -}}
{{- range $name := list "autoscaling" "networkPolicy" "serviceMonitor" -}}
{{- if (index $.Values $name).enabled -}}
{{- fail (printf "%s.enabled applies to the chart's own Deployment and Service, which sidecar mode does not render" $name) -}}
{{- end -}}
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

{{/* Where the processor's Secrets are mounted, and the unix socket Envoy reaches it at in sidecar mode. */}}
{{- define "idem.secretsDir" -}}/var/run/secrets/idempotency-extproc{{- end -}}
{{- define "idem.socketDir" -}}/var/run/idempotency{{- end -}}
{{- define "idem.socketPath" -}}{{ include "idem.socketDir" . }}/extproc.sock{{- end -}}

{{/*
The processor's arguments and environment: (dict "root" $ "hook" false) for the pods that serve,
(dict "root" $ "hook" true) for the policy check hook. Both come from here, so that the hook
checks the configuration the pods start with. The hook runs `check` with the same arguments and
the same environment but what comes from a Secret: on a first install the release's Secrets do
not exist yet when the hook runs, and check reads no secret (it notes the files it does not
find).
*/}}
{{- define "idem.processorArgsEnv" -}}
{{- $v := .root.Values -}}
{{- $secretsDir := include "idem.secretsDir" .root -}}
args:
  {{- if .hook }}
  - check
  {{- end }}
  - --config=/etc/idempotency-extproc/policy.yaml
  {{- if $v.sidecar.enabled }}
  - --grpc-addr=unix://{{ include "idem.socketPath" .root }}
  {{- else }}
  - --grpc-addr=:{{ $v.ports.grpc }}
  {{- end }}
  - --admin-addr=:{{ $v.ports.admin }}
  - --store={{ $v.store.type }}
  {{- if eq $v.store.type "memory" }}
  - --memory-max-bytes={{ int64 $v.store.memory.maxBytes }}
  {{- else }}
  {{- with $v.store.redis.clusterAddrs }}
  - --redis-cluster-addrs={{ join "," . }}
  {{- end }}
  {{- with $v.store.redis.sentinelAddrs }}
  - --redis-sentinel-addrs={{ join "," . }}
  - --redis-sentinel-master={{ $v.store.redis.sentinelMaster }}
  {{- end }}
  {{- end }}
  {{- if $v.adminToken.enabled }}
  - --admin-token-file={{ $secretsDir }}/admin-token/token
  {{- end }}
  {{- if $v.recordKeys.enabled }}
  - --record-keys-file={{ $secretsDir }}/record-keys/keys
  {{- end }}
  {{- if $v.keyHashSecret.enabled }}
  - --key-hash-secret-file={{ $secretsDir }}/key-hash-secret/secret
  {{- end }}
  - --log-level={{ $v.log.level }}
  - --log-format={{ $v.log.format }}
  {{- with $v.extraArgs }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- $env := list -}}
{{- if eq $v.store.type "redis" -}}
{{- if not .hook -}}
{{- $env = append $env (dict "name" "IDEMPOTENCY_REDIS_URL" "valueFrom" (dict "secretKeyRef" (dict "name" (include "idem.redisSecretName" .root) "key" (ternary $v.store.redis.existingSecretKey "url" (ne $v.store.redis.existingSecret ""))))) -}}
{{- end -}}
{{- if $v.store.redis.caSecret -}}
{{- $env = append $env (dict "name" "SSL_CERT_FILE" "value" (printf "%s/redis-ca/ca.crt" $secretsDir)) -}}
{{- end -}}
{{- end -}}
{{- range $v.extraEnv -}}
{{- if not (and $.hook (hasKey . "valueFrom") (hasKey .valueFrom "secretKeyRef")) -}}
{{- $env = append $env . -}}
{{- end -}}
{{- end -}}
{{- with $env }}
env:
  {{- if and (eq $v.store.type "redis") (not $.hook) }}
  # The Redis URL from a Secret, never in the arguments: the pod spec does not show the password.
  {{- end }}
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The processor's container, in the chart's Deployment or, in sidecar mode, in the gateway's pods. */}}
{{- define "idem.processorContainer" -}}
{{- $v := .Values -}}
{{- $secretsDir := include "idem.secretsDir" . -}}
name: idempotency-extproc
image: {{ include "idem.image" . }}
imagePullPolicy: {{ $v.image.pullPolicy }}
{{ include "idem.processorArgsEnv" (dict "root" . "hook" false) }}
ports:
  {{- if not $v.sidecar.enabled }}
  - name: grpc
    containerPort: {{ $v.ports.grpc }}
    protocol: TCP
  {{- end }}
  - name: http-admin
    containerPort: {{ $v.ports.admin }}
    protocol: TCP
livenessProbe:
  httpGet:
    path: /healthz
    port: http-admin
  {{- toYaml $v.livenessProbe | nindent 2 }}
readinessProbe:
  httpGet:
    {{- if $v.sidecar.enabled }}
    # In the gateway's pod readiness is the gateway's: /readyz, which fails while the store is
    # unavailable, would take every route of the gateway out of its Service, fail_mode open or
    # not. /healthz fails only when the process cannot serve at all.
    path: /healthz
    {{- else }}
    path: /readyz
    {{- end }}
    port: http-admin
  {{- toYaml $v.readinessProbe | nindent 2 }}
{{- $preStop := include "idem.preStopSleepSeconds" . | int }}
{{- if gt $preStop 0 }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ $preStop }}
{{- end }}
resources:
  {{- toYaml $v.resources | nindent 2 }}
securityContext:
  {{- toYaml $v.securityContext | nindent 2 }}
volumeMounts:
  - name: policy
    mountPath: /etc/idempotency-extproc
    readOnly: true
  {{- if $v.sidecar.enabled }}
  - name: idempotency-socket
    mountPath: {{ include "idem.socketDir" . }}
  # The gateway's pod mounts its ServiceAccount's token (the gateway may need it); the processor
  # needs none. A mount at the token's path keeps Kubernetes from adding the token to this
  # container.
  - name: no-service-account-token
    mountPath: /var/run/secrets/kubernetes.io/serviceaccount
    readOnly: true
  {{- end }}
  {{- if $v.adminToken.enabled }}
  - name: admin-token
    mountPath: {{ $secretsDir }}/admin-token
    readOnly: true
  {{- end }}
  {{- if $v.recordKeys.enabled }}
  - name: record-keys
    mountPath: {{ $secretsDir }}/record-keys
    readOnly: true
  {{- end }}
  {{- if $v.keyHashSecret.enabled }}
  - name: key-hash-secret
    mountPath: {{ $secretsDir }}/key-hash-secret
    readOnly: true
  {{- end }}
  {{- if and (eq $v.store.type "redis") $v.store.redis.caSecret }}
  - name: redis-ca
    mountPath: {{ $secretsDir }}/redis-ca
    readOnly: true
  {{- end }}
  {{- with $v.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* The processor's preStop sleep: in sidecar mode, the gateway's Envoy drain
(sidecar.envoyGateway or sidecar.istio preStopSleepSeconds), so that the processor closes its
socket only after Envoy stops opening streams on it; else preStopSleepSeconds. */}}
{{- define "idem.preStopSleepSeconds" -}}
{{- $v := .Values -}}
{{- if not $v.sidecar.enabled -}}
{{- int $v.preStopSleepSeconds -}}
{{- else if $v.envoyGateway.enabled -}}
{{- int $v.sidecar.envoyGateway.preStopSleepSeconds -}}
{{- else -}}
{{- int $v.sidecar.istio.preStopSleepSeconds -}}
{{- end -}}
{{- end -}}

{{/* The gateway pod's fsGroup in sidecar mode: the processor lets its group connect to the socket,
and the fsGroup puts Envoy in that group. Without one Envoy cannot connect: the render fails. */}}
{{- define "idem.sidecarFSGroup" -}}
{{- $g := get (.Values.podSecurityContext | default dict) "fsGroup" -}}
{{- if not $g -}}
{{- fail "sidecar.enabled needs podSecurityContext.fsGroup: the processor lets its group connect to the socket, and the fsGroup puts Envoy in that group" -}}
{{- end -}}
{{- int $g -}}
{{- end -}}

{{/* The volumes of the processor's container. */}}
{{- define "idem.processorVolumes" -}}
{{- $v := .Values -}}
- name: policy
  configMap:
    name: {{ include "idem.fullname" . }}-policy
{{- if $v.sidecar.enabled }}
# The unix socket the processor listens on and Envoy connects to.
- name: idempotency-socket
  emptyDir: {}
# Empty, over the processor's ServiceAccount token path.
- name: no-service-account-token
  emptyDir: {}
{{- end }}
{{- range $x := list (list "admin-token" $v.adminToken "token") (list "record-keys" $v.recordKeys "keys") (list "key-hash-secret" $v.keyHashSecret "secret") }}
{{- $name := index $x 0 }}{{- $val := index $x 1 }}{{- $file := index $x 2 }}
{{- if $val.enabled }}
- name: {{ $name }}
  secret:
    secretName: {{ include "idem.fileSecretName" (list $ $val $name) }}
    defaultMode: 0440
    items:
      - key: {{ ternary $val.existingSecretKey $file (ne $val.existingSecret "") }}
        path: {{ $file }}
{{- end }}
{{- end }}
{{- if and (eq $v.store.type "redis") $v.store.redis.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ $v.store.redis.caSecret }}
    defaultMode: 0444
    items:
      - key: {{ $v.store.redis.caSecretKey }}
        path: ca.crt
{{- end }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}
