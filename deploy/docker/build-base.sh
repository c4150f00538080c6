#!/usr/bin/env bash
# Build the images' Python base from Debian's own packages, for machines that reach a Debian mirror
# but no image registry (the Dockerfile's default, python:3.11.x-slim-bookworm, is on Docker Hub):
#
#   deploy/docker/build-base.sh [IMAGE]          default IMAGE: localhost/specdec-python:3.11-bookworm
#   docker build --build-arg PYTHON_IMAGE=localhost/specdec-python:3.11-bookworm ...
#
# mmdebstrap (Debian's package) builds a minimal bookworm root filesystem as root, without any
# container: Python 3.11 with venv and pip (Debian's python3, 3.11.2 on bookworm), CA certificates,
# and `passwd` (the Dockerfile adds its user with useradd). The tarball is imported as an image by
# the container engine (ENGINE: podman or docker, whichever is installed). The root filesystem
# keeps its apt sources, so `apt-get install` in the Dockerfile (verifier-cpu) works as on the
# official image. MIRROR (default http://deb.debian.org/debian) and SUITE (bookworm) choose where
# from; with a snapshot.debian.org URL as MIRROR the base is reproducible. EXTRA_CA_CERTS (PEM files,
# space-separated) are added to the image's CA store, for a build machine whose egress goes through
# a TLS-inspecting proxy; pip, requests and Python's ssl read that store (PIP_CERT, SSL_CERT_FILE,
# REQUESTS_CA_BUNDLE), where pip's own certifi bundle would not know the proxy's CA.
set -euo pipefail

image=${1:-localhost/specdec-python:3.11-bookworm}
suite=${SUITE:-bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
engine=${ENGINE:-$(command -v podman || command -v docker || true)}
[ -n "$engine" ] || { echo "build-base.sh: no container engine (podman or docker) found" >&2; exit 1; }
command -v mmdebstrap > /dev/null || { echo "build-base.sh: needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
hooks=()
for cert in ${EXTRA_CA_CERTS:-}; do
  hooks+=(--customize-hook="copy-in $cert /usr/local/share/ca-certificates/")
done
[ ${#hooks[@]} -eq 0 ] || hooks+=(--customize-hook='chroot "$1" update-ca-certificates')
start=$(date +%s)
mmdebstrap --variant=minbase \
  --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,passwd \
  --aptopt='APT::Install-Recommends "false"' \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  "${hooks[@]}" \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  "$suite" "$work/rootfs.tar" "$mirror"
bundle=/etc/ssl/certs/ca-certificates.crt
"$engine" import --change 'ENV LANG=C.UTF-8' --change "ENV PIP_CERT=$bundle" --change "ENV SSL_CERT_FILE=$bundle" \
  --change "ENV REQUESTS_CA_BUNDLE=$bundle" --change 'CMD ["python3"]' "$work/rootfs.tar" "$image" > /dev/null
echo "$image: $(du -h "$work/rootfs.tar" | cut -f1) root filesystem, built in $(( $(date +%s) - start )) s"
