{{/* Names ---------------------------------------------------------------------------- */}}

{{- define "tidal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object name prefix. Kept to 40 characters so "-operator-kopf-scanning" still fits 63. */}}
{{- define "tidal.fullname" -}}
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

{{- define "tidal.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tidal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tidal
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "router"). */}}
{{- define "tidal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tidal.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tidal.operator.serviceAccountName" -}}
{{- default (printf "%s-operator" (include "tidal.fullname" .)) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{- define "tidal.router.serviceAccountName" -}}
{{- default (printf "%s-router" (include "tidal.fullname" .)) .Values.router.serviceAccount.name -}}
{{- end -}}

{{/* Images -------------------------------------------------------------------------------- */}}

{{- define "tidal.operator.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{- define "tidal.router.image" -}}
{{- $repo := default .Values.operator.image.repository .Values.router.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.operator.image.tag) .Values.router.image.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "tidal.engine.image" -}}
{{- printf "%s:%s" .Values.engine.image.repository (default .Chart.AppVersion .Values.engine.image.tag) -}}
{{- end -}}

{{/* Scope ------------------------------------------------------------------------------- */}}

{{/* "true" in cluster-wide mode, "" in namespaced mode; fails on anything else. */}}
{{- define "tidal.clusterWide" -}}
{{- if eq .Values.rbac.scope "cluster" -}}
true
{{- else if ne .Values.rbac.scope "namespaced" -}}
{{- fail (printf "rbac.scope must be \"cluster\" or \"namespaced\", not %q" .Values.rbac.scope) -}}
{{- end -}}
{{- end -}}

{{/* The watched namespace (namespaced mode) as a JSON list; use with fromJsonArray. One at most:
the operator's TIDAL_NAMESPACE and the router's --namespace each take one. */}}
{{- define "tidal.watchNamespaces" -}}
{{- $ns := .Values.rbac.watchNamespaces | default (list .Release.Namespace) -}}
{{- if gt (len $ns) 1 -}}
{{- fail "rbac.watchNamespaces: the operator and the router watch one namespace or all of them; list one namespace, or use rbac.scope=cluster" -}}
{{- end -}}
{{- toJson $ns -}}
{{- end -}}

{{/* Namespaces where engine Pods run, for the NetworkPolicy and PodMonitor. */}}
{{- define "tidal.engineNamespaces" -}}
{{- if .Values.networkPolicy.engineNamespaces -}}
{{- toJson .Values.networkPolicy.engineNamespaces -}}
{{- else if include "tidal.clusterWide" . -}}
{{- toJson (list .Release.Namespace) -}}
{{- else -}}
{{- include "tidal.watchNamespaces" . -}}
{{- end -}}
{{- end -}}

{{- define "tidal.peering.enabled" -}}
{{- if or .Values.operator.peering.enabled (gt (int .Values.operator.replicas) 1) -}}
true
{{- end -}}
{{- end -}}

{{- define "tidal.peering.name" -}}
{{- default (include "tidal.fullname" .) .Values.operator.peering.name -}}
{{- end -}}

{{/* Router API-key Secret ---------------------------------------------------------------- */}}

{{- define "tidal.router.apiKeySecret" -}}
{{- default (printf "%s-router-api-key" (include "tidal.fullname" .)) .Values.router.apiKey.existingSecret -}}
{{- end -}}

{{- define "tidal.router.url" -}}
{{- printf "http://%s-router.%s.svc:%d" (include "tidal.fullname" .) .Release.Namespace (int .Values.router.service.port) -}}
{{- end -}}

{{/* RBAC rules ------------------------------------------------------------------------------
The one place the chart's permissions are written. tests/install/test_chart.py holds them
against the API calls the operator (kopf included) and the router make: nothing missing,
nothing extra. */}}

{{/* The operator, in every namespace it serves (a Role there, or part of its ClusterRole).
Its own calls are the Kube class (operator/tidal_operator/kube.py); kopf adds watches and patches. */}}
{{- define "tidal.operator.rules" -}}
# get/list: reconcile and resync; watch: kopf's handlers; patch: kopf's own annotations.
- apiGroups: ["tidal.dev"]
  resources: ["llmservices"]
  verbs: ["get", "list", "watch", "patch"]
# Patches of /status (server-side apply, one field manager per controller): the operator's only
# output on an LLMService (it never writes spec).
- apiGroups: ["tidal.dev"]
  resources: ["llmservices/status"]
  verbs: ["patch"]
# Pods and the Service carry an ownerReference with blockOwnerDeletion: true, which the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift's default) allows only with
# update on the owner's finalizers. The operator never adds a finalizer.
- apiGroups: ["tidal.dev"]
  resources: ["llmservices/finalizers"]
  verbs: ["update"]
# Engine Pods are managed directly (no Deployment): create, roll, restore drift, remove;
# get: a create that met AlreadyExists reads the Pod to adopt an orphan of that name.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# The headless Service of each LLMService (deleted by garbage collection, not by the operator).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# One PodDisruptionBudget per LLMService (deleted by garbage collection, not by the operator).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
# Modes hpa and keda: the HPA or KEDA ScaledObject per LLMService (owned; deleted when the mode
# changes, and by garbage collection with the LLMService).
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
# A GPU-share group's one shared ResourceClaim (its owners kept in line by server-side apply;
# deleted by garbage collection with the group's last member, not by the operator).
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims"]
  verbs: ["get", "create", "patch"]
# Read-only: that referenced Secrets exist, and the engine key the autoscaler scrapes /metrics with
# (get); the tenants' client-key Secrets, found by their label tidal.dev/client-keys=true (list),
# which it copies for the router into the release namespace.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "list"]
# Events on LLMServices (the operator's and kopf's: core/v1 only).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if include "tidal.peering.enabled" . }}
{{- if not (include "tidal.clusterWide" .) }}
# Kopf peering, namespaced: kopf watches the KopfPeering and patches heartbeats; the resync loop reads it.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}
{{- end -}}

{{/* The operator's cluster-scoped needs (kopf's resource and namespace scanning, cluster peering). */}}
{{- define "tidal.operator.clusterRules" -}}
# Kopf watches CRDs to notice LLMService's CRD appearing or changing.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if include "tidal.clusterWide" . }}
{{- if include "tidal.peering.enabled" . }}
# Kopf peering, cluster-wide: one ClusterKopfPeering.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- else }}
# Namespaced kopf lists and watches namespaces to find the ones it serves.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end -}}

{{/* The router, in every namespace it watches. */}}
{{- define "tidal.router.rules" -}}
# The routing table: LLMServices (served names, adapters, key refs).
- apiGroups: ["tidal.dev"]
  resources: ["llmservices"]
  verbs: ["list", "watch"]
{{- if eq .Values.router.wakeLease "kubernetes" }}
# Replicas (readiness, sleep state); get+patch: the wake lease and the sleep-state label after a wake.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
{{- else if eq .Values.router.wakeLease "none" }}
# Replicas (readiness, sleep state). No wake lease, so no writes.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
{{- else }}
{{- fail (printf "router.wakeLease must be \"kubernetes\" or \"none\", not %q" .Values.router.wakeLease) }}
{{- end }}
{{- /* No Secrets here: the router reads only the operator's copies in the release namespace (router/release-namespace-rbac.yaml). */}}
{{- end -}}

{{/* Security context of every container (values can tighten it, a test checks the floor). */}}
{{- define "tidal.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end -}}
