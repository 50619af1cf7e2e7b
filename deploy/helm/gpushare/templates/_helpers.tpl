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

{{/* how the node agent holds containers to their cards: "nri" or "cri-shim" (values.yaml, nodeAgent.enforcement) */}}
{{- define "gpushare.enforcement" -}}
{{- if not (has .Values.nodeAgent.enforcement (list "nri" "cri-shim")) }}
{{- fail (printf "nodeAgent.enforcement: %q is not one of nri, cri-shim" .Values.nodeAgent.enforcement) }}
{{- end }}
{{- .Values.nodeAgent.enforcement }}
{{- end }}

{{/* the order of the devices in each node's ResourceSlice: "index" or "best-fit" (values.yaml, dra.order) */}}
{{- define "gpushare.draOrder" -}}
{{- if not (has .Values.dra.order (list "index" "best-fit")) }}
{{- fail (printf "dra.order: %q is not one of index, best-fit" .Values.dra.order) }}
{{- end }}
{{- .Values.dra.order }}
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

{{/*
kube-scheduler's extender entries for the gpushare extender: the same in the configuration to copy onto
the control plane (scheduler-config.yaml) and in the chart's own kube-scheduler's (scheduler.yaml)
*/}}
{{- define "gpushare.schedulerExtenders" -}}
extenders:
  # The extender serves HTTPS only and answers only a client holding a certificate signed by the CA in
  # the Secret {{ include "gpushare.clientCASecret" . }} (see docs/operations.md, "Certificates"). A host-network
  # kube-scheduler that can't resolve cluster names puts the Service's ClusterIP here instead (the
  # chart's own, run by `gpushare kube-scheduler`, does so itself); the server name below is what its
  # certificate is checked against either way.
  - urlPrefix: https://gpushare-extender.{{ .Release.Namespace }}.svc:32766
    filterVerb: filter
    prioritizeVerb: prioritize
    preemptVerb: preempt
    bindVerb: bind
    # prioritize answers 0..10; the scheduler multiplies by this weight before adding its own scores
    weight: 5
    enableHTTPS: true
    tlsConfig: &extender-tls
      # kube-scheduler's client certificate for the extender, and the CA that signed the extender's
      # serving certificate (mounted into kube-scheduler's pod: from the control-plane node, or for the
      # chart's own kube-scheduler from the Secret gpushare-scheduler-client)
      certFile: /etc/kubernetes/gpushare/scheduler-client.crt
      keyFile: /etc/kubernetes/gpushare/scheduler-client.key
      caFile: /etc/kubernetes/gpushare/extender-ca.crt
      serverName: gpushare-extender.{{ .Release.Namespace }}.svc
      insecure: false
    # a filter over thousands of nodes answers in milliseconds; a bind makes a handful of API calls
    httpTimeout: 30s
    # the extender watches nodes itself: the scheduler sends node names, not whole node objects
    nodeCacheCapable: true
    # without the extender no GPU pod may be placed: a failed call leaves the pod Pending
    ignorable: false
    managedResources:
      - name: aliyun.com/gpu-mem
        ignoredByScheduler: false
      - name: aliyun.com/gpu-count
        ignoredByScheduler: false
  # The same extender, over the same mutual TLS (the extender serves nothing else when it has a certificate).
  - urlPrefix: https://gpushare-extender.{{ .Release.Namespace }}.svc:32766
    prioritizeVerb: prioritize-host
    # 0..10 x 20 x 10: outweighs kube-scheduler's own spreading scores (0..200), which then only break ties
    weight: 20
    enableHTTPS: true
    tlsConfig: *extender-tls
    httpTimeout: 5s
    nodeCacheCapable: true
    # pods without GPUs must still schedule when the extender is down
    ignorable: true
{{- end }}
