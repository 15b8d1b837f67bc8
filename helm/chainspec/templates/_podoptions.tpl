{{/* The pod options every pod block (head, verifier, drafter, gateway) shares, as KubeRay
and production-stack users expect them: priorityClassName, runtimeClassName,
topologySpreadConstraints and initContainers (pod spec fields, at the pod spec's
indentation); the block's sidecars go after its main container, envFrom into it.
The model's fetch-model init container (model.source hub) runs before the block's own.
Call with (dict "ctx" $ "block" .Values.<role>). */}}
{{- define "chainspec.podOptions" -}}
{{- $b := .block -}}
{{- with $b.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $b.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $b.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $fetch := include "chainspec.modelFetch" . | trim }}
{{- if or $fetch $b.initContainers }}
initContainers:
  {{- with $fetch }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- with $b.initContainers }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* A Ray pod's /dev/shm: a memory-backed emptyDir, which Ray's object store needs (the
container runtime's default is 64 MiB). Blocks without `shm` (the gateway) get none. */}}
{{- define "chainspec.shmVolume" -}}
{{- if and .shm .shm.enabled }}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with .shm.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- end -}}

{{- define "chainspec.shmMount" -}}
{{- if and .shm .shm.enabled }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- end -}}

{{/* A Ray group's rayStartParams: the chart's own (a dict) and the block's extraArgs (more
`ray start` flags); an extraArgs key the chart sets is an error, not an override.
Call with (dict "role" "drafter" "own" (dict ...) "block" $v). */}}
{{- define "chainspec.rayStartParams" -}}
{{- range $k, $_ := .block.extraArgs }}
{{- if hasKey $.own $k }}
{{- fail (printf "%s.extraArgs: %q is set by the chart" $.role $k) }}
{{- end }}
{{- end }}
{{- toYaml (merge (dict) .own (.block.extraArgs | default dict)) }}
{{- end -}}

{{/* A worker's preStop hook: drain the member on this pod (`chainspec drain --self`)
before the pod stops, e.g. when `helm upgrade` lowers `replicas`; it returns once the
member is gone (its sequences moved, its calls finished), or at once when the pod hosts
none. Call with (dict "ctx" $ "role" "drafter"). */}}
{{- define "chainspec.drainHook" -}}
preStop:
  exec:
    command:
      - chainspec
      - drain
      - --self
      - --role
      - {{ .role }}
      - --address
      - {{ include "chainspec.rayAddress" .ctx }}
      - --namespace
      - {{ .ctx.Values.stack.rayNamespace }}
{{- end -}}
