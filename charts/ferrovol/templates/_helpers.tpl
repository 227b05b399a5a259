{{/*
Names. The release name is the prefix of every object (`ferrovol-controller`, `ferrovol-node`…)
unless it already contains the chart name.
*/}}
{{- define "ferrovol.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ferrovol.backend" -}}
{{- if not (has .Values.backend (list "local" "aws")) -}}
{{- fail (printf "backend must be local or aws, not %q" .Values.backend) -}}
{{- end -}}
{{- .Values.backend -}}
{{- end -}}

{{- define "ferrovol.isLocal" -}}
{{- if eq (include "ferrovol.backend" .) "local" }}true{{ end -}}
{{- end -}}

{{/* The CSI driver name: recorded in every PV, so it must never change on a live cluster. */}}
{{- define "ferrovol.driverName" -}}
{{- if .Values.driverName -}}
{{- .Values.driverName -}}
{{- else if include "ferrovol.isLocal" . -}}
local.csi.ferrovol.dev
{{- else -}}
ebs.csi.ferrovol.dev
{{- end -}}
{{- end -}}

{{- define "ferrovol.startupTaintKey" -}}
{{- .Values.node.startupTaint.key | default (printf "%s/agent-not-ready" (include "ferrovol.driverName" .)) -}}
{{- end -}}

{{/* Leader election only where several replicas of the central controller compete. */}}
{{- define "ferrovol.leaderElection" -}}
{{- if and (not (include "ferrovol.isLocal" .)) (gt (int .Values.controller.replicas) 1) }}true{{ end -}}
{{- end -}}

{{/* A tunable that is either one value or a map with one value per backend. */}}
{{- define "ferrovol.perBackend" -}}
{{- $v := index . 0 -}}
{{- if kindIs "map" $v -}}
{{- index $v (index . 1) -}}
{{- else -}}
{{- $v -}}
{{- end -}}
{{- end -}}

{{- define "ferrovol.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "ferrovol.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The driver's images: <registry>/<repository>:<tag or appVersion>. */}}
{{- define "ferrovol.image" -}}
{{- $img := index .Values.image .component -}}
{{- printf "%s/%s:%s" .Values.image.registry $img.repository ($img.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "ferrovol.sidecarImage" -}}
{{- printf "%s:%s" .image.repository .image.tag -}}
{{- end -}}

{{/* Security context of a sidecar that needs no privilege at all. */}}
{{- define "ferrovol.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/*
Leader election flags shared by every central sidecar. Lease timings: see controller.leaderElection
in values.yaml.
*/}}
{{- define "ferrovol.leaderElectionArgs" -}}
{{- if include "ferrovol.leaderElection" . }}
- --leader-election
- --leader-election-lease-duration={{ .Values.controller.leaderElection.leaseDuration }}
- --leader-election-renew-deadline={{ .Values.controller.leaderElection.renewDeadline }}
- --leader-election-retry-period={{ .Values.controller.leaderElection.retryPeriod }}
{{- end }}
{{- end -}}

{{/* A leader that cannot renew its lease is killed (csi-lib-utils recommends this probe). */}}
{{- define "ferrovol.leaderElectionProbe" -}}
{{- if include "ferrovol.leaderElection" .root }}
livenessProbe:
  httpGet:
    path: /healthz/leader-election
    port: {{ .port }}
  initialDelaySeconds: 10
  timeoutSeconds: 10
  periodSeconds: 20
  failureThreshold: 3
{{- end }}
{{- end -}}

{{- define "ferrovol.downwardEnv" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end -}}

{{/*
The service account of the pod that runs the controller sidecars: the central Deployment's (aws)
or the node DaemonSet's (local, distributed provisioning).
*/}}
{{- define "ferrovol.sidecarServiceAccount" -}}
{{- if include "ferrovol.isLocal" . -}}
{{- include "ferrovol.fullname" . }}-node
{{- else -}}
{{- include "ferrovol.fullname" . }}-controller
{{- end -}}
{{- end -}}

{{/* A ClusterRoleBinding (and, with namespaced rules, a Role + RoleBinding) for one sidecar. */}}
{{- define "ferrovol.bindings" -}}
{{- $root := .root -}}
{{- $name := printf "%s-%s" (include "ferrovol.fullname" $root) .sidecar -}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {{ $name }}
  labels:
    {{- include "ferrovol.labels" $root | nindent 4 }}
subjects:
  - kind: ServiceAccount
    name: {{ .serviceAccount }}
    namespace: {{ $root.Release.Namespace }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ $name }}
{{- if .namespacedRules }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "ferrovol.labels" $root | nindent 4 }}
rules:
  {{- .namespacedRules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "ferrovol.labels" $root | nindent 4 }}
subjects:
  - kind: ServiceAccount
    name: {{ .serviceAccount }}
    namespace: {{ $root.Release.Namespace }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {{ $name }}
{{- end }}
{{- end -}}

{{/* Leader election leases (central sidecars with more than one replica only). */}}
{{- define "ferrovol.leaseRules" -}}
{{- if include "ferrovol.leaderElection" . }}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "watch", "list", "delete", "update", "create"]
{{- end }}
{{- end -}}
