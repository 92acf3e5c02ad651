#!/usr/bin/env bash
# Build the CPU image (containers/Dockerfile) without pulling from any registry.
#
#   1. makes sure the local base image exists (containers/build_base.sh; skipped if present);
#   2. builds the mlsys-bench wheel from a clean copy of the working tree (tracked + untracked,
#      not ignored files), so stale build/ output never leaks into the wheel;
#   3. builds/collects every dependency wheel on the host (torch CPU comes from the local
#      wheelhouse / pip find-links), pinned to the versions of the host environment
#      (`pip freeze` of $PYTHON) so the image runs what the tests ran; a persistent
#      wheelhouse makes rebuilds offline and fast;
#   4. `docker build --network host`: the dependency wheels are served read-only to the build
#      on http://127.0.0.1:$WHEEL_PORT (python -m http.server, loopback only, stopped after
#      the build) so they never become an image layer; pip inside runs with --no-index and
#      --require-hashes (requirements.txt carries every wheel's sha256).
#
# Environment knobs:
#   IMAGE        tag to build                       (default mlsys-bench:cpu)
#   BASE_IMAGE   base image                         (default mlsys-bench-base:bookworm)
#   PYTHON       host CPython 3.11 used for pip     (default $VIRTUAL_ENV/bin/python, else python3)
#   CACHE_DIR    context + wheelhouse location      (default ${XDG_CACHE_HOME:-~/.cache}/mlsys-bench)
#   WHEEL_PORT   loopback port for the wheel server (default 38573; a fixed port keeps the
#                dependency layer cacheable)
#   NO_PIN=1     do not pin dependencies to the host environment's versions
# Needs a docker engine on this host (the build reaches the wheel server over the host's
# loopback; a remote DOCKER_HOST cannot).
# Prints the image id on the last line of stdout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
IMAGE=${IMAGE:-mlsys-bench:cpu}
BASE_IMAGE=${BASE_IMAGE:-mlsys-bench-base:bookworm}
if [ -z "${PYTHON:-}" ]; then
    if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PYTHON=$VIRTUAL_ENV/bin/python; else PYTHON=python3; fi
fi
CACHE_DIR=${CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mlsys-bench}
WHEEL_PORT=${WHEEL_PORT:-38573}
CONTEXT=$CACHE_DIR/image-context    # docker build context: requirements.txt, wheels/project/
DEPS=$CACHE_DIR/deps-wheels          # this build's dependency wheels (served during the build)
WHEELHOUSE=$CACHE_DIR/wheelhouse

log() { echo "[build_image] $*" >&2; }
die() { echo "[build_image] error: $*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }

docker info >/dev/null 2>&1 || die "docker engine not reachable: start dockerd (bash .ci/docker.sh) or set DOCKER_HOST"

# 1. base image ---------------------------------------------------------------------------
T0=$(now)
BASE_IMAGE=$BASE_IMAGE bash "$HERE/build_base.sh"
log "base image ready ($(elapsed "$T0"))"

# The wheels must match the image's interpreter (cp311 on bookworm).
BASE_PY=$(docker image inspect --format '{{ index .Config.Labels "org.mlsys-bench.python" }}' "$BASE_IMAGE" 2>/dev/null || true)
HOST_PY=$("$PYTHON" -c 'import platform; print(platform.python_version())') || die "PYTHON=$PYTHON does not run"
if [ -n "$BASE_PY" ] && [ "${BASE_PY%.*}" != "${HOST_PY%.*}" ]; then
    die "host python $HOST_PY ($PYTHON) does not match the base image's python $BASE_PY: set PYTHON to a CPython ${BASE_PY%.*}"
fi

# 2. project wheel from a clean copy of the tree -----------------------------------------
T1=$(now)
mkdir -p "$CACHE_DIR"
exec 9>"$CACHE_DIR/.lock"
flock 9    # one build at a time per cache dir
rm -rf "$CONTEXT" "$DEPS"
mkdir -p "$CONTEXT/wheels/project" "$DEPS" "$WHEELHOUSE"
SRC=$(mktemp -d "${TMPDIR:-/tmp}/mlsys-bench-src.XXXXXX")
SERVER_PID=
cleanup() {
    [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null
    rm -rf "$SRC"
}
trap cleanup EXIT
GIT_COMMIT=unknown
GIT_DIRTY=unknown
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
        | xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' _ \
        | tar --null -T - -cf -) | tar -C "$SRC" -xf -
    GIT_COMMIT=$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)
    if [ -n "$(git -C "$REPO" status --porcelain 2>/dev/null)" ]; then GIT_DIRTY=true; else GIT_DIRTY=false; fi
else
    tar -C "$REPO" --exclude=./build --exclude=./dist --exclude='*.egg-info' --exclude=./results \
        --exclude=./outputs --exclude=./multirun --exclude=./wandb --exclude=__pycache__ -cf - . | tar -C "$SRC" -xf -
fi
BUILD_ISOLATION=--no-build-isolation
"$PYTHON" -c 'import setuptools, wheel' 2>/dev/null || BUILD_ISOLATION=
# shellcheck disable=SC2086
"$PYTHON" -m pip wheel --quiet --no-deps $BUILD_ISOLATION --wheel-dir "$CONTEXT/wheels/project" "$SRC" \
    || die "building the mlsys-bench wheel failed"
PROJECT_WHEEL=$(ls "$CONTEXT"/wheels/project/mlsys_bench-*.whl)
log "project wheel $(basename "$PROJECT_WHEEL") (commit ${GIT_COMMIT:0:12}, dirty=$GIT_DIRTY) ($(elapsed "$T1"))"

# 3. dependency wheels ---------------------------------------------------------------------
T2=$(now)
CONSTRAINTS=$CACHE_DIR/constraints.txt
: >"$CONSTRAINTS"
if [ "${NO_PIN:-0}" != 1 ]; then
    # Pin to what the host environment runs; skip editable/local (" @ ") entries.
    "$PYTHON" -m pip freeze --exclude-editable 2>/dev/null | grep -v ' @ ' | grep '==' >"$CONSTRAINTS" || true
fi
wheel_deps() {  # extra pip args...
    "$PYTHON" -m pip wheel --quiet --wheel-dir "$DEPS" \
        --find-links "$WHEELHOUSE" --find-links "$CONTEXT/wheels/project" \
        --constraint "$CONSTRAINTS" --prefer-binary "$@" "$PROJECT_WHEEL"
}
if wheel_deps --no-index >"$CACHE_DIR/pip-wheel.log" 2>&1; then
    log "dependency wheels from the local wheelhouse (offline)"
else
    log "wheelhouse incomplete, resolving with the package index"
    wheel_deps >"$CACHE_DIR/pip-wheel.log" 2>&1 \
        || { grep -v 'is ignored: it is neither' "$CACHE_DIR/pip-wheel.log" | tail -n 20 >&2; die "collecting dependency wheels failed"; }
fi
rm -f "$DEPS"/mlsys_bench-*.whl
cp -n "$DEPS"/*.whl "$WHEELHOUSE"/ 2>/dev/null || true
# Exact pins + hashes for the image, from {name}-{version}(-{build})?-{py}-{abi}-{plat}.whl
(cd "$DEPS" && for w in *.whl; do
    echo "$(echo "$w" | cut -d- -f1)==$(echo "$w" | cut -d- -f2) --hash=sha256:$(sha256sum "$w" | cut -d' ' -f1)"
done) | sort >"$CONTEXT/requirements.txt"
log "$(wc -l <"$CONTEXT/requirements.txt") dependency wheels, $(du -sh "$DEPS" | cut -f1) ($(elapsed "$T2"))"

# 4. docker build ----------------------------------------------------------------------------
T3=$(now)
OLD_ID=$(docker image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
# Only requirements.txt and the project wheel are sent as the build context; the
# dependency wheels ($DEPS) are served on the loopback for the pip step.
"$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', $WHEEL_PORT)); s.close()" 2>/dev/null \
    || die "port $WHEEL_PORT on 127.0.0.1 is busy: set WHEEL_PORT to a free port"
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$DEPS" "$WHEEL_PORT" \
    >"$CACHE_DIR/wheel-server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 50); do
    "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$WHEEL_PORT/', timeout=1)" 2>/dev/null && break
    sleep 0.1
done
if ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0   # no buildx plugin: use the classic builder
fi
docker build \
    --network host \
    --file "$HERE/Dockerfile" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --build-arg "WHEEL_PORT=$WHEEL_PORT" \
    --build-arg "GIT_COMMIT=$GIT_COMMIT" \
    --build-arg "GIT_DIRTY=$GIT_DIRTY" \
    --tag "$IMAGE" \
    "$CONTEXT" >"$CACHE_DIR/docker-build.log" 2>&1 \
    || { tail -n 30 "$CACHE_DIR/docker-build.log" >&2; die "docker build failed (full log: $CACHE_DIR/docker-build.log)"; }
kill "$SERVER_PID" 2>/dev/null; SERVER_PID=
IMAGE_ID=$(docker image inspect --format '{{.Id}}' "$IMAGE")
# The previous build of this tag is now untagged: drop it (its shared layers stay; an image
# still used by a container, or tagged elsewhere, is kept).
if [ -n "$OLD_ID" ] && [ "$OLD_ID" != "$IMAGE_ID" ] \
   && [ "$(docker image inspect --format '{{len .RepoTags}}' "$OLD_ID" 2>/dev/null)" = 0 ]; then
    docker image rm "$OLD_ID" >/dev/null 2>&1 || true
fi
SIZE=$(docker image inspect --format '{{.Size}}' "$IMAGE")
log "built $IMAGE $IMAGE_ID, $((SIZE / 1000000)) MB ($(elapsed "$T3")); total $(elapsed "$T0")"
echo "$IMAGE_ID"
