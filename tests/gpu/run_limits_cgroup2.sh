#!/usr/bin/env bash
# On the GPU host, as root, after tests/gpu/rootless_install.sh (run_install_gpu.sh): the limits
# work's tests/test_limits_cgroup2.py as the daemon's account, started in the delegated leaf
# /sys/fs/cgroup/gpubook/daemon as docs/guides/limits.md says, importing the installed wheel.
#   tests/gpu/run_limits_cgroup2.sh BUNDLE OUT
# The debian-ssh template's image is built with mmdebstrap, which the GPU host lacks: the bundle's
# sshd image (Debian 12 minbase + openssh-server + sudo, no python3) stands in for it in the
# account's store, under the template's name, for the test's bookings.
set -uo pipefail
bundle=$(cd "${1:?usage: run_limits_cgroup2.sh BUNDLE OUT}" && pwd)
out=${2:?usage: run_limits_cgroup2.sh BUNDLE OUT}
mkdir -p "$out"
account=gpubook
uid=$(id -u "$account"); gid=$(id -g "$account"); home=$(getent passwd "$account" | cut -d: -f6)
site=$(echo /opt/gpubook/venv/lib/python3*/site-packages)
as_account=(setpriv "--reuid=$uid" "--regid=$gid" --clear-groups -- env -i HOME="$home" USER="$account"
            LOGNAME="$account" XDG_RUNTIME_DIR="/run/user/$uid" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8)
image=localhost/gpubook/debian-ssh:12
if ! "${as_account[@]}" podman image exists "$image"; then
  xz -dc "$bundle/gpu-sshd.tar.xz" > /tmp/gpu-sshd-limits.tar && chmod 644 /tmp/gpu-sshd-limits.tar
  "${as_account[@]}" podman --storage-driver overlay import -q /tmp/gpu-sshd-limits.tar "$image"
  rm -f /tmp/gpu-sshd-limits.tar
fi
tree=/tmp/gpubook-limits-tree  # the tests, readable by the account; no gpubook/ beside them
rm -rf "$tree" && mkdir -p "$tree" && cp -r tests "$tree/" && chmod -R a+rX "$tree"
cd "$tree" || exit 1
sh -c 'echo $$ > /sys/fs/cgroup/gpubook/daemon/cgroup.procs && exec "$@"' sh "${as_account[@]}" \
  PYTHONPATH="$tree:$site:$bundle/testsite" GPUBOOK_TEST_DATA_ROOT=/srv/gpubook-data \
  "$(command -v python3)" -m pytest tests/test_limits_cgroup2.py -v -rs -p no:cacheprovider 2>&1 | tee "$out/limits-cgroup2.log" | tail -40
echo "limits pytest: exit ${PIPESTATUS[0]}"
