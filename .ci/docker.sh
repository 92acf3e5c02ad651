#!/usr/bin/env bash
# Make a docker engine available for the container tests (tests/containers/test_container.py).
#
# - installs docker.io with apt when dockerd is missing (needs root + Debian's apt repos);
# - starts `dockerd --bridge=none --iptables=false --ip-masq=false` in the background
#   (no bridge / NAT: containers run with --network none or host only);
# - waits up to ~60 s for `docker info` to answer.
#
# It always exits 0: when no engine can be started it says why, and the container tests
# skip themselves (they ping the engine) instead of failing CI.
set -u

log() { echo "[.ci/docker.sh] $*"; }
DOCKERD_LOG=${DOCKERD_LOG:-/tmp/mlsys-bench-dockerd.log}
WAIT_S=${DOCKER_WAIT_S:-60}

engine_up() { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; }

if engine_up; then
    log "docker engine already reachable: $(docker version --format '{{.Server.Version}}' 2>/dev/null)"
    exit 0
fi

if ! command -v dockerd >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        log "dockerd missing and cannot install it (needs root and apt-get); container tests will be skipped"
        exit 0
    fi
    log "installing docker.io with apt-get"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io; } >/tmp/mlsys-bench-apt-docker.log 2>&1; then
        log "apt-get install docker.io failed (see /tmp/mlsys-bench-apt-docker.log): $(tail -n 1 /tmp/mlsys-bench-apt-docker.log)"
        log "container tests will be skipped"
        exit 0
    fi
fi

if [ "$(id -u)" != 0 ]; then
    log "engine not reachable and not root, cannot start dockerd; container tests will be skipped"
    exit 0
fi

if ! pgrep -x dockerd >/dev/null 2>&1; then
    log "starting dockerd (log: $DOCKERD_LOG)"
    # setsid: keep the engine alive after this script (and its process group) exits.
    setsid dockerd --bridge=none --iptables=false --ip-masq=false >"$DOCKERD_LOG" 2>&1 </dev/null &
fi

for _ in $(seq 1 "$WAIT_S"); do
    if engine_up; then
        log "docker engine up: server $(docker version --format '{{.Server.Version}}' 2>/dev/null), storage driver $(docker info --format '{{.Driver}}' 2>/dev/null)"
        exit 0
    fi
    if ! pgrep -x dockerd >/dev/null 2>&1; then
        break
    fi
    sleep 1
done

log "docker engine did not come up within ${WAIT_S}s; container tests will be skipped. Last dockerd log lines:"
tail -n 5 "$DOCKERD_LOG" 2>/dev/null | sed 's/^/    /'
exit 0
