{{/* The release's name prefix of every object. */}}
{{- define "batchgen.fullname" -}}
{{- printf "%s-batchgen" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "batchgen.secretName" -}}
{{- if .Values.secrets.create -}}{{ include "batchgen.fullname" . }}{{- else -}}{{ required "secrets.existingSecret is required when secrets.create is false" .Values.secrets.existingSecret }}{{- end -}}
{{- end -}}

{{/* Labels of one component: include "batchgen.labels" (list . "api"). */}}
{{- define "batchgen.labels" -}}
app.kubernetes.io/name: batchgen
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* A container's image, environment and mounts (every process reads the same). */}}
{{- define "batchgen.container" -}}
image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
imagePullPolicy: {{ .Values.image.pullPolicy }}
envFrom:
  - secretRef:
      name: {{ include "batchgen.secretName" . }}
env:
  - name: BATCHGEN_DATA_DIR
    value: /srv/data
  {{- if .Values.modelsToml }}
  - name: BATCHGEN_MODELS_FILE
    value: /etc/batchgen/models.toml
  {{- end }}
  {{- range $name, $value := .Values.env }}
  - name: {{ $name }}
    value: {{ $value | quote }}
  {{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
volumeMounts:
  - name: data
    mountPath: /srv/data
  - name: tmp
    mountPath: /tmp
  {{- if .Values.modelsToml }}
  - name: models
    mountPath: /etc/batchgen
    readOnly: true
  {{- end }}
{{- end -}}

{{- define "batchgen.volumes" -}}
volumes:
  - name: data
    emptyDir: {}
  - name: tmp
    emptyDir: {}
  {{- if .Values.modelsToml }}
  - name: models
    configMap:
      name: {{ include "batchgen.fullname" . }}-models
  {{- end }}
{{- end -}}

{{/* Celery's own ping of this pod's node (as docker-compose.yml's healthchecks):
include "batchgen.ping" "<node name before @>". */}}
{{- define "batchgen.ping" -}}
exec:
  command: ["sh", "-c", "celery -A batchgen.tasks inspect ping --timeout 5 -d {{ . }}@$HOSTNAME"]
initialDelaySeconds: 30
periodSeconds: 30
timeoutSeconds: 10
failureThreshold: 3
{{- end -}}
