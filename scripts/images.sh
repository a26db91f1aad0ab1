#!/usr/bin/env bash
# `make images`: one container image per service (DESIGN.md §1, "CI builds one image per
# service"), tagged cilia-<service>:<version>, built from the repository root with
# services/<service>/Dockerfile.
#
#   scripts/images.sh [--base-image NAME] [SERVICE...]     (default: every service)
#
# No image registry is reachable on the project's machines (environment-notes.md): when the
# base image is not present locally, a Debian bookworm base with python3 + venv is built with
# debootstrap and `docker import`ed as $LOCAL_BASE, and every Dockerfile gets it as BASE_IMAGE.
#   CILIA_BASE_IMAGE    base image for every service (default: each Dockerfile's own)
#   CILIA_IMAGE_TAG     tag (default: the version in services/<service>/pyproject.toml)
set -euo pipefail
cd "$(dirname "$0")/.."
SERVICES=(operator agent cni relay safe-agent-updater)
LOCAL_BASE=cilia-base:bookworm
BASE=${CILIA_BASE_IMAGE:-}
say() { printf '[images] %s\n' "$*" >&2; }

selected=()
while (($#)); do
  case $1 in
    --base-image) BASE=${2:?--base-image needs a name}; shift 2 ;;
    -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) [[ -f services/$1/Dockerfile ]] || { say "unknown service $1"; exit 2; }; selected+=("$1"); shift ;;
  esac
done
((${#selected[@]})) || selected=("${SERVICES[@]}")
command -v docker >/dev/null || { say "docker not found: apt-get install docker.io"; exit 2; }
docker info >/dev/null 2>&1 || { say "docker engine not running (start dockerd)"; exit 2; }

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

build_local_base() {
  have_image "$LOCAL_BASE" && return 0
  command -v debootstrap >/dev/null || { say "debootstrap missing: apt-get install debootstrap"; exit 2; }
  local dir
  dir=$(mktemp -d /tmp/cilia-base.XXXXXX)
  say "building $LOCAL_BASE with debootstrap (about 40 s)"
  debootstrap --variant=minbase --include=python3,python3-venv,iproute2 bookworm "$dir" >/dev/null
  tar -C "$dir" -c . | docker import - "$LOCAL_BASE" >/dev/null
  rm -rf "$dir"
}

for svc in "${selected[@]}"; do
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' "services/$svc/pyproject.toml" | head -1)
  tag=cilia-$svc:${CILIA_IMAGE_TAG:-$version}
  base=$BASE
  if [[ -z $base ]]; then
    default=$(sed -n 's/^ARG BASE_IMAGE=//p' "services/$svc/Dockerfile")
    if have_image "$default" || docker pull -q "$default" >/dev/null 2>&1; then
      base=$default
    else
      say "$default not available (no registry): using $LOCAL_BASE"
      build_local_base
      base=$LOCAL_BASE
    fi
  fi
  say "building $tag (base $base)"
  docker build -q -f "services/$svc/Dockerfile" --build-arg "BASE_IMAGE=$base" -t "$tag" . >/dev/null
  say "built $tag"
done
