{{/* Names. The RayCluster is named fullname; KubeRay caps it at 53 characters and
suffixes services (-head-svc), so fullname stays at 40. */}}
{{- define "chainspec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "chainspec.fullname" -}}
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

{{- define "chainspec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "chainspec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "chainspec.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels. Call with (dict "ctx" $ "component" "drafter"). */}}
{{- define "chainspec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "chainspec.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "chainspec.labels" -}}
helm.sh/chart: {{ include "chainspec.chart" .ctx }}
{{ include "chainspec.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: chainspec
{{- end -}}

{{/* Labels of objects that belong to the whole release (no component). */}}
{{- define "chainspec.releaseLabels" -}}
helm.sh/chart: {{ include "chainspec.chart" . }}
app.kubernetes.io/name: {{ include "chainspec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: chainspec
{{- end -}}

{{/* Every pod of this release (NetworkPolicy peers). */}}
{{- define "chainspec.releasePodLabels" -}}
app.kubernetes.io/name: {{ include "chainspec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* image for a block with an optional `image` override: (dict "ctx" $ "block" .Values.x) */}}
{{- define "chainspec.image" -}}
{{- $img := .ctx.Values.image -}}
{{- $own := .block.image | default dict -}}
{{- $repo := $own.repository | default $img.repository -}}
{{- $tag := $own.tag | default $img.tag | default .ctx.Chart.AppVersion -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "chainspec.pullPolicy" -}}
{{- $own := .block.image | default dict -}}
{{- $own.pullPolicy | default .ctx.Values.image.pullPolicy -}}
{{- end -}}

{{/* The Ray address the gateway joins: Ray Client on KubeRay's head service. */}}
{{- define "chainspec.rayAddress" -}}
{{- printf "ray://%s-head-svc:%d" (include "chainspec.fullname" .) (int .Values.head.ports.client) -}}
{{- end -}}

{{/* The model directory inside the pods; "" = the image's bundled demo model. A Hub
model's is a link the fetch-model init container makes (model.dir, default "model"). */}}
{{- define "chainspec.modelDir" -}}
{{- if ne .Values.model.source "bundled" -}}
{{- $dir := .Values.model.dir | default (eq .Values.model.source "hub" | ternary "model" "") -}}
{{- if $dir -}}
{{- printf "%s/%s" (.Values.model.mountPath | trimSuffix "/") ($dir | trimPrefix "/") -}}
{{- else -}}
{{- .Values.model.mountPath -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The model volume (none for the bundled model). */}}
{{- define "chainspec.modelVolume" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else if eq .Values.model.source "hub" }}
- name: model
  {{- with .Values.model.hub.pvc.claimName }}
  persistentVolumeClaim:
    claimName: {{ . }}
  {{- else }}
  emptyDir:
    {{- with .Values.model.hub.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* model.source hub: the init container that downloads the Hub model into the model
volume before a pod's containers start (models/hub.py fetch_model: a Hugging Face cache
in <mountPath>/hub, the model dir a link to its snapshot); every pod that mounts the
model runs it. With hub.pvc the pods share one cache: a model already there is not
downloaded again. (dict "ctx" $ "block" .Values.<role>) */}}
{{- define "chainspec.modelFetch" -}}
{{- $m := .ctx.Values.model -}}
{{- if eq $m.source "hub" }}
- name: fetch-model
  image: {{ include "chainspec.image" . }}
  imagePullPolicy: {{ include "chainspec.pullPolicy" . }}
  command: ["python", "-c", "import sys; from chainspec.models.hub import fetch_model; print(fetch_model(*sys.argv[1:]))"]
  args:
    - {{ required "model.hub.id (org/name) is required when model.source is hub" $m.hub.id | quote }}
    - {{ $m.hub.revision | quote }}
    - {{ include "chainspec.modelDir" .ctx | quote }}
    - {{ printf "%s/hub" ($m.mountPath | trimSuffix "/") | quote }}
  env:
    - name: HF_HOME  # huggingface_hub's own files, in the volume (the image's HOME may be read-only)
      value: {{ printf "%s/.huggingface" ($m.mountPath | trimSuffix "/") | quote }}
    {{- with $m.hub.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $m.hub.tokenSecret.key }}
    {{- end }}
  {{- with .block.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- end -}}

{{/* The name clients send: model.name, else a Hub model's id ("" = the verifiers'). */}}
{{- define "chainspec.modelName" -}}
{{- if .Values.model.name -}}
{{- .Values.model.name -}}
{{- else if eq .Values.model.source "hub" -}}
{{- .Values.model.hub.id -}}
{{- end -}}
{{- end -}}

{{- define "chainspec.modelMount" -}}
{{- if ne .Values.model.source "bundled" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* TLS volumes/mounts for a pod: (dict "ctx" $ "server" bool "client" bool) */}}
{{- define "chainspec.tlsVolumes" -}}
{{- $tls := .ctx.Values.tls -}}
{{- if $tls.enabled }}
{{- if .server }}
- name: tls-server
  secret:
    secretName: {{ required "tls.serverSecretName is required when tls.enabled" $tls.serverSecretName }}
    defaultMode: 0440
{{- end }}
{{- if .client }}
- name: tls-client
  secret:
    secretName: {{ required "tls.clientSecretName is required when tls.enabled" $tls.clientSecretName }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end -}}

{{- define "chainspec.tlsMounts" -}}
{{- $tls := .ctx.Values.tls -}}
{{- if $tls.enabled }}
{{- if .server }}
- name: tls-server
  mountPath: {{ $tls.mountPath }}/server
  readOnly: true
{{- end }}
{{- if .client }}
- name: tls-client
  mountPath: {{ $tls.mountPath }}/client
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{/* Number of GPUs a role's pod asks for (its actor takes them all). */}}
{{- define "chainspec.gpus" -}}
{{- $limits := (.resources | default dict).limits | default dict -}}
{{- index $limits "nvidia.com/gpu" | default 0 -}}
{{- end -}}

{{/* A role's tensor-parallel size (its member's ranks, all in one pod), refused where it
cannot work: a GPU pod must have exactly one GPU per rank (fewer: ranks without a device;
more: GPUs the actor holds idle), and the size must shard the model's heads when the
chart knows them (models/tensor_parallel.py head_split: divide the attention heads and
the KV heads, or be a multiple of fewer KV heads, which are replicated). The power of two
is the schema's. Call with (dict "ctx" $ "role" "verifier"). */}}
{{- define "chainspec.tensorParallel" -}}
{{- $v := index .ctx.Values .role -}}
{{- $tp := int ($v.tensorParallelSize | default 1) -}}
{{- $gpus := int (include "chainspec.gpus" $v) -}}
{{- if and (gt $gpus 0) (ne $gpus $tp) -}}
{{- fail (printf "%s.tensorParallelSize %d needs %d GPUs in the pod (one per rank), but %s.resources.limits nvidia.com/gpu is %d" .role $tp $tp .role $gpus) -}}
{{- end -}}
{{- $m := .ctx.Values.model -}}
{{- with $m.numAttentionHeads -}}
{{- if mod (int .) $tp -}}
{{- fail (printf "%s.tensorParallelSize %d does not divide model.numAttentionHeads %d" $.role $tp (int .)) -}}
{{- end -}}
{{- end -}}
{{- with $m.numKeyValueHeads -}}
{{- $kv := int . -}}
{{- if and (ge $kv $tp) (mod $kv $tp) -}}
{{- fail (printf "%s.tensorParallelSize %d does not divide model.numKeyValueHeads %d" $.role $tp $kv) -}}
{{- else if and (lt $kv $tp) (mod $tp $kv) -}}
{{- fail (printf "%s.tensorParallelSize %d is not a multiple of model.numKeyValueHeads %d (fewer KV heads than ranks are replicated)" $.role $tp $kv) -}}
{{- end -}}
{{- end -}}
{{- $tp -}}
{{- end -}}

{{/* KubeRay rayStartParams `resources`: a JSON map in double quotes, as ray start wants. */}}
{{- define "chainspec.rayResources" -}}
{{- printf "\"%s\"" (toJson . | replace "\"" "\\\"") -}}
{{- end -}}

{{/* Units of its role's Ray resource that one drafter/verifier actor asks for. A worker
pod offers exactly this (one actor per pod); the head offers one unit less, so the
cluster always declares the resource -- the controller asks for it only then
(cluster/controller.py role_resources) -- yet can never place a role on the head.
Ray wants whole numbers for node resources, hence 2 and 1 rather than 1 and 0.001. */}}
{{- define "chainspec.actorUnits" -}}2{{- end -}}

{{/* Whether each verifier drafts in its own process (drafter.mode local): then nothing
of the drafter role is rendered. Also refuses values that cannot mean anything. */}}
{{- define "chainspec.drafterLocal" -}}
{{- if hasKey .Values.verifier "mode" -}}
{{- fail "verifier.mode: only the drafter role has a mode (drafter.mode)" -}}
{{- end -}}
{{- if eq (.Values.drafter.mode | default "remote") "local" -}}
{{- if .Values.drafter.autoscaling -}}
{{- fail "drafter.autoscaling needs drafter.mode remote: with local there are no drafter pods" -}}
{{- end -}}
{{- if gt (int (.Values.drafter.tensorParallelSize | default 1)) 1 -}}
{{- fail "drafter.tensorParallelSize > 1 needs drafter.mode remote: a local drafter runs at TP=1 inside the verifier's rank 0" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the controller autoscales the drafter actors (drafter.autoscale.enabled).
Refuses it where it cannot work: with no drafter actors (mode local), or without the Ray
autoscaler, which adds the pod each new drafter actor waits for and removes the idle pod
of a drained one. */}}
{{- define "chainspec.drafterAutoscale" -}}
{{- $d := .Values.drafter -}}
{{- $a := $d.autoscale | default dict -}}
{{- if $a.enabled -}}
{{- if eq ($d.mode | default "remote") "local" -}}
{{- fail "drafter.autoscale.enabled needs drafter.mode remote: with local each verifier drafts in its own process and there are no drafter actors to scale" -}}
{{- end -}}
{{- if not $d.autoscaling -}}
{{- fail "drafter.autoscale.enabled needs drafter.autoscaling: true (the Ray autoscaler adds a drafter pod for each drafter actor the controller starts and removes idle ones); set drafter.autoscaling=true" -}}
{{- end -}}
{{- if lt (float64 $a.draftWaitHighSeconds) (float64 $a.draftWaitLowSeconds) -}}
{{- fail "drafter.autoscale: need draftWaitLowSeconds <= draftWaitHighSeconds" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* A number as PyYAML reads it: never in exponent form (YAML 1.1 reads 5e-05 as a
string), e.g. a threshold in seconds for the stack config. */}}
{{- define "chainspec.number" -}}
{{- $text := toString . -}}
{{- if contains "e" $text -}}{{ printf "%f" (float64 .) }}{{- else -}}{{ $text }}{{- end -}}
{{- end -}}

{{/* The head's ports, each once: KubeRay, Ray and the controller each bind their own. */}}
{{- define "chainspec.headPorts" -}}
{{- $p := .Values.head.ports -}}
{{- $all := list (int $p.gcs) (int $p.dashboard) (int $p.client) (int $p.metrics) (int $p.controllerMetrics) -}}
{{- if ne (len ($all | uniq)) (len $all) -}}
{{- fail (printf "head.ports: every port must differ, got %s" (toJson $p)) -}}
{{- end -}}
{{- end -}}

{{/* The roles with worker pods: verifier, and drafter unless drafting is local. */}}
{{- define "chainspec.podRoles" -}}
{{- if include "chainspec.drafterLocal" . -}}verifier{{- else -}}verifier drafter{{- end -}}
{{- end -}}

{{/* Whether Ray's autoscaler runs (any role autoscaled). */}}
{{- define "chainspec.autoscaling" -}}
{{- if or .Values.drafter.autoscaling .Values.verifier.autoscaling -}}true{{- end -}}
{{- end -}}

{{/* A pod's volumes and a container's mounts: the model, TLS secrets and the block's
extras. (dict "ctx" $ "block" .Values.x "server" bool "client" bool) */}}
{{- define "chainspec.volumes" -}}
{{- include "chainspec.modelVolume" .ctx -}}
{{- include "chainspec.tlsVolumes" . -}}
{{- include "chainspec.shmVolume" .block -}}
{{- with .block.extraVolumes }}
{{ toYaml . }}
{{- end -}}
{{- end -}}

{{- define "chainspec.volumeMounts" -}}
{{- include "chainspec.modelMount" .ctx -}}
{{- include "chainspec.tlsMounts" . -}}
{{- include "chainspec.shmMount" .block -}}
{{- with .block.extraVolumeMounts }}
{{ toYaml . }}
{{- end -}}
{{- end -}}
