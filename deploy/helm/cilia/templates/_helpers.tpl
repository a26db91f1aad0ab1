{{/*
Shared helpers of the Cilia chart. Nothing here renders an object by itself.
*/}}

{{/* Labels on every object (not on selectors: those stay `app: <component>`). */}}
{{- define "cilia.labels" -}}
app.kubernetes.io/part-of: cilia
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
An image reference from {repository, tag}; an empty tag is the chart's appVersion.
Call: include "cilia.image" (dict "image" .Values.image "root" $)
*/}}
{{- define "cilia.image" -}}
{{- .image.repository }}:{{ .image.tag | default .root.Chart.AppVersion }}
{{- end }}

{{/*
env KUBERNETES_SERVICE_HOST/PORT when k8sServiceHost is set (upstream's chart does the same on
every container that talks to the API server), so no component needs the `kubernetes`
ClusterIP. Emits list items at the caller's indentation (use nindent).
*/}}
{{- define "cilia.k8sServiceEnv" -}}
{{- if .Values.k8sServiceHost }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ .Values.k8sServiceHost | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .Values.k8sServicePort | quote }}
{{- end }}
{{- end }}

{{/*
The agent's generation hash (annotation safe-agent-updater-daemonset-generation): sha256 of
the canonical JSON of the agent DaemonSet's pod template as rendered without the annotation
(Go's encoding/json: keys sorted, no spaces) — the definition cilia_safe_agent_updater.
generation.template_hash implements, so `cilia-safe-agent-updater hash` of a render prints
the same value. The Deckhouse module's templates hash their rendered agent DaemonSet the same
way (render with a placeholder, sha256sum).
*/}}
{{- define "cilia.agent.generation" -}}
{{- include "cilia.agent.podTemplate" (dict "root" . "generation" "") | fromYaml | toJson | sha256sum -}}
{{- end }}

{{/*
The first address (as an integer) and the last of an IPv4 CIDR, "first last". The input is
valid (values.schema.json's pattern); host bits are ignored. Sprig has no CIDR functions.
*/}}
{{- define "cilia.cidrRange" -}}
{{- $parts := splitList "/" . -}}
{{- $octets := splitList "." (first $parts) -}}
{{- $ip := 0 -}}
{{- range $octets }}{{ $ip = add (mul $ip 256) (atoi .) }}{{ end -}}
{{- $size := 1 -}}
{{- range until (sub 32 (atoi (last $parts)) | int) }}{{ $size = mul $size 2 }}{{ end -}}
{{- $start := sub $ip (mod $ip $size) -}}
{{- printf "%d %d" $start (add $start $size -1) -}}
{{- end }}

{{/* "true" when an IPv4 CIDR has host bits set (10.0.0.1/8), else "": the agent and the
operator refuse such a CIDR at start, so the chart refuses it at install. */}}
{{- define "cilia.cidrHostBits" -}}
{{- $parts := splitList "/" . -}}
{{- $ip := 0 -}}
{{- range splitList "." (first $parts) }}{{ $ip = add (mul $ip 256) (atoi .) }}{{ end -}}
{{- if ne (int64 $ip) (int64 (first (splitList " " (include "cilia.cidrRange" .)))) -}}
true
{{- end -}}
{{- end }}

{{/* "true" when two IPv4 CIDRs share an address, else "". Call with (list a b). */}}
{{- define "cilia.cidrsOverlap" -}}
{{- $a := splitList " " (include "cilia.cidrRange" (index . 0)) -}}
{{- $b := splitList " " (include "cilia.cidrRange" (index . 1)) -}}
{{- if and (le (atoi (index $a 0)) (atoi (index $b 1))) (le (atoi (index $b 0)) (atoi (index $a 1))) -}}
true
{{- end -}}
{{- end }}

{{/* The pod CIDRs of the chosen IPAM mode, as a list of "<source> <cidr>" strings. */}}
{{- define "cilia.podCIDRs" -}}
{{- $out := list -}}
{{- if eq .Values.ipam.mode "cluster-pool" -}}
{{- range .Values.ipam.operator.clusterPoolIPv4PodCIDRList }}{{ $out = append $out (printf "ipam.operator.clusterPoolIPv4PodCIDRList %s" .) }}{{ end -}}
{{- else if eq .Values.ipam.mode "multi-pool" -}}
{{- range $name, $pool := .Values.ipam.operator.autoCreateCiliumPodIPPools }}{{ range $pool.ipv4.cidrs }}{{ $out = append $out (printf "ipam.operator.autoCreateCiliumPodIPPools.%s %s" $name .) }}{{ end }}{{ end -}}
{{- end -}}
{{- toJson $out -}}
{{- end }}

{{/* operator --auto-create-cilium-pod-ip-pools value: 'name=ipv4-cidrs:a,b;ipv4-mask-size:n ...' */}}
{{- define "cilia.autoCreatePools" -}}
{{- $specs := list -}}
{{- range $name, $pool := .Values.ipam.operator.autoCreateCiliumPodIPPools -}}
{{- $specs = append $specs (printf "%s=ipv4-cidrs:%s;ipv4-mask-size:%d" $name (join "," $pool.ipv4.cidrs) (int $pool.ipv4.maskSize)) -}}
{{- end -}}
{{- join " " $specs -}}
{{- end }}

{{/* "true" when the first IPv4 CIDR lies inside the second, else "". Call with (list a b). */}}
{{- define "cilia.cidrWithin" -}}
{{- $a := splitList " " (include "cilia.cidrRange" (index . 0)) -}}
{{- $b := splitList " " (include "cilia.cidrRange" (index . 1)) -}}
{{- if and (le (atoi (index $b 0)) (atoi (index $a 0))) (le (atoi (index $a 1)) (atoi (index $b 1))) -}}
true
{{- end -}}
{{- end }}
