#!/usr/bin/env bash
# Smoke test of the real kvservice image, with no base-image registry:
#
#   1. makes a Debian base root filesystem with debootstrap (cached in .cache/image/) and imports
#      it with podman; builds the Dockerfile's target (default cpu) on it;
#   2. starts the image's own ENTRYPOINT with its own ENV, the way a cluster does, three ways:
#        user    as the image's USER, writable container root
#        anyuid  as an arbitrary uid with gid 0 (OpenShift), writable container root
#        readonly  as the image's USER on the read-only image filesystem, only /tmp (tmpfs) and the
#                  socket dir writable
#      (the OCI runtime cannot set rlimits in this sandbox, so the entrypoint runs under
#      `chroot --userspec` in a private mount namespace with /proc, /sys, /dev, /dev/shm);
#   3. each time: health over the UDS from outside, the image's HEALTHCHECK command inside, the
#      native lane serving from the module prebuilt into the image (no compiler in the image) with
#      its socket <uds>.lane, one real transfer by an engine process outside the container (shared
#      socket dir and /dev/shm) and one by an engine inside it (the image's own Python and SDK),
#      each verified byte for byte and sent over the lane, and nothing written under /opt.
#
#   sudo bash scripts/image-smoke.sh [cpu|gpu]     # needs root, podman, debootstrap; ~10 min cold
#
# Prints one line per check and the image size; exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-cpu}
SUITE=${SUITE:-trixie}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CACHE=.cache/image
TAG=localhost/kvservice:$TARGET
mkdir -p "$CACHE"

need() { command -v "$1" >/dev/null || { echo "missing $1 (apt-get install podman debootstrap)"; exit 2; }; }
need podman; need debootstrap; need unshare; need chroot
[ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, chroot and mounts need it)"; exit 2; }
bash scripts/setup.sh >/dev/null 2>&1 || { echo "scripts/setup.sh failed"; exit 1; }
# The engine runs outside the container as the service's uid (POSIX shm pools are 0600), so it
# needs a Python that uid can run: a world-readable venv with only the client SDK.
ENGINE_VENV=${ENGINE_VENV:-/tmp/kvservice-smoke-engine}
[ -x "$ENGINE_VENV/bin/python" ] || /usr/bin/python3 -m venv "$ENGINE_VENV"
"$ENGINE_VENV/bin/pip" install -q --force-reinstall --no-deps ./clients/python >/dev/null  # this checkout's SDK
"$ENGINE_VENV/bin/pip" install -q ./clients/python >/dev/null
chmod -R a+rX "$ENGINE_VENV"
cp scripts/image_smoke_engine.py "$ENGINE_VENV/engine.py"

# -- 1. base and build -------------------------------------------------------------------------
BASE=localhost/kvservice-base:$SUITE
if ! podman image exists "$BASE"; then
  if [ ! -f "$CACHE/base-$SUITE.tar" ]; then
    rm -rf "$CACHE/rootfs"
    debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$CACHE/rootfs" "$MIRROR" >"$CACHE/debootstrap.log"
    tar -C "$CACHE/rootfs" -cf "$CACHE/base-$SUITE.tar" .
    rm -rf "$CACHE/rootfs"
  fi
  podman import "$CACHE/base-$SUITE.tar" "$BASE" >/dev/null
fi
t0=$(date +%s)
build_args=(--format docker --build-arg BASE="$BASE" --target "$TARGET" -t "$TAG")  # docker: keeps HEALTHCHECK
cert=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}  # a TLS-inspecting proxy's CA reaches pip
[ -f "$cert" ] && build_args+=(-v "$cert:/run/build-ca.crt:ro" --build-arg PIP_CERT=/run/build-ca.crt)
podman build --isolation chroot "${build_args[@]}" . >"$CACHE/build-$TARGET.log" 2>&1 \
  || { echo "FAIL: build; see $CACHE/build-$TARGET.log"; tail -20 "$CACHE/build-$TARGET.log"; exit 1; }
echo "build: ok ($(( $(date +%s) - t0 )) s)"
size=$(podman image inspect --format '{{.Size}}' "$TAG")
echo "size: $TAG $(( size / 1000000 )) MB ($size bytes)"

# The image's own configuration: environment, user, entrypoint, healthcheck.
mapfile -t ENV < <(podman image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$TAG" | grep .)
USER_=$(podman image inspect --format '{{.Config.User}}' "$TAG")
mapfile -t ENTRY < <(podman image inspect --format '{{range .Config.Entrypoint}}{{println .}}{{end}}' "$TAG" | grep .)
mapfile -t HC < <(podman image inspect --format '{{range .HealthCheck.Test}}{{println .}}{{end}}' "$TAG" | grep .)
UDS=$(printf '%s\n' "${ENV[@]}" | sed -n 's/^KVSERVICE_UDS_PATH=//p')  # the socket path inside
[ "${HC[0]}" = CMD ] || { echo "unexpected HEALTHCHECK form: ${HC[*]}"; exit 1; }
HC=("${HC[@]:1}")
img_root=$(podman image mount "$TAG")
user_gid=$(awk -F: -v u="$USER_" '$1==u || $3==u {print $4}' "$img_root/etc/passwd")
if touch "$img_root/opt/.probe" 2>/dev/null; then echo "FAIL: image mount is writable"; exit 1; fi
# The native lane is prebuilt (KVSERVICE_NATIVE_DIR) and nothing in the image could build it again.
NATIVE_DIR=$(printf '%s\n' "${ENV[@]}" | sed -n 's/^KVSERVICE_NATIVE_DIR=//p')
native_so=$(cd "$img_root" && ls -d ."$NATIVE_DIR"/*/kvservice_lane*.so 2>/dev/null | sed 's/^\.//' || true)
[ -n "$NATIVE_DIR" ] && [ -n "$native_so" ] || { echo "FAIL: no prebuilt native lane under '$NATIVE_DIR'"; exit 1; }
for cc in gcc g++ cc c++ clang; do
  if [ -e "$img_root/usr/bin/$cc" ]; then echo "FAIL: the image holds a compiler (/usr/bin/$cc)"; exit 1; fi
done
echo "native lane: prebuilt $native_so; no compiler in the image"
podman image umount "$TAG" >/dev/null
echo "image config: USER $USER_ (gid ${user_gid:-?}), ENTRYPOINT ${ENTRY[*]}, HEALTHCHECK ${HC[*]}"

# -- 2./3. run it three ways ----------------------------------------------------------------------
run_way() {  # way userspec
  local way=$1 spec=$2 root cid="" sock
  sock=$(mktemp -d /tmp/kvs-smoke-sock.XXXX)
  chown "${spec%%:*}:${spec##*:}" "$sock"; chmod 0770 "$sock"
  if [ "$way" = readonly ]; then
    root=$(podman image mount "$TAG")
  else
    cid=$(podman create --entrypoint /bin/true "$TAG")
    root=$(podman mount "$cid")
  fi
  local envs=("${ENV[@]}" "KVSERVICE_TCP_ADDRESS=127.0.0.1:0" "KVSERVICE_INSECURE=true" "KVSERVICE_METRICS_PORT=0")
  # shellcheck disable=SC2016
  unshare --mount --propagation private bash -c '
    root=$1 sock=$2 spec=$3; shift 3
    mount -t proc proc "$root/proc"; mount --rbind /sys "$root/sys"; mount --rbind /dev "$root/dev"
    mount --bind /dev/shm "$root/dev/shm"
    mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
    mount --bind "$sock" "$root/run/kvservice"
    exec chroot --userspec="$spec" "$root" env -i "$@"
  ' _ "$root" "$sock" "$spec" "${envs[@]}" "${ENTRY[@]}" >"$sock.log" 2>&1 &
  local pid=$! ok=0
  for _ in $(seq 1 120); do
    if .venv/bin/kvservice health --address "unix:$sock/kvservice.sock" >/dev/null 2>&1; then ok=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
  done
  if [ $ok != 1 ]; then
    echo "FAIL [$way]: no health over the UDS; service output:"; tail -20 "$sock.log"; kill $pid 2>/dev/null; exit 1
  fi
  echo "[$way] health over the UDS: SERVING"
  # The image's HEALTHCHECK command, run inside the same container root as the same user.
  unshare --mount --propagation private bash -c '
    root=$1 sock=$2; shift 2
    mount -t proc proc "$root/proc"; mount --bind "$sock" "$root/run/kvservice"; mount -t tmpfs tmpfs "$root/tmp"
    exec chroot --userspec="$0" "$root" env -i "$@"' "$spec" "$root" "$sock" "${ENV[@]}" "${HC[@]}" >/dev/null \
    || { echo "FAIL [$way]: HEALTHCHECK command"; kill $pid; exit 1; }
  echo "[$way] HEALTHCHECK (${HC[*]}): ok"
  # The native lane: started in the background after SERVING, from the prebuilt module (with no
  # compiler and a read-only /opt a build could not happen, and would say "native lane off").
  for _ in $(seq 1 60); do
    grep -q 'native lane serving\|native lane off' "$sock.log" && break
    sleep 0.5
  done
  if ! grep -q 'native lane serving' "$sock.log" || [ ! -S "$sock/kvservice.sock.lane" ]; then
    echo "FAIL [$way]: native lane not serving; service output:"; grep -i lane "$sock.log" | tail -5; kill $pid; exit 1
  fi
  echo "[$way] native lane serving (prebuilt module), socket ${UDS}.lane"
  # One real transfer from an engine outside the container, as the service's uid (shm is 0600).
  setpriv --reuid "${spec%%:*}" --regid "${spec##*:}" --clear-groups \
    env HOME=/tmp "$ENGINE_VENV/bin/python" "$ENGINE_VENV/engine.py" "unix:$sock/kvservice.sock" "unix:$UDS" \
      --expect-lane | sed "s/^/[$way] outside engine: /" \
    || { echo "FAIL [$way]: transfer from outside"; tail -20 "$sock.log"; kill $pid; exit 1; }
  # The same from an engine inside the container: the image's Python and SDK, same user, same
  # filesystem (read-only in the readonly way), the script on stdin.
  # shellcheck disable=SC2016
  unshare --mount --propagation private bash -c '
    root=$1 sock=$2 spec=$3; shift 3
    mount -t proc proc "$root/proc"; mount --rbind /dev "$root/dev"; mount --bind /dev/shm "$root/dev/shm"
    mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"; mount --bind "$sock" "$root/run/kvservice"
    exec chroot --userspec="$spec" "$root" env -i "$@"
  ' _ "$root" "$sock" "$spec" "${ENV[@]}" python - "unix:$UDS" "unix:$UDS" --expect-lane \
    <scripts/image_smoke_engine.py | sed "s/^/[$way] inside engine: /" \
    || { echo "FAIL [$way]: transfer from inside"; tail -20 "$sock.log"; kill $pid; exit 1; }
  kill -TERM $pid; wait $pid || true
  grep -q '"kvservice stopped"\|kvservice stopped' "$sock.log" || { echo "FAIL [$way]: no clean stop"; tail "$sock.log"; exit 1; }
  if [ -n "$cid" ]; then
    changed=$(podman diff "$cid" | grep -E ' /opt' || true)
    [ -z "$changed" ] || { echo "FAIL [$way]: wrote into the image: $changed"; exit 1; }
    echo "[$way] nothing written under /opt; clean stop on SIGTERM"
    podman umount "$cid" >/dev/null; podman rm "$cid" >/dev/null
  else
    echo "[$way] read-only root held; clean stop on SIGTERM"
    podman image umount "$TAG" >/dev/null
  fi
  rm -rf "$sock" "$sock.log"
}

run_way user "$USER_:${user_gid:-0}"
run_way anyuid "1234567:0"
run_way readonly "$USER_:${user_gid:-0}"
echo "image smoke: all checks passed ($TAG)"
