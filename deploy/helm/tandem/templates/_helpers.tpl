{{/* The resources' name prefix: the release name, or <release>-tandem when the release name lacks "tandem". */}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels of one component (head, prefill, decode): pass (list $ "head"). */}}
{{- define "tandem.selector" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ $.Chart.Name }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* All labels of one component. */}}
{{- define "tandem.labels" -}}
{{ include "tandem.selector" . }}
{{- $ := index . 0 }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ $.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" $.Chart.Name $.Chart.Version }}
{{- end -}}

{{/* A pool's settings: workers, then the pool's own keys (prefill: or decode:) over them. */}}
{{- define "tandem.pool" -}}
{{- $ := index . 0 -}}
{{- $role := index . 1 -}}
{{- toYaml (mustMergeOverwrite (deepCopy $.Values.workers) (omit (deepCopy (index $.Values $role)) "replicas")) -}}
{{- end -}}

{{/* The DNS name the head resolves for a pool: its headless Service and RPC port. */}}
{{- define "tandem.discovery" -}}
{{- $ := index . 0 -}}
{{- $role := index . 1 -}}
{{- $w := include "tandem.pool" (list $ $role) | fromYaml -}}
{{- printf "%s-%s:%v" (include "tandem.fullname" $) $role $w.rpcPort -}}
{{- end -}}

{{/* The head's tandem config. */}}
{{- define "tandem.config" -}}
{{- $ := . -}}
{{- $cfg := dict
  "model" $.Values.model.path
  "server" (dict "host" "0.0.0.0" "port" ($.Values.head.port | int))
  "engine" $.Values.engine
  "deployment" (dict
    "mode" "pd"
    "prefill" (dict "replicas" 0)
    "decode" (dict "replicas" 0)
    "discovery" (dict "mode" "dns"
      "prefill" (include "tandem.discovery" (list $ "prefill"))
      "decode" (include "tandem.discovery" (list $ "decode"))
      "interval_secs" $.Values.discovery.intervalSecs)
    "kv_transfer" $.Values.kvTransfer) -}}
{{- toYaml (mustMergeOverwrite $cfg (deepCopy $.Values.extra)) -}}
{{- end -}}

{{/* The Secret holding the cluster token: the one named in values, else the chart's own. */}}
{{- define "tandem.clusterTokenSecret" -}}
{{- default (printf "%s-cluster-token" (include "tandem.fullname" .)) .Values.clusterToken.existingSecret -}}
{{- end -}}

{{/* The env entry that gives a container the cluster token from its Secret. */}}
{{- define "tandem.clusterTokenEnv" -}}
- name: TANDEM_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "tandem.clusterTokenSecret" . }}, key: {{ .Values.clusterToken.key }}}
{{- end -}}

{{/* The Secret holding the cluster TLS files: the one named in values, else the one cert-manager makes. */}}
{{- define "tandem.clusterTlsSecret" -}}
{{- default (printf "%s-cluster-tls" (include "tandem.fullname" .)) .Values.clusterTls.existingSecret -}}
{{- end -}}

{{/* With cluster TLS on, the env entries naming the mounted files (empty otherwise). */}}
{{- define "tandem.clusterTlsEnv" -}}
{{- if .Values.clusterTls.enabled }}
{{- if not (or .Values.clusterTls.existingSecret .Values.clusterTls.certManager.enabled) }}
{{- fail "clusterTls.enabled needs clusterTls.existingSecret or clusterTls.certManager.enabled" }}
{{- end }}
- {name: TANDEM_CLUSTER_TLS_CA, value: /etc/tandem-tls/ca.crt}
- {name: TANDEM_CLUSTER_TLS_CERT, value: /etc/tandem-tls/tls.crt}
- {name: TANDEM_CLUSTER_TLS_KEY, value: /etc/tandem-tls/tls.key}
- {name: TANDEM_CLUSTER_TLS_SERVER_NAME, value: {{ .Values.clusterTls.serverName | quote }}}
{{- end }}
{{- end -}}

{{/* With cluster TLS on, the volume of its Secret, named cluster-tls (empty otherwise). */}}
{{- define "tandem.clusterTlsVolume" -}}
{{- if .Values.clusterTls.enabled }}
- name: cluster-tls
  secret:
    secretName: {{ include "tandem.clusterTlsSecret" . }}
{{- end }}
{{- end -}}

{{/* With cluster TLS on, its volume's mount (empty otherwise). */}}
{{- define "tandem.clusterTlsMount" -}}
{{- if .Values.clusterTls.enabled }}
- {name: cluster-tls, mountPath: /etc/tandem-tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* How a worker's probe asks /health: an HTTP GET, or under cluster TLS `tandem probe` in the pod with the
cluster certificate (the kubelet has none). Takes (list $ port). */}}
{{- define "tandem.workerProbe" -}}
{{- $ := index . 0 -}}
{{- $port := index . 1 -}}
{{- if $.Values.clusterTls.enabled }}
exec:
  command: [tandem, probe, "https://127.0.0.1:{{ $port }}/health"]
{{- else }}
httpGet: {path: /health, port: rpc}
{{- end }}
{{- end -}}

{{/* The model volume, named models: the PVC or the node folder. */}}
{{- define "tandem.modelVolume" -}}
- name: models
{{- if eq .Values.model.volume.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.volume.claimName }}
    readOnly: true
{{- else if eq .Values.model.volume.type "hostPath" }}
  hostPath:
    path: {{ .Values.model.volume.hostPath }}
    type: Directory
{{- else }}
{{- fail (printf "model.volume.type must be pvc or hostPath, not %q" .Values.model.volume.type) }}
{{- end }}
{{- end -}}
