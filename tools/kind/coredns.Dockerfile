# CoreDNS for the kind-style test cluster (cilia_testkit.kind): the static binary built by
# scripts/coredns.sh from the Go module proxy, alone in the image (like upstream's image,
# which is FROM a distroless static base). Runs as an unprivileged user; binds :53 because
# the Deployment sets the pod's net.ipv4.ip_unprivileged_port_start to 53.
FROM scratch
COPY coredns /coredns
ARG COREDNS_VERSION=unknown
LABEL org.opencontainers.image.title="cilia-coredns" \
      org.opencontainers.image.version="${COREDNS_VERSION}"
USER 65532:65532
ENTRYPOINT ["/coredns"]
