# The node image of the kind-style test cluster (cilia_testkit.kind): one privileged-like
# container per Kubernetes node running containerd + the kubelet (and, on the first node,
# the control plane). Built by cilia_testkit.kind.image from the local Debian base
# (no registry here); the build context holds this file, entrypoint.sh and the kubelet binary
# from the Go build cache (scripts/kubelet-tools.sh). apt runs with the host's network.
ARG BASE=cilia-base:bookworm
FROM ${BASE}
# containerd + runc: the CRI runtime; iptables/iproute2/kmod: what node agents and the kubelet
# call; containernetworking-plugins: Debian's reference CNI plugins (loopback is always run
# by containerd; bridge + host-local make the harness's reference CNI); tini: PID 1 that
# reaps orphaned shims; bind9-dnsutils/curl/procps/conntrack: probes tests run on a node.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      containerd runc iptables iproute2 kmod containernetworking-plugins tini \
      bind9-dnsutils curl procps conntrack ethtool \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && mkdir -p /opt/cni/bin /etc/cni/net.d /var/lib/kubelet /var/log/cilia-node \
 && for p in loopback bridge host-local portmap; do cp /usr/lib/cni/$p /opt/cni/bin/; done
COPY kubelet /usr/local/bin/kubelet
COPY entrypoint.sh /usr/local/bin/cilia-node-entrypoint
COPY containerd.toml /etc/containerd/config.toml
ARG K8S_VERSION=unknown
LABEL org.opencontainers.image.title="cilia-node" \
      org.opencontainers.image.description="kind-style Kubernetes node: containerd, runc, kubelet ${K8S_VERSION}" \
      io.cilia.kind.k8s-version="${K8S_VERSION}"
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "-g", "--", "/usr/local/bin/cilia-node-entrypoint"]
