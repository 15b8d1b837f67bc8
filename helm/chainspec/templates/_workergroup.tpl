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
{{- if and $v.grpc.probes $.Values.tls.enabled -}}
{{- fail (printf "%s.grpc.probes needs plaintext gRPC: kubelet's gRPC probe cannot speak TLS (tls.enabled)" $role) -}}
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
    resources: {{ include "chainspec.rayResources" (dict $v.rayResource (include "chainspec.actorUnits" $ | int)) | squote }}
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
          startupProbe:
            grpc:
              port: {{ $v.grpc.port }}
            periodSeconds: 10
            failureThreshold: {{ add (div $.Values.stack.startTimeoutSeconds 10) 1 }}
          readinessProbe:
            grpc:
              port: {{ $v.grpc.port }}
            periodSeconds: 5
            failureThreshold: 2
          livenessProbe:
            grpc:
              port: {{ $v.grpc.port }}
            periodSeconds: 10
            failureThreshold: 6
          {{- end }}
          {{- with $v.env }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- $io := dict "ctx" $ "block" $v "server" true "client" (eq $role "verifier") }}
          {{- with include "chainspec.volumeMounts" $io | trim }}
          volumeMounts:
            {{- . | nindent 12 }}
          {{- end }}
      {{- with include "chainspec.volumes" $io | trim }}
      volumes:
        {{- . | nindent 8 }}
      {{- end }}
{{- end -}}
