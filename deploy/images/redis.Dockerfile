# cilia-redis: Debian bookworm's redis-server on the project's base image, for deploy/compose
# and the image tests when no registry is reachable (`scripts/images.sh redis`).
# The apt-get below needs the host's network (scripts/images.py builds with network_mode=host).
ARG BASE_IMAGE=cilia-base:bookworm
FROM ${BASE_IMAGE}
ARG BASE_IMAGE
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
HEALTHCHECK --interval=5s --timeout=3s --retries=5 CMD ["redis-cli", "-p", "6379", "ping"]
ENTRYPOINT ["redis-server"]
CMD ["--bind", "0.0.0.0", "--port", "6379", "--dir", "/data", "--protected-mode", "no"]
ARG VERSION=0.0.0
ARG GIT_REVISION=unknown
LABEL org.opencontainers.image.title="cilia-redis" \
      org.opencontainers.image.description="Debian bookworm redis-server for Cilia's standalone stack" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${GIT_REVISION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
