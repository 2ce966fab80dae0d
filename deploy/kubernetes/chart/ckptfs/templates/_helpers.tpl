{{/* The release's full name: "ckptfs" for a release named ckptfs (or containing it). */}}
{{- define "ckptfs.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ckptfs.holderName" -}}
{{- printf "%s-holder" (include "ckptfs.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ckptfs.envConfigMapName" -}}
{{- printf "%s-env" (include "ckptfs.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ckptfs.tomlConfigMapName" -}}
{{- printf "%s-config" (include "ckptfs.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ckptfs.serviceAccountName" -}}
{{- default (include "ckptfs.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "ckptfs.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The FUSE mountpoint, the same path on the host and in the containers. */}}
{{- define "ckptfs.mount.mountpoint" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.mount.root) .Values.mount.name -}}
{{- end -}}

{{- define "ckptfs.cacheDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.cache.hostPath) .Values.cache.dirName -}}
{{- end -}}

{{/* terminationGracePeriodSeconds of the daemon: the preStop flush, then the drain, then a margin. */}}
{{- define "ckptfs.daemonGracePeriod" -}}
{{- add (int .Values.drain.preStopFlushTimeout) (int .Values.drain.timeout) (int .Values.drain.terminationMarginSeconds) -}}
{{- end -}}

{{- define "ckptfs.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels; $component is "daemon" or "holder". */}}
{{- define "ckptfs.selectorLabels" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ $component }}
{{- end -}}

{{/* Checks of the values that no schema can express. */}}
{{- define "ckptfs.validate" -}}
{{- if not .Values.source -}}
{{- fail "source is required: s3://bucket[/prefix], gs://bucket[/prefix], az://container[/prefix] or file:///dir" -}}
{{- end -}}
{{- if not (hasPrefix "/" .Values.mount.root) -}}
{{- fail "mount.root must be an absolute host path" -}}
{{- end -}}
{{- if or (not .Values.mount.name) (contains "/" .Values.mount.name) -}}
{{- fail "mount.name must be one directory name (the mountpoint is <mount.root>/<mount.name>)" -}}
{{- end -}}
{{- range $key, $value := .Values.config.env -}}
{{- if has $key (list "CKPTFS_SOURCE" "CKPTFS_MOUNTPOINT" "CKPTFS_CACHE_DIR" "CKPTFS_METRICS_ADDR" "CKPTFS_DRAIN_TIMEOUT" "CKPTFS_KEEP_MOUNT_ON_STOP" "CKPTFS_RUNTIME_DIR" "CKPTFS_CONFIG") -}}
{{- fail (printf "config.env.%s: the chart sets this one from its values (source, mount, cache, metrics, drain, runtimeDir, config.toml)" $key) -}}
{{- end -}}
{{- if regexMatch "(?i)(SECRET|PASSWORD|ACCESS_KEY_ID|_KEY$|CONNECTION_STRING|SAS_TOKEN)" $key -}}
{{- fail (printf "config.env.%s looks like a credential: put it in a Secret and name it in credentials.secretName" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
