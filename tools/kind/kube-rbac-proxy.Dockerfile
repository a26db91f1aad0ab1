# kube-rbac-proxy for the kind-style test cluster: the chart's metrics sidecar image
# (values kubeRbacProxy.image, upstream name quay.io/brancz/kube-rbac-proxy) cannot be pulled
# here, so the binary scripts/kube-rbac-proxy.sh builds from the Go module proxy is put on
# the Debian base under that name (it is linked against glibc, hence not FROM scratch).
ARG BASE=cilia-base:bookworm
FROM ${BASE}
COPY kube-rbac-proxy /usr/local/bin/kube-rbac-proxy
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kube-rbac-proxy"]
