{{/*
The agent DaemonSet's pod template, rendered twice: without the generation annotation to hash
it (cilia.agent.generation), and with the hash in the DaemonSet. Call with
(dict "root" $ "generation" "<hash or empty>").

Init containers: the Deckhouse module's, in its order, each `cilia-agent init <step>`
(services/agent/README.md "Start-up checks"): idempotent; a failure is one line naming what is
missing and what to do. `cilia-agent serve` repeats the checks.
*/}}
{{- define "cilia.agent.podTemplate" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $agentImage := include "cilia.image" (dict "image" $v.image "root" $root) -}}
{{- $env := include "cilia.k8sServiceEnv" $root -}}
metadata:
  labels:
    app: cilia-agent
    app.kubernetes.io/part-of: cilia
{{- if .generation }}
  annotations:
    safe-agent-updater-daemonset-generation: {{ .generation | quote }}
{{- end }}
spec:
  serviceAccountName: cilia-agent
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  priorityClassName: system-node-critical
  terminationGracePeriodSeconds: 10
  tolerations:
    - operator: Exists
  initContainers:
    # 1. kernel version and every BPF feature the datapath uses, probed
    - name: check-linux-kernel
      image: {{ $agentImage }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      args: [init, check-kernel, --min-kernel-version=$(KERNEL_MIN)]
      env:
        - name: KERNEL_MIN
          valueFrom:
            configMapKeyRef:
              name: cilia-config
              key: minimal-kernel-version
        {{- $env | nindent 8 }}
      securityContext:
        privileged: true
      resources:
        requests: {cpu: 10m, memory: 10Mi}
    # 2. nft or legacy, as the host's kubelet uses it; the agent's chain is removed from the
    #    other one (the agent detects the same backend at start)
    - name: clearing-unnecessary-iptables
      image: {{ $agentImage }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- with $env }}
      env:
        {{- . | nindent 8 }}
      {{- end }}
      args: [init, iptables-backend]
      securityContext:
        privileged: true
      volumeMounts:
        - name: lib-modules
          mountPath: /lib/modules
          readOnly: true
        - name: xtables-lock
          mountPath: /run/xtables.lock
      resources:
        requests: {cpu: 10m, memory: 10Mi}
    {{- if eq $v.routingMode "tunnel" }}
    # VXLAN only, as the module runs it: UDP-tunnel segmentation offload off on the node IP's
    # NIC when its driver is one that needs it (vmxnet3); a no-op on any other NIC
    - name: handle-vxlan-offload
      image: {{ $agentImage }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      env:
        {{- with $env }}
        {{- . | nindent 8 }}
        {{- end }}
        - name: NODE_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
      args: [init, handle-vxlan-offload]
      securityContext:
        capabilities:
          add: [NET_ADMIN]
          drop: [ALL]
      resources:
        requests: {cpu: 10m, memory: 10Mi}
    {{- end }}
    # 3. a cgroup2 hierarchy at /run/cilia/cgroupv2 on the host (propagated back)
    - name: mount-cgroup
      image: {{ $agentImage }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- with $env }}
      env:
        {{- . | nindent 8 }}
      {{- end }}
      args: [init, mount-cgroup2, --cgroup-root=/run/cilia/cgroupv2]
      securityContext:
        privileged: true
      volumeMounts:
        - name: cilia-cgroup
          mountPath: /run/cilia/cgroupv2
          mountPropagation: Bidirectional
      resources:
        requests: {cpu: 10m, memory: 10Mi}
    # 4. ip_forward on, rp_filter off for all, lxc*, cilia_host, cilium_*; also written to the
    #    host's /etc/sysctl.d so systemd-sysctl applies it to veths created later
    - name: apply-sysctl-overwrites
      image: {{ $agentImage }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- with $env }}
      env:
        {{- . | nindent 8 }}
      {{- end }}
      args:
        - init
        - sysctl
        - --sysctl-conf-file=/host/etc/sysctl.d/99-zzz-override_cilia.conf
      securityContext:
        privileged: true
      volumeMounts:
        - name: etc-sysctl-d
          mountPath: /host/etc/sysctl.d
      resources:
        requests: {cpu: 10m, memory: 10Mi}
    # 5. bpffs on the host's /sys/fs/bpf (pinned maps survive agent restarts)
    - name: mount-bpf-fs
      image: {{ $agentImage }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- with $env }}
      env:
        {{- . | nindent 8 }}
      {{- end }}
      args: [init, mount-bpffs, --bpffs-root=/sys/fs/bpf]
      securityContext:
        privileged: true
      volumeMounts:
        - name: bpf-maps
          mountPath: /sys/fs/bpf
          mountPropagation: Bidirectional
      resources:
        requests: {cpu: 10m, memory: 10Mi}
    # 6. on request only (ConfigMap cilia-config): clean-cilia-bpf-state "true" removes the
    #    pinned maps and links, clean-cilia-state "true" also the host device, routes, iptables
    #    chain and state files; refused while an agent answers on its socket
    - name: clean-cilia-state
      image: {{ $agentImage }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      args:
        - init
        - clean-state
        - --bpf-pin-dir=/sys/fs/bpf/cilia
        - --state-dir=/var/run/cilia/state
        - --socket=/var/run/cilia/cilia.sock
      env:
        - name: CILIUM_ALL_STATE
          valueFrom:
            configMapKeyRef:
              name: cilia-config
              key: clean-cilia-state
              optional: true
        - name: CILIUM_BPF_STATE
          valueFrom:
            configMapKeyRef:
              name: cilia-config
              key: clean-cilia-bpf-state
              optional: true
        {{- $env | nindent 8 }}
      securityContext:
        privileged: true
      volumeMounts:
        - name: cilia-run
          mountPath: /var/run/cilia
        - name: bpf-maps
          mountPath: /sys/fs/bpf
          mountPropagation: HostToContainer
        - name: xtables-lock
          mountPath: /run/xtables.lock
      resources:
        requests: {cpu: 10m, memory: 10Mi}
    # 7. cilia-cni onto the host: frozen bundle copy (no Python needed on the host) + wrapper
    #    renamed into cni.binPath
    - name: install-cni-binaries
      image: {{ include "cilia.image" (dict "image" $v.cni.image "root" $root) }}
      imagePullPolicy: {{ $v.cni.image.pullPolicy }}
      command: [cilia-cni-install]
      env:
        - name: CILIA_CNI_BIN_DIR
          value: /host/cni-bin
        - name: CILIA_CNI_LIB_DIR
          value: /host/opt/cni/cilia
        - name: CILIA_CNI_HOST_LIB_DIR
          value: /opt/cni/cilia
        {{- $env | nindent 8 }}
      volumeMounts:
        - name: cni-path
          mountPath: /host/cni-bin
        - name: cni-lib
          mountPath: /host/opt/cni/cilia
      resources:
        requests: {cpu: 100m, memory: 10Mi}
  containers:
    - name: agent
      image: {{ $agentImage }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      args:
        - serve
        - --node-name=$(NODE_NAME)
        # the ready endpoints of Service cilia-operator (port grpc) through the API server:
        # no DNS and no ClusterIP, both of which would need Cilia itself
        - --operator=k8s:{{ $root.Release.Namespace }}/cilia-operator
        # mutual TLS: the operator's CA from Secret cilia-agent-tls (public, the same on every
        # node); as client pair this node's own kubelet client certificate (CN=system:node:<node>,
        # O=system:nodes, issued by the cluster CA, rotated by the kubelet): a key no other node
        # holds, see services/operator/README.md "Kubernetes: per-node credentials"
        - --tls-operator-server-ca-files=/var/lib/cilia/tls/operator-client/ca.crt
        - --tls-operator-client-cert-file=/var/lib/kubelet/pki/kubelet-client-current.pem
        - --tls-operator-client-key-file=/var/lib/kubelet/pki/kubelet-client-current.pem
        - --tls-operator-server-name=cilia-operator
        - --cluster-name={{ $v.cluster.name }}
        - --ipam={{ $v.ipam.mode }}
        {{- if eq $v.ipam.mode "multi-pool" }}
        - --ipam-default-ip-pool={{ $v.ipam.defaultIPPool }}
        {{- end }}
        - --routing-mode={{ $v.routingMode }}
        {{- if eq $v.routingMode "tunnel" }}
        - --tunnel-protocol={{ $v.tunnelProtocol }}
        {{- else }}
        - --auto-direct-node-routes={{ $v.autoDirectNodeRoutes }}
        {{- end }}
        {{- with $v.ipv4NativeRoutingCIDR }}
        - --ipv4-native-routing-cidr={{ . }}
        {{- end }}
        - --enable-ipv4-masquerade={{ $v.enableIPv4Masquerade }}
        - --enable-bpf-masquerade={{ $v.bpf.masquerade }}
        {{- if $v.MTU }}
        - --mtu={{ int $v.MTU }}
        {{- end }}
        - --kube-proxy-replacement={{ $v.kubeProxyReplacement }}
        - --enable-policy={{ $v.policyEnforcementMode }}
        - --policy-audit-mode={{ $v.policyAuditMode }}
        - --state-dir=/var/run/cilia/state
        - --socket=/var/run/cilia/cilia.sock
        - --cni-conf-dir=/host/etc/cni/net.d
        - --cni-exclusive={{ $v.cni.exclusive }}
        - --cni-uninstall={{ $v.cni.uninstall }}
        - --cni-chaining-mode={{ $v.cni.chainingMode }}
        - --prometheus-serve-addr=127.0.0.1:9962
        - --hubble-listen-address=:4244
        # Hubble's TCP server: mutual TLS with the relay, as the Deckhouse module runs it
        # (Secret hubble-server-certs: *.<cluster.name>.hubble-grpc.cilium.io)
        - --hubble-tls-cert-file=/var/lib/cilia/tls/hubble/tls.crt
        - --hubble-tls-key-file=/var/lib/cilia/tls/hubble/tls.key
        - --hubble-tls-client-ca-files=/var/lib/cilia/tls/hubble/ca.crt
        # Hubble metrics on upstream's port 9965 (headless Service hubble-metrics); the handlers
        # without per-pod labels, so the series count does not grow with pods
        - --hubble-metrics=flow drop tcp port-distribution icmp flows-to-world
        - --hubble-metrics-server=:9965
        - --bpf-pin-dir=/sys/fs/bpf/cilia
      env:
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        {{- $env | nindent 8 }}
      ports:
        - name: hubble
          containerPort: 4244
        - name: hubble-metrics
          containerPort: 9965
      # The CNI/debug gRPC API is a unix socket: exec probes. Alive = gRPC health SERVING;
      # ready = `cilia-agent status` (registered with the operator, datapath loaded).
      startupProbe:
        exec:
          command: [cilia-grpc-health-probe, unix:/var/run/cilia/cilia.sock]
        periodSeconds: 2
        failureThreshold: 105
        timeoutSeconds: 5
      livenessProbe:
        exec:
          command: [cilia-grpc-health-probe, unix:/var/run/cilia/cilia.sock]
        periodSeconds: 30
        failureThreshold: 10
        timeoutSeconds: 5
      readinessProbe:
        exec:
          command: [cilia-agent, status, --timeout, "5"]
        periodSeconds: 10
        failureThreshold: 3
        timeoutSeconds: 8
      resources:
        requests:
          cpu: 100m
          memory: 256Mi
      # BPF programs and maps (libbpf), veths and routes in pod netns, iptables.
      securityContext:
        privileged: true
      volumeMounts:
        - name: cilia-run
          mountPath: /var/run/cilia
        - name: bpf-maps
          mountPath: /sys/fs/bpf
          mountPropagation: HostToContainer
        - name: cilia-cgroup
          mountPath: /run/cilia/cgroupv2
          mountPropagation: HostToContainer
        - name: etc-cni-netd
          mountPath: /host/etc/cni/net.d
        - name: operator-client-tls
          mountPath: /var/lib/cilia/tls/operator-client
          readOnly: true
        # at the host's path: kubelet-client-current.pem is an absolute symlink there
        - name: kubelet-pki
          mountPath: /var/lib/kubelet/pki
          readOnly: true
        - name: hubble-tls
          mountPath: /var/lib/cilia/tls/hubble
          readOnly: true
        - name: host-netns
          mountPath: /var/run/netns
          mountPropagation: HostToContainer
        - name: lib-modules
          mountPath: /lib/modules
          readOnly: true
        - name: usr-src
          mountPath: /usr/src
          readOnly: true
        - name: xtables-lock
          mountPath: /run/xtables.lock
    # The plugin logic behind the static cilia-cni the runtime execs on the host: it listens on
    # cilia-cni.sock beside the agent's socket (where the executable looks) and forks a warm
    # child per invocation (services/cni/README.md "Static executable").
    - name: cni-server
      image: {{ include "cilia.image" (dict "image" $v.cni.image "root" $root) }}
      imagePullPolicy: {{ $v.cni.image.pullPolicy }}
      command: [/opt/cilia/bin/cilia-cni, serve, --socket, /var/run/cilia/cilia-cni.sock]
      {{- with $env }}
      env:
        {{- . | nindent 8 }}
      {{- end }}
      resources:
        requests: {cpu: 10m, memory: 32Mi}
      # root (the socket is 0600 like the agent's); no capability needed
      securityContext:
        runAsUser: 0
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: [ALL]
      volumeMounts:
        - name: cilia-run
          mountPath: /var/run/cilia
        # CHECK compares the sandbox path with CNI_NETNS (same inode)
        - name: host-netns
          mountPath: /var/run/netns
          mountPropagation: HostToContainer
    - name: kube-rbac-proxy
      image: {{ include "cilia.image" (dict "image" $v.kubeRbacProxy.image "root" $root) }}
      imagePullPolicy: {{ $v.kubeRbacProxy.image.pullPolicy }}
      args:
        - --secure-listen-address=$(POD_IP):4241
        - --upstream=http://127.0.0.1:9962/
        - --config-file=/etc/kube-rbac-proxy/agent.yaml
        # only /metrics reaches the upstream (anything else: 404), as the module serves it
        - --allow-paths=/metrics
        - --v=2
      env:
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- $env | nindent 8 }}
      ports:
        - name: https-metrics
          containerPort: 4241
      volumeMounts:
        - name: kube-rbac-proxy
          mountPath: /etc/kube-rbac-proxy
          readOnly: true
      resources:
        requests: {cpu: 10m, memory: 20Mi}
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: [ALL]
  volumes:
    - name: operator-client-tls
      secret:
        secretName: cilia-agent-tls  # ca.crt only: no node's key is in any Secret
        defaultMode: 0400
    - name: kubelet-pki
      hostPath: {path: /var/lib/kubelet/pki, type: Directory}
    - name: hubble-tls
      secret:
        secretName: hubble-server-certs
        defaultMode: 0400
    - name: cilia-run
      hostPath: {path: /var/run/cilia, type: DirectoryOrCreate}
    - name: bpf-maps
      hostPath: {path: /sys/fs/bpf, type: DirectoryOrCreate}
    - name: cilia-cgroup
      hostPath: {path: /run/cilia/cgroupv2, type: DirectoryOrCreate}
    - name: cni-path
      hostPath: {path: {{ $v.cni.binPath }}, type: DirectoryOrCreate}
    - name: cni-lib
      hostPath: {path: /opt/cni/cilia, type: DirectoryOrCreate}
    - name: etc-cni-netd
      hostPath: {path: {{ $v.cni.confPath }}, type: DirectoryOrCreate}
    - name: host-netns
      hostPath: {path: /var/run/netns, type: DirectoryOrCreate}
    - name: lib-modules
      hostPath: {path: /lib/modules}
    - name: usr-src
      hostPath: {path: /usr/src}
    - name: xtables-lock
      hostPath: {path: /run/xtables.lock, type: FileOrCreate}
    - name: etc-sysctl-d
      hostPath: {path: /etc/sysctl.d, type: DirectoryOrCreate}
    - name: kube-rbac-proxy
      configMap:
        name: cilia-kube-rbac-proxy
{{- end }}
