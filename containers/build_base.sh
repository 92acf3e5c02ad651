#!/usr/bin/env bash
# Build the local base image for containers/Dockerfile without pulling from any registry:
# a minimal Debian bookworm root filesystem made by debootstrap (with python3 + venv + CA
# certificates, i.e. CPython 3.11 = the cp311 wheels the project ships with), imported with
# `docker import`.
#
# Idempotent: does nothing when the image already exists (FORCE=1 rebuilds it).
#
# Environment knobs:
#   BASE_IMAGE   image name:tag to create          (default mlsys-bench-base:bookworm)
#   SUITE        Debian suite                      (default bookworm)
#   MIRROR       Debian mirror                     (default http://deb.debian.org/debian;
#                a snapshot such as https://snapshot.debian.org/archive/debian/20250601T000000Z
#                makes the base bit-for-bit reproducible)
#   SECURITY     1 = also apply bookworm-security updates (default 1; 0 with a snapshot MIRROR)
#   FORCE        1 = rebuild even if BASE_IMAGE exists
#   WORKDIR_BASE where the temporary rootfs is made (default: a mktemp dir under /var/tmp)
# Needs: root (debootstrap, chroot), debootstrap (apt-get install debootstrap), docker engine.
set -euo pipefail

BASE_IMAGE=${BASE_IMAGE:-mlsys-bench-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${SECURITY:-1}
FORCE=${FORCE:-0}
INCLUDE=python3,python3-venv,ca-certificates

log() { echo "[build_base] $*" >&2; }
die() { echo "[build_base] error: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "docker engine not reachable: start dockerd (bash .ci/docker.sh) or set DOCKER_HOST"

if [ "$FORCE" != 1 ] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "$BASE_IMAGE already present ($(docker image inspect --format '{{.Id}}' "$BASE_IMAGE")); FORCE=1 rebuilds it"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "debootstrap needs root (run as root, or: sudo $0)"
if ! command -v debootstrap >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || die "debootstrap missing and no apt-get to install it"
    log "installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi

TMP=$(mktemp -d "${WORKDIR_BASE:-/var/tmp}/mlsys-bench-base.XXXXXX")
ROOTFS=$TMP/rootfs
cleanup() {
    # debootstrap may leave /proc or /sys mounted inside the chroot on failure
    for m in proc sys dev/pts dev; do umount -l "$ROOTFS/$m" 2>/dev/null || true; done
    rm -rf --one-file-system "$TMP"
}
trap cleanup EXIT

log "debootstrap --variant=minbase --include=$INCLUDE $SUITE from $MIRROR"
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOTFS" "$MIRROR" >"$TMP/debootstrap.log" 2>&1 \
    || { tail -n 20 "$TMP/debootstrap.log" >&2; die "debootstrap failed"; }

if [ "$SECURITY" = 1 ] && [ "$SUITE" = bookworm ]; then
    log "applying ${SUITE}-security updates"
    cat >"$ROOTFS/etc/apt/sources.list" <<SRC
deb $MIRROR $SUITE main
deb $MIRROR ${SUITE}-updates main
deb http://deb.debian.org/debian-security ${SUITE}-security main
SRC
    cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf" 2>/dev/null || true
    chroot "$ROOTFS" /usr/bin/env DEBIAN_FRONTEND=noninteractive LC_ALL=C \
        sh -c 'apt-get update -qq && apt-get -y -qq upgrade' >"$TMP/upgrade.log" 2>&1 \
        || { tail -n 20 "$TMP/upgrade.log" >&2; die "security upgrade failed (SECURITY=0 skips it)"; }
fi

log "trimming apt caches, docs, man pages and locales"
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/var/log/* "$ROOTFS"/tmp/* "$ROOTFS"/var/tmp/*
find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
# The host's resolver config must not leak into the image.
: >"$ROOTFS/etc/resolv.conf"
# Record what the base is made of (for provenance / debugging).
chroot "$ROOTFS" dpkg-query -W -f '${Package}=${Version}\n' >"$ROOTFS/etc/mlsys-bench-base.packages"
PY_VERSION=$(chroot "$ROOTFS" python3 -c 'import platform; print(platform.python_version())')

log "importing as $BASE_IMAGE (python $PY_VERSION)"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --change "LABEL org.opencontainers.image.title=mlsys-bench-base org.opencontainers.image.base.name=debian:$SUITE org.mlsys-bench.debootstrap.mirror=$MIRROR org.mlsys-bench.python=$PY_VERSION" \
    --message "debootstrap --variant=minbase --include=$INCLUDE $SUITE $MIRROR" \
    - "$BASE_IMAGE" >/dev/null
log "built $BASE_IMAGE: $(docker image inspect --format '{{.Id}} {{.Size}} bytes' "$BASE_IMAGE")"
