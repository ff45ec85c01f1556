{{/*
Names. The RayService name is kept short because KubeRay derives the RayCluster, pod
and Service names from it (adding suffixes), and those must stay within 63 characters.
*/}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "baton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "baton.labels" -}}
helm.sh/chart: {{ include "baton.chart" . }}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The pools `mode` deploys, as a comma-separated list (templates split it). */}}
{{- define "baton.roles" -}}
{{- if eq .Values.mode "aggregated" }}aggregated{{ else }}prefill,decode{{ end }}
{{- end }}

{{/*
Checks the schema cannot express (relations between values); fails the render with a
message naming the value. Included once, from the RayService template.
*/}}
{{- define "baton.validate" -}}
{{- range .Values.volumes }}
{{- if has .name (list "dshm" "api-keys") }}
{{- fail (printf "volumes: the name %q is the chart's own (/dev/shm, API keys); rename the volume" .name) }}
{{- end }}
{{- end }}
{{- range .Values.volumeMounts }}
{{- if and ($.Values.sharedMemory | default dict).enabled (eq (trimSuffix "/" .mountPath) "/dev/shm") }}
{{- fail "volumeMounts: /dev/shm is mounted by the chart (sharedMemory); set sharedMemory.enabled=false to mount your own" }}
{{- end }}
{{- end }}
{{- $heads := int .Values.model.numAttentionHeads }}
{{- $kvHeads := int .Values.model.numKeyValueHeads }}
{{- if ne (mod $heads $kvHeads) 0 }}
{{- fail (printf "model.numAttentionHeads (%d) must be a multiple of model.numKeyValueHeads (%d)" $heads $kvHeads) }}
{{- end }}
{{- $ffn := int .Values.model.intermediateSize }}
{{- /* Valid TP degrees (workers/model/config.py, valid_tp_degrees): those dividing the
     query heads and the MLP width that divide the KV heads or are a multiple of them
     (each KV head then replicated). */}}
{{- $valid := list }}
{{- range $d := untilStep 1 (int (add $heads 1)) 1 }}
{{- if and (eq (mod $heads $d) 0) (eq (mod $ffn $d) 0) (or (eq (mod $kvHeads $d) 0) (eq (mod $d $kvHeads) 0)) }}{{ $valid = append $valid $d }}{{ end }}
{{- end }}
{{- include "baton.validateRouter" . }}
{{- $seen := dict }}
{{- range $role := splitList "," (include "baton.roles" .) }}
{{- $pool := index $.Values $role }}
{{- $tp := int $pool.tensorParallelSize }}
{{- if not (has $tp $valid) }}
{{- fail (printf "%s.tensorParallelSize=%d does not fit the model's heads and MLP (model.numAttentionHeads=%d, model.numKeyValueHeads=%d, model.intermediateSize=%d); valid degrees: %s" $role $tp $heads $kvHeads $ffn (join ", " $valid)) }}
{{- end }}
{{- if lt (int $pool.replica.maxNumBatchedTokens) (int $pool.replica.maxNumSeqs) }}
{{- fail (printf "%s.replica.maxNumBatchedTokens (%d) must be >= %s.replica.maxNumSeqs (%d): each running sequence takes a token of a step's budget" $role (int $pool.replica.maxNumBatchedTokens) $role (int $pool.replica.maxNumSeqs)) }}
{{- end }}
{{- if $pool.autoscaling.enabled }}
{{- $min := int $pool.autoscaling.minReplicas }}
{{- $max := int $pool.autoscaling.maxReplicas }}
{{- if gt $min $max }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) must be <= %s.autoscaling.maxReplicas (%d)" $role $min $role $max) }}
{{- end }}
{{- if or (lt (int $pool.replicas) $min) (gt (int $pool.replicas) $max) }}
{{- fail (printf "%s.replicas (%d) is the starting count and must lie within %s.autoscaling.minReplicas..maxReplicas (%d..%d)" $role (int $pool.replicas) $role $min $max) }}
{{- end }}
{{- end }}
{{- $most := dict "name" "replicas" "count" (int $pool.replicas) }}
{{- if $pool.autoscaling.enabled }}
{{- $most = dict "name" "autoscaling.maxReplicas" "count" (int $pool.autoscaling.maxReplicas) }}
{{- end }}
{{- if gt $most.count (int $pool.maxPods) }}
{{- fail (printf "%s.maxPods (%d) must be >= %s.%s (%d): the group's pods are capped there" $role (int $pool.maxPods) $role $most.name $most.count) }}
{{- end }}
{{- if and (not $pool.autoscaling.enabled) (lt (int $pool.replicas) 1) }}
{{- fail (printf "%s.replicas must be >= 1 (got %d), or enable %s.autoscaling to let it scale from zero" $role (int $pool.replicas) $role) }}
{{- end }}
{{- include "baton.validateFit" (dict "role" $role "pool" $pool "tp" $tp) }}
{{- $grace := int (include "baton.gracePeriod" $pool) }}
{{- if le (sub $grace 10) (int $pool.replica.gracefulShutdownTimeoutS) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must exceed %s.replica.gracefulShutdownTimeoutS (%v) by more than 10 s: a stopping pod drains until 10 s before its end, and its replica needs the graceful-shutdown time within that" $role $grace $role $pool.replica.gracefulShutdownTimeoutS) }}
{{- end }}
{{- if has $pool.rayResource (list "CPU" "GPU") }}
{{- fail (printf "%s.rayResource (%s) is Ray's own resource: name a custom one (the pods offer it); CPUs and GPUs come from %s.replica.numCpus and numGpus" $role $pool.rayResource $role) }}
{{- end }}
{{- if hasKey $seen $pool.rayResource }}
{{- fail (printf "%s.rayResource (%s) is also %s.rayResource: each pool needs its own so replicas land on their own pods" $role $pool.rayResource (get $seen $pool.rayResource)) }}
{{- end }}
{{- $_ := set $seen $pool.rayResource $role }}
{{- end }}
{{- end }}

{{/*
Routers kept on the head (router.onHead) stay pending forever where the head cannot hold
them, so refuse that at render time: the head must offer their resource (its own
rayStartParams `resources` would replace it) and CPUs for router.replicas x numCpus (its
`num-cpus` start flag, else its limits, else its requests, rounded up as Ray counts them).
*/}}
{{- define "baton.validateRouter" -}}
{{- $router := .Values.router }}
{{- $head := .Values.head }}
{{- range $name := list "CPU" "GPU" }}
{{- if hasKey ($router.rayResources | default dict) $name }}
{{- fail (printf "router.rayResources.%s is Ray's own resource: set router.numCpus instead (routers take no GPU)" $name) }}
{{- end }}
{{- end }}
{{- if $router.onHead }}
{{- if hasKey $head.rayStartParams "resources" }}
{{- fail "head.rayStartParams.resources would replace the resource the head offers its routers (router.onHead); set router.onHead=false and place the routers with router.rayResources" }}
{{- end }}
{{- $limits := default dict $head.resources.limits }}
{{- $requests := default dict $head.resources.requests }}
{{- $cpu := toString (default (index $requests "cpu") (index $limits "cpu")) }}
{{- $source := "head.resources" }}
{{- if hasKey $head.rayStartParams "num-cpus" }}
{{- $cpu = toString (index $head.rayStartParams "num-cpus") }}
{{- $source = "head.rayStartParams.num-cpus" }}
{{- end }}
{{- if and $cpu (ne $cpu "<nil>") }}
{{- $headCpus := include "baton.cpus" $cpu | float64 }}
{{- $needCpus := mulf $router.replicas $router.numCpus }}
{{- if lt $headCpus $needCpus }}
{{- fail (printf "router.replicas (%v) x router.numCpus (%v) needs %v CPUs on the head (router.onHead) but it has %v (%s): give the head more CPUs, lower router.numCpus, or set router.onHead=false" $router.replicas $router.numCpus $needCpus $headCpus $source) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A Kubernetes CPU quantity ("2", "1500m") as the whole CPUs Ray counts (rounded up). */}}
{{- define "baton.cpus" -}}
{{- ceil (ternary (divf (trimSuffix "m" . | float64) 1000) (float64 .) (hasSuffix "m" .)) }}
{{- end }}

{{/* The router replicas' Ray resources, as JSON: router.rayResources, plus one unit of
the head's baton_router with router.onHead. */}}
{{- define "baton.routerResources" -}}
{{- $resources := deepCopy .Values.router.rayResources }}
{{- if .Values.router.onHead }}
{{- $_ := set $resources "baton_router" 1 }}
{{- end }}
{{- toJson $resources }}
{{- end }}

{{/*
A replica that cannot fit its pod stays pending forever, so refuse it at render time.
The replica takes replica.numCpus; with tensorParallelSize > 1 each TP rank is an actor of
its own taking 1 CPU and, on GPUs, 1 GPU (the replica process then takes none); at TP 1
the replica takes replica.numGpus. Ray counts a pod's CPUs and GPUs from its limits
(requests when there is no limit), rounded up, as this does.
*/}}
{{- define "baton.validateFit" -}}
{{- $role := .role }}
{{- $tp := .tp }}
{{- $r := .pool.replica }}
{{- $limits := default dict .pool.resources.limits }}
{{- $requests := default dict .pool.resources.requests }}
{{- $ranks := ternary $tp 0 (gt $tp 1) }}
{{- $cpu := toString (default (index $requests "cpu") (index $limits "cpu")) }}
{{- if and $cpu (ne $cpu "<nil>") }}
{{- $podCpus := include "baton.cpus" $cpu | float64 }}
{{- $needCpus := addf $r.numCpus $ranks }}
{{- if lt $podCpus $needCpus }}
{{- fail (printf "%s pods have %v CPUs (%s.resources) but one replica needs %v: %s.replica.numCpus=%v plus %d TP ranks at 1 CPU each (%s.tensorParallelSize=%d)" $role $podCpus $role $needCpus $role $r.numCpus $ranks $role $tp) }}
{{- end }}
{{- end }}
{{- if gt (float64 $r.numGpus) 0.0 }}
{{- $podGpus := int (default (index $requests "nvidia.com/gpu") (index $limits "nvidia.com/gpu") | default 0) }}
{{- $needGpus := ternary $tp (int (ceil $r.numGpus)) (gt $tp 1) }}
{{- if lt $podGpus $needGpus }}
{{- fail (printf "%s.replica.numGpus=%v with %s.tensorParallelSize=%d needs %s.resources.limits.nvidia.com/gpu >= %d (got %d)" $role $r.numGpus $role $tp $role $needGpus $podGpus) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
One pool's AppConfig fields (serve_app.config.PoolConfig) but its scale, as JSON. The
replica count and autoscaling are the deployment's overrides (baton.poolScale): Serve
versions every deployment by the application's args, so a count there would restart
every replica of every pool when one pool is rescaled.
*/}}
{{- define "baton.poolArgs" -}}
{{- $pool := index .root.Values .role }}
{{- $r := $pool.replica }}
{{- $args := dict
    "tensor_parallel_size" $pool.tensorParallelSize
    "num_cpus" $r.numCpus
    "num_gpus" $r.numGpus
    "resources" (dict $pool.rayResource 1)
    "kv_cache_bytes" $r.kvCacheBytes
    "max_num_seqs" $r.maxNumSeqs
    "max_num_batched_tokens" $r.maxNumBatchedTokens
    "num_threads" $r.numThreads
    "dtype" $r.dtype
    "max_ongoing_requests" $r.maxOngoingRequests
    "max_queued_requests" $r.maxQueuedRequests
    "speculative_tokens" $r.speculativeTokens
    "activations" $r.activations
    "graceful_shutdown_timeout_s" $r.gracefulShutdownTimeoutS }}
{{- toJson $args }}
{{- end }}

{{/* One pool's Serve deployment override: its replica count or its autoscaling, as JSON
(serve_app.serve_config.serve_config). */}}
{{- define "baton.poolScale" -}}
{{- $pool := index .root.Values .role }}
{{- $names := dict "aggregated" "EngineServer" "prefill" "PrefillServer" "decode" "DecodeServer" }}
{{- $scale := dict "name" (get $names .role) "num_replicas" $pool.replicas }}
{{- if $pool.autoscaling.enabled }}
{{- $a := $pool.autoscaling }}
{{- $_ := set $scale "num_replicas" nil }}
{{- $_ := set $scale "autoscaling_config" (dict
    "min_replicas" $a.minReplicas
    "max_replicas" $a.maxReplicas
    "initial_replicas" $pool.replicas
    "target_ongoing_requests" $a.targetOngoingRequests) }}
{{- end }}
{{- toJson $scale }}
{{- end }}

{{/*
The Serve config (serveConfigV2): exactly what serve_app.serve_config.serve_config()
returns for the AppConfig these values describe. tests/test_helm_chart.py holds the two
to equality, so a change to one must be made in the other.
*/}}
{{- define "baton.serveConfig" -}}
{{- $v := .Values }}
{{- $args := dict
    "model" $v.model.path
    "mode" $v.mode
    "transport" $v.transport
    "block_size" $v.blockSize
    "enable_prefix_caching" $v.enablePrefixCaching
    "handoff_timeout_s" $v.handoffTimeoutS
    "local_prefill_tokens" $v.localPrefillTokens
    "stream_interval" $v.streamInterval
    "router" (dict
      "num_cpus" $v.router.numCpus
      "resources" (include "baton.routerResources" . | fromJson)
      "max_ongoing_requests" $v.router.maxOngoingRequests) }}
{{- if $v.maxPendingPrefills }}
{{- $_ := set $args "max_pending_prefills" $v.maxPendingPrefills }}
{{- end }}
{{- if $v.outputChannel }}
{{- $_ := set $args "output_channel" $v.outputChannel }}
{{- end }}
{{- if $v.registryName }}
{{- $_ := set $args "registry_name" $v.registryName }}
{{- end }}
{{- if $v.model.servedModelName }}
{{- $_ := set $args "served_model_name" $v.model.servedModelName }}
{{- end }}
{{- if $v.model.maxModelLen }}
{{- $_ := set $args "max_model_len" $v.model.maxModelLen }}
{{- end }}
{{- if ($v.apiKey | default dict).secretName }}
{{- $_ := set $args "api_key_file" (include "baton.apiKeyFile" .) }}
{{- end }}
{{- $deployments := list (dict "name" "Router" "num_replicas" $v.router.replicas) }}
{{- range $role := splitList "," (include "baton.roles" .) }}
{{- $_ := set $args $role (include "baton.poolArgs" (dict "root" $ "role" $role) | fromJson) }}
{{- $deployments = append $deployments (include "baton.poolScale" (dict "root" $ "role" $role) | fromJson) }}
{{- end }}
{{- $config := dict
    "proxy_location" "EveryNode"
    "http_options" (dict "host" "0.0.0.0" "port" 8000)
    "grpc_options" (dict
      "port" 9000
      "grpc_servicer_functions" (list
        "serve_app.grpc.servicer.add_baton_servicer_to_server"
        "serve_app.grpc.servicer.add_health_servicer_to_server"
        "serve_app.grpc.reflection.add_reflection_v1_to_server")
      "enable_reflection" true)
    "applications" (list (dict
      "name" "baton"
      "route_prefix" "/"
      "import_path" "serve_app.app:build_app"
      "args" $args
      "deployments" $deployments)) }}
{{- toYaml $config }}
{{- end }}

{{/*
`ray start --resources` for a Ray pod, from a dict of resource units (a pool's pods offer
one unit of the pool's resource, the head the routers' resource), in KubeRay's
rayStartParams form (a JSON object wrapped in escaped double quotes, because KubeRay
pastes the value into a shell command line).
*/}}
{{- define "baton.rayStartResources" -}}
{{- printf "\"%s\"" (toJson . | replace "\"" "\\\"") }}
{{- end }}

{{/*
A Ray container: image, ports, resources, environment, mounts. Takes dict(root, name,
resources, preStop): preStop is the shell command the container runs before it stops.
*/}}
{{- define "baton.container" -}}
- name: {{ .name }}
  image: {{ include "baton.image" .root | quote }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  ports:
    {{- if eq .name "ray-head" }}
    - name: gcs
      containerPort: 6379
    - name: dashboard
      containerPort: 8265
    - name: client
      containerPort: 10001
    {{- end }}
    - name: serve
      containerPort: 8000
    - name: grpc
      containerPort: 9000
    - name: metrics
      containerPort: 8080
  {{- with .resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- /* Serve's ingress settings, as serve_app.ops.service_ops.SERVE_ENV sets them where
  `baton serve` starts Serve (HAProxy in front of the routers' own servers; a Python
  proxy, where one serves, reaching them over gRPC; the gRPC message limit, 16 MiB as
  serve_config.MAX_REQUEST_BYTES; the image's baton-haproxy as HAProxy, which applies
  Baton's ingress policy, serve_app/ingress/), each unless values.env names it. */}}
  {{- $env := .root.Values.env | default list }}
  {{- $named := dict }}
  {{- range $env }}{{- $_ := set $named .name true }}{{- end }}
  {{- $serve := list }}
  {{- $defaults := dict "RAY_SERVE_ENABLE_HA_PROXY" "1" "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE" "16777216" "RAY_SERVE_PROXY_USE_GRPC" "1" "RAY_SERVE_HAPROXY_BINARY_PATH" "/home/ray/anaconda3/bin/baton-haproxy" }}
  {{- range $name, $value := $defaults }}
  {{- if not (hasKey $named $name) }}
  {{- $serve = append $serve (dict "name" $name "value" $value) }}
  {{- end }}
  {{- end }}
  {{- $env = concat $serve $env }}
  env:
    {{- toYaml $env | nindent 4 }}
  {{- $mounts := .root.Values.volumeMounts | default list }}
  {{- if (.root.Values.sharedMemory | default dict).enabled }}
  {{- $mounts = prepend $mounts (dict "name" "dshm" "mountPath" "/dev/shm") }}
  {{- end }}
  {{- if (.root.Values.apiKey | default dict).secretName }}
  {{- $dir := dir (include "baton.apiKeyFile" .root) }}
  {{- $mounts = append $mounts (dict "name" "api-keys" "mountPath" $dir "readOnly" true) }}
  {{- end }}
  {{- with $mounts }}
  volumeMounts:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  lifecycle:
    preStop:
      exec:
        command: ["/bin/sh", "-c", {{ .preStop | quote }}]
{{- end }}

{{/* Where every Ray container finds the API keys Secret (AppConfig.api_key_file): a
whole-volume mount, not a subPath, so Kubernetes updates it in place when the Secret
changes and the router picks the new keys up. */}}
{{- define "baton.apiKeyFile" -}}
/etc/baton/api-keys/keys
{{- end }}

{{/* The volumes of a Ray pod: values.volumes, and the memory-backed /dev/shm. */}}
{{- define "baton.volumes" -}}
{{- $volumes := .Values.volumes | default list }}
{{- with .Values.apiKey }}
{{- if .secretName }}
{{- $items := list (dict "key" (.secretKey | default "api-keys") "path" (base (include "baton.apiKeyFile" $))) }}
{{- $volumes = append $volumes (dict "name" "api-keys" "secret" (dict "secretName" .secretName "items" $items)) }}
{{- end }}
{{- end }}
{{- if (.Values.sharedMemory | default dict).enabled }}
{{- $shm := dict "medium" "Memory" }}
{{- with .Values.sharedMemory.sizeLimit }}{{ $_ := set $shm "sizeLimit" . }}{{ end }}
{{- $volumes = prepend $volumes (dict "name" "dshm" "emptyDir" $shm) }}
{{- end }}
{{- with $volumes }}
volumes:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
A worker pod's stop: `baton drain` has Serve move the pod's replica elsewhere and waits
for its streams, until 10 s before Kubernetes' SIGKILL; then Ray leaves the cluster,
drained or not. Takes the pool; gives its grace period and its preStop command.
*/}}
{{- define "baton.gracePeriod" -}}
{{- default (add (int .replica.gracefulShutdownTimeoutS) 60) .terminationGracePeriodSeconds | int }}
{{- end }}

{{- /* Its output goes to the container's own log (a hook's is otherwise discarded). */}}
{{- define "baton.workerPreStop" -}}
{{- printf "baton drain --deadline-s %d >/proc/1/fd/1 2>&1; ray stop" (sub (int (include "baton.gracePeriod" .)) 10) }}
{{- end }}

{{/* Pod-level scheduling and metadata shared by head and workers. Takes dict(root, group, spec). */}}
{{- define "baton.podMetadata" -}}
labels:
  {{- include "baton.selectorLabels" .root | nindent 2 }}
  app.kubernetes.io/component: {{ .group }}
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "baton.podScheduling" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
