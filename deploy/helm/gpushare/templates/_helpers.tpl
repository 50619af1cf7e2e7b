{{/* the image of every gpushare container */}}
{{- define "gpushare.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* whether the admission webhook, or the ValidatingAdmissionPolicy, is installed */}}
{{- define "gpushare.webhook" -}}
{{- if not (has .Values.admission (list "policy" "webhook" "both")) }}
{{- fail (printf "admission: %q is not one of policy, webhook, both" .Values.admission) }}
{{- end }}
{{- if ne .Values.admission "policy" }}true{{ end }}
{{- end }}
{{- define "gpushare.policy" -}}
{{- if ne .Values.admission "webhook" }}true{{ end }}
{{- end }}

{{/* the service accounts that alone may write gpushare's pod annotations, as CEL */}}
{{- define "gpushare.notGpushare" -}}
!(request.userInfo.username in [
  'system:serviceaccount:{{ .Release.Namespace }}:gpushare-extender',
  'system:serviceaccount:{{ .Release.Namespace }}:gpushare-node-agent'])
{{- end }}

{{/*
Who makes the certificates: "chart", "certManager" or "secrets" (values.yaml, certificates.source).
certificates.generate, its predecessor, is refused by name rather than ignored.
*/}}
{{- define "gpushare.certificates" -}}
{{- if hasKey .Values.certificates "generate" }}
{{- fail "certificates.generate is replaced by certificates.source: chart (generate true), secrets (generate false) or certManager" }}
{{- end }}
{{- if not (has .Values.certificates.source (list "chart" "certManager" "secrets")) }}
{{- fail (printf "certificates.source: %q is not one of chart, certManager, secrets" .Values.certificates.source) }}
{{- end }}
{{- .Values.certificates.source }}
{{- end }}

{{/*
The Secret whose ca.crt the extender checks kube-scheduler's client certificate against: with
certManager the client CA's own Secret (the extender mounts its ca.crt alone, never the CA's key).
*/}}
{{- define "gpushare.clientCASecret" -}}
{{- if eq (include "gpushare.certificates" .) "certManager" }}gpushare-client-ca{{ else }}{{ .Values.certificates.schedulerClientCASecret }}{{ end }}
{{- end }}

{{/*
A CA, (list . SECRET): the one in the Secret SECRET when the release has one (an upgrade keeps it, so
kube-scheduler's copies stay valid), else a new one. Made once per render and kept in .Values, so every
template signs with the same CA. Two are made: gpushare-ca signs the serving certificates, and
gpushare-client-ca only kube-scheduler's client certificate, as anything it signs may call /bind.
*/}}
{{- define "gpushare.ca" -}}
{{- $top := index . 0 }}{{ $name := index . 1 }}
{{- $cas := $top.Values.certificates.cas | default dict }}
{{- if not (hasKey $cas $name) }}
{{- $existing := lookup "v1" "Secret" $top.Release.Namespace $name }}
{{- if $existing }}
{{- $_ := set $cas $name (buildCustomCert (index $existing.data "tls.crt") (index $existing.data "tls.key")) }}
{{- else }}
{{- $_ := set $cas $name (genCA $name (int $top.Values.certificates.validityDays)) }}
{{- end }}
{{- $_ := set $top.Values.certificates "cas" $cas }}
{{- end }}
{{- end }}

{{/* a kubernetes.io/tls Secret NAME for the Service SERVICE, signed by the CA: (list . NAME SERVICE) */}}
{{- define "gpushare.servingSecret" -}}
{{- $top := index . 0 }}
{{- include "gpushare.ca" (list $top "gpushare-ca") }}
{{- $ca := index $top.Values.certificates.cas "gpushare-ca" }}
{{- $host := printf "%s.%s.svc" (index . 2) $top.Release.Namespace }}
{{- $cert := genSignedCert $host nil (list $host) (int $top.Values.certificates.validityDays) $ca }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ index . 1 }}
  namespace: {{ $top.Release.Namespace }}
  labels:
    app.kubernetes.io/part-of: gpushare
type: kubernetes.io/tls
data:
  tls.crt: {{ $cert.Cert | b64enc }}
  tls.key: {{ $cert.Key | b64enc }}
  ca.crt: {{ $ca.Cert | b64enc }}
{{- end }}
