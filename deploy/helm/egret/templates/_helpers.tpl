{{/*
Names and labels of every object, in one place. Object names are
"<fullname>-gateway", "<fullname>-node"...; <fullname> is the release name when
it contains the chart name (release "egret": "egret-gateway", as in
deploy/manifests/), else "<release>-<chart>" (release "edge": "edge-egret-gateway").
It is cut at 47 characters so that the longest name, "<fullname>-gateway-metrics"
(a Service: a DNS label), stays within 63.
*/}}

{{- define "egret.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "egret.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "egret.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The gateway's objects: DaemonSet, ServiceAccount, ClusterRole(Binding), ConfigMap, Service. */}}
{{- define "egret.gatewayName" -}}
{{ include "egret.fullname" . }}-gateway
{{- end }}

{{/* The gateway's Role and RoleBinding for Leases. */}}
{{- define "egret.leasesName" -}}
{{ include "egret.fullname" . }}-gateway-leases
{{- end }}

{{/* The Secret holding the peer channel's key: ha.existingSecret, or the chart's own. */}}
{{- define "egret.haSecretName" -}}
{{- if .Values.ha.existingSecret }}
{{- .Values.ha.existingSecret }}
{{- else }}
{{- include "egret.fullname" . }}-ha
{{- end }}
{{- end }}

{{/* Where the gateway container mounts that Secret (not under /etc/egret, the ConfigMap's read-only volume). */}}
{{- define "egret.haKeyDir" -}}
/etc/egret-ha
{{- end }}

{{/* The node agent's objects. */}}
{{- define "egret.nodeName" -}}
{{ include "egret.fullname" . }}-node
{{- end }}

{{- define "egret.gatewayServiceAccountName" -}}
{{ include "egret.gatewayName" . }}
{{- end }}

{{- define "egret.nodeServiceAccountName" -}}
{{ include "egret.nodeName" . }}
{{- end }}

{{- define "egret.selectorLabels" -}}
app.kubernetes.io/name: {{ include "egret.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "egret.labels" -}}
helm.sh/chart: {{ include "egret.chart" . }}
{{ include "egret.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* repository:tag, or repository@digest when image.digest is set. */}}
{{- define "egret.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The gateway's configuration file: .Values.config with the keys the chart
owns. The Leases live in the release namespace (its Role grants them there);
a different kubernetes.leaseNamespace in the values is refused.
*/}}
{{- define "egret.gatewayConfig" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $k8s := default (dict) $cfg.kubernetes }}
{{- if and $k8s.leaseNamespace (ne $k8s.leaseNamespace .Release.Namespace) }}
{{- fail (printf "config.kubernetes.leaseNamespace (%s) must be the release namespace (%s): leave it out, the chart sets it" $k8s.leaseNamespace .Release.Namespace) }}
{{- end }}
{{- if and $cfg.metrics $cfg.metrics.listen }}
{{- fail "config.metrics.listen: leave it out, the chart sets --metrics-listen from metrics.port" }}
{{- end }}
{{- if $k8s.clusterPodCIDRs }}
{{- fail "config.kubernetes.clusterPodCIDRs: leave it out, the chart sets it from cluster.podCIDRs (which the node agent takes too)" }}
{{- end }}
{{- if $k8s.gatewaySelector }}
{{- fail "config.kubernetes.gatewaySelector: leave it out, the chart sets it from cluster.gatewayLabel (which places the DaemonSets too)" }}
{{- end }}
{{- include "egret.checkCluster" . }}
{{- $_ := set $k8s "clusterPodCIDRs" .Values.cluster.podCIDRs }}
{{- $_ := set $k8s "gatewaySelector" (include "egret.gatewaySelector" .) }}
{{- if $k8s.ha }}
{{- fail "config.kubernetes.ha: leave it out, the chart sets it from ha.* (ha.enabled, ha.port, ha.existingSecret, ha.liveness, ha.resyncPeriod)" }}
{{- end }}
{{- if .Values.ha.enabled }}
{{- $keyDir := include "egret.haKeyDir" . }}
{{- $ha := dict "port" (int .Values.ha.port) "keyFile" (printf "%s/key" $keyDir) "acceptKeyFiles" (list (printf "%s/next" $keyDir) (printf "%s/previous" $keyDir)) "peerCache" "/run/egret/peers" }}
{{- if .Values.ha.liveness }}
{{- $_ := set $ha "liveness" .Values.ha.liveness }}
{{- end }}
{{- if .Values.ha.resyncPeriod }}
{{- $_ := set $ha "resyncPeriod" .Values.ha.resyncPeriod }}
{{- end }}
{{- $_ := set $k8s "ha" $ha }}
{{- end }}
{{- $_ := set $k8s "leaseNamespace" .Release.Namespace }}
{{- $_ := set $cfg "kubernetes" $k8s }}
{{- toYaml $cfg }}
{{- end }}

{{/* The gateway label as a label selector: key=value. */}}
{{- define "egret.gatewaySelector" -}}
{{- $l := .Values.cluster.gatewayLabel -}}
{{- printf "%s=%s" (required "cluster.gatewayLabel.key is required" $l.key) (required "cluster.gatewayLabel.value is required" $l.value) -}}
{{- end }}

{{/* cluster.podCIDRs and cluster.serviceCIDRs are lists (fails naming the value); prints nothing. */}}
{{- define "egret.checkCluster" -}}
{{- if not (and (kindIs "slice" .Values.cluster.podCIDRs) .Values.cluster.podCIDRs) }}
{{- fail (printf "cluster.podCIDRs: %v: a non-empty list of the cluster's pod CIDRs is required (e.g. [10.244.0.0/16])" .Values.cluster.podCIDRs) }}
{{- end }}
{{- if not (kindIs "slice" (default (list) .Values.cluster.serviceCIDRs)) }}
{{- fail (printf "cluster.serviceCIDRs: %v: a list of the cluster's Service CIDRs is required (e.g. [10.96.0.0/12])" .Values.cluster.serviceCIDRs) }}
{{- end }}
{{- end }}

{{/* The node agent's --cluster-cidr: the pod and Service CIDRs. */}}
{{- define "egret.clusterCIDRs" -}}
{{- include "egret.checkCluster" . }}
{{- if .Values.node.clusterCIDRs }}
{{- fail "node.clusterCIDRs was replaced by cluster.podCIDRs and cluster.serviceCIDRs (lists), which the gateways take too" }}
{{- end }}
{{- concat .Values.cluster.podCIDRs (default (list) .Values.cluster.serviceCIDRs) | join "," -}}
{{- end }}

{{/* The translation logs' journal directory when config.translationLogs
keeps one (on unless translationLogs or its journal says enabled: false;
docs/operations.md, "Translation logs"), else nothing. The root filesystem
is read-only: the gateway writes it on a hostPath of the Node's, which also
keeps it across restarts of the pod. */}}
{{- define "egret.journalDir" -}}
{{- $tl := .Values.config.translationLogs -}}
{{- if kindIs "map" $tl -}}
{{- $journal := default (dict) $tl.journal -}}
{{- if and (ne (toString (dig "enabled" true $tl)) "false") (ne (toString (dig "enabled" true $journal)) "false") -}}
{{- dig "dir" "/var/lib/egret/translog" $journal -}}
{{- end -}}
{{- end -}}
{{- end }}
