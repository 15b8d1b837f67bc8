{{/* One KubeRay worker group for a role. Both roles go through this one template, so
their value blocks mean the same thing. Call with (dict "ctx" $ "role" "drafter"). */}}
{{- define "chainspec.workerGroup" -}}
{{- $ := .ctx -}}
{{- $role := .role -}}
{{- $v := index $.Values $role -}}
{{- $lo := int $v.minReplicas -}}
{{- $n := int $v.replicas -}}
{{- $hi := int $v.maxReplicas -}}
{{- if $v.autoscaling -}}
{{- if gt $lo $hi -}}
{{- fail (printf "%s: need minReplicas <= maxReplicas, got %d > %d" $role $lo $hi) -}}
{{- end -}}
{{- else if not (and (le $lo $n) (le $n $hi)) -}}
{{- fail (printf "%s: need minReplicas <= replicas <= maxReplicas, got %d <= %d <= %d" $role $lo $n $hi) -}}
{{- end -}}
{{- $pinned := and (include "chainspec.autoscaling" $) (not $v.autoscaling) -}}
- groupName: {{ $role }}
  {{- if not $v.autoscaling }}
  replicas: {{ $v.replicas }}
  {{- end }}
  {{- if $pinned }}
  {{- /* the autoscaler runs for the other role: keep this one at exactly `replicas` */}}
  minReplicas: {{ $v.replicas }}
  maxReplicas: {{ $v.replicas }}
  {{- else }}
  minReplicas: {{ $v.minReplicas }}
  maxReplicas: {{ $v.maxReplicas }}
  {{- end }}
  {{- if $v.autoscaling }}
  idleTimeoutSeconds: {{ $v.idleTimeoutSeconds }}
  {{- end }}
  rayStartParams:
    {{- $own := dict "resources" (include "chainspec.rayResources" (dict $v.rayResource (include "chainspec.actorUnits" $ | int))) }}
    {{- include "chainspec.rayStartParams" (dict "role" $role "own" $own "block" $v) | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "chainspec.labels" (dict "ctx" $ "component" $role) | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "chainspec.serviceAccountName" $ }}
      automountServiceAccountToken: false
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- with $.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "chainspec.podOptions" (dict "ctx" $ "block" $v) | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        # KubeRay runs `ray start` in this container; the role's actor (with the gRPC
        # service) runs inside it once the stack places one here.
        - name: ray-worker
          image: {{ include "chainspec.image" (dict "ctx" $ "block" $v) }}
          imagePullPolicy: {{ include "chainspec.pullPolicy" (dict "ctx" $ "block" $v) }}
          {{- with $v.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $v.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.grpc.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $v.metrics.port }}
              protocol: TCP
          {{- if $v.grpc.probes }}
          {{- $check := include "chainspec.healthCheck" (dict "ctx" $ "port" $v.grpc.port) }}
          startupProbe:
            {{- $check | nindent 12 }}
            periodSeconds: 10
            failureThreshold: {{ add (div $.Values.stack.startTimeoutSeconds 10) 1 }}
          readinessProbe:
            {{- $check | nindent 12 }}
            periodSeconds: 5
            failureThreshold: 2
          {{- if not $v.autoscaling }}
          {{- /* NOTE: an autoscaled pod whose actor was drained away serves no gRPC until
          the autoscaler removes it (idleTimeoutSeconds); liveness would restart it */}}
          livenessProbe:
            {{- $check | nindent 12 }}
            periodSeconds: 10
            failureThreshold: 6
          {{- end }}
          {{- end }}
          {{- if $v.drainOnStop }}
          {{- if le (int $v.terminationGracePeriodSeconds) (int $.Values.stack.drainTimeoutSeconds) }}
          {{- fail (printf "%s.terminationGracePeriodSeconds (%d) must exceed stack.drainTimeoutSeconds (%d): the preStop drain runs within it" $role (int $v.terminationGracePeriodSeconds) (int $.Values.stack.drainTimeoutSeconds)) }}
          {{- end }}
          lifecycle:
            {{- include "chainspec.drainHook" (dict "ctx" $ "role" $role) | nindent 12 }}
          {{- end }}
          env:
            # the preStop drain finds this pod's member by its node IP
            - name: CHAINSPEC_NODE_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- with $v.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- with $v.envFrom }}
          envFrom:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- /* verifiers call drafters; an mTLS probe calls its own pod's service */}}
          {{- $client := or (eq $role "verifier") $v.grpc.probes }}
          {{- $io := dict "ctx" $ "block" $v "server" true "client" $client }}
          {{- with include "chainspec.volumeMounts" $io | trim }}
          volumeMounts:
            {{- . | nindent 12 }}
          {{- end }}
        {{- with $v.sidecars }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with include "chainspec.volumes" $io | trim }}
      volumes:
        {{- . | nindent 8 }}
      {{- end }}
{{- end -}}


{{/* A probe's check of the role's gRPC health (grpc.health.v1) on `port`: kubelet's own
gRPC probe over plaintext; with tls.enabled, which it cannot speak, an exec of
`chainspec health` presenting the stack's client certificate (the services require one).
The module entry skips the other commands' imports: ~0.2 s a probe, not ~2.5 s.
Call with (dict "ctx" $ "port" 50051). */}}
{{- define "chainspec.healthCheck" -}}
{{- $tls := .ctx.Values.tls -}}
{{- if $tls.enabled -}}
{{- $m := $tls.mountPath -}}
exec:
  command:
    - python
    - -m
    - chainspec.commands.health
    - --address
    - {{ printf "127.0.0.1:%d" (int .port) | quote }}
    - --timeout
    - "3"
    - --tls-ca
    - {{ $m }}/server/ca.crt
    - --tls-server-name
    - {{ $tls.serverName | quote }}
    - --tls-cert
    - {{ $m }}/client/tls.crt
    - --tls-key
    - {{ $m }}/client/tls.key
timeoutSeconds: 5
{{- else -}}
grpc:
  port: {{ .port }}
{{- end -}}
{{- end -}}
