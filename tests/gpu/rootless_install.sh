#!/usr/bin/env bash
# Run as root on the GPU test host (Ubuntu 24.04, no package registry): the rootless podman stack
# from the bundle of tests/gpu/prepare_rootless_bundle.sh, an unprivileged account that runs it, a
# delegated cgroup v2 subtree for that account, and gpubook's wheel installed into the account's
# own venv with `pip install --no-index --find-links` (no checkout, no PYTHONPATH).
#   tests/gpu/rootless_install.sh BUNDLE [ACCOUNT [DATA_ROOT]]   (gpubook, /srv/gpubook-data)
# Idempotent: a second run finds each step done. Prints each step.
#
# What it does, and why (../shared/gpuhost/README.md has the host's facts):
#   - the Debian 12 podman debs unpacked into /opt/pm with wrappers for their private libraries
#     (as podman-on-gpuhost.sh), runc, nofile/nproc ulimits runc accepts there, slirp4netns
#     (rootless podman's private network) found through helper_binaries_dir;
#   - newuidmap/newgidmap (Debian's uidmap) into /usr/local/bin, setuid root: rootless podman
#     needs them to map the account's subordinate ids; they need only libaudit, libselinux and
#     libc, which Ubuntu has (a setuid binary ignores LD_LIBRARY_PATH);
#   - the account with /etc/subuid and /etc/subgid ranges, /run/user/UID, an overlay storage.conf,
#     /dev/net/tun opened to everyone (slirp4netns opens it in the account's namespace);
#   - /sys/fs/cgroup/gpubook owned by the account with cpu, memory and pids enabled for its
#     children (there is no systemd to delegate one): the daemon is started in its leaf "daemon",
#     and podman puts each booking's container beside it (--cgroup-parent);
#   - / made a shared mount and data_root mounted (a nosuid,nodev tmpfs here) BEFORE the account's
#     first podman call: without systemd, / is private, so rootless podman's mount namespace (made
#     once, by its first call) never sees a mount made later; seen here: every start failed with
#     "podman unshare chown DATA_ROOT/alice: No such file or directory";
#   - a venv of the host's /usr/bin/python3 for the account, the wheel and its dependencies from
#     BUNDLE/wheels only.
set -euo pipefail
bundle=$(cd "${1:?usage: rootless_install.sh BUNDLE [ACCOUNT]}" && pwd)
account=${2:-gpubook}
data=${3:-/srv/gpubook-data}
P=/opt/pm
say() { printf 'setup: %s\n' "$*"; }

say "podman stack: the bundle's debs into $P"
mkdir -p "$P"
for deb in "$bundle"/debs/*.deb; do dpkg -x "$deb" "$P"; done
libs="$P/lib/x86_64-linux-gnu:$P/usr/lib/x86_64-linux-gnu"
for pair in conmon:usr/bin/conmon runc:usr/sbin/runc podman:usr/bin/podman; do
  name=${pair%%:*}
  printf '#!/bin/sh\nexport LD_LIBRARY_PATH=%s\nexec %s "$@"\n' "$libs" "$P/${pair#*:}" > "$P/$name-wrap"
  chmod 755 "$P/$name-wrap"
done
ln -sf "$P/podman-wrap" /usr/local/bin/podman

say "newuidmap and newgidmap: setuid root in /usr/local/bin"
for tool in newuidmap newgidmap; do
  install -o root -g root -m 4755 "$P/usr/bin/$tool" "/usr/local/bin/$tool"
done

say "/etc/containers: runc, conmon and slirp4netns from $P, ulimits runc accepts here"
mkdir -p /etc/containers
cp "$P/etc/containers/policy.json" /etc/containers/policy.json
cat > /etc/containers/containers.conf <<EOC
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
conmon_path = ["$P/conmon-wrap"]
helper_binaries_dir = ["$P/usr/libexec/podman", "$P/usr/bin", "$P/usr/lib/podman"]
network_cmd_path = "$P/usr/bin/slirp4netns"
runtime = "runc"
[engine.runtimes]
runc = ["$P/runc-wrap"]
EOC

say "account $account with subordinate ids"
id "$account" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$account"
uid=$(id -u "$account")
gid=$(id -g "$account")
home=$(getent passwd "$account" | cut -d: -f6)
for file in /etc/subuid /etc/subgid; do
  touch "$file"
  grep -q "^$account:" "$file" || echo "$account:1000000:1000000" >> "$file"
done
install -d -o "$uid" -g "$gid" -m 700 "/run/user/$uid"
chmod 0666 /dev/net/tun
install -d -o "$uid" -g "$gid" -m 755 "$home/.config" "$home/.config/containers"
cat > "$home/.config/containers/storage.conf" <<EOC
[storage]
driver = "overlay"
runroot = "/run/user/$uid/containers"
graphroot = "$home/.local/share/containers/storage"
EOC
chown "$uid:$gid" "$home/.config/containers/storage.conf"

say "/ made a shared mount; data_root $data: a nosuid,nodev tmpfs owned by $account"
mount --make-rshared /
mkdir -p "$data"
mountpoint -q "$data" || mount -t tmpfs -o "nosuid,nodev,mode=0755,uid=$uid,gid=$gid,size=8g" tmpfs "$data"

# A rootless namespace made before the mount (the pause process of an earlier podman call) never
# sees it: podman system migrate ends that pause process (no booking may be running then). Seen on
# a GPU host kept from an earlier run. Where there is none, `podman unshare` makes it now.
if ! runuser -u "$account" -- env XDG_RUNTIME_DIR="/run/user/$uid" HOME="$home" podman unshare mountpoint -q "$data"; then
  say "$account's podman namespace predates the data_root mount: podman system migrate ends its pause process"
  runuser -u "$account" -- env XDG_RUNTIME_DIR="/run/user/$uid" HOME="$home" podman system migrate
fi

say "cgroup v2 subtree /sys/fs/cgroup/gpubook delegated to $account (cpu memory pids)"
cg=/sys/fs/cgroup/gpubook
mkdir -p "$cg" "$cg/daemon"
for controller in cpu memory pids; do
  grep -qw "$controller" /sys/fs/cgroup/cgroup.subtree_control || echo "+$controller" > /sys/fs/cgroup/cgroup.subtree_control
  grep -qw "$controller" "$cg/cgroup.subtree_control" || echo "+$controller" > "$cg/cgroup.subtree_control"
done
chown -R "$uid:$gid" "$cg"

say "a venv of /usr/bin/python3 for $account with the wheel from $bundle/wheels only"
venv=$home/venv
if ! ls "$bundle"/wheels/gpubook-*.whl >/dev/null 2>&1; then
  say "no gpubook wheel in $bundle/wheels: the venv is left out"
  exit 0
fi
if [ ! -x "$venv/bin/gpubook" ]; then
  # Ubuntu's python3 has no ensurepip without python3-venv; its own pip (24.0) installs into the
  # venv with --python.
  as_account() { runuser -u "$account" -- env HOME="$home" PIP_NO_CACHE_DIR=1 "$@"; }
  as_account /usr/bin/python3 -m venv --without-pip "$venv"
  pip=(as_account /usr/bin/python3 -m pip --python "$venv/bin/python" --disable-pip-version-check)
  wheel=$(ls "$bundle"/wheels/gpubook-*.whl)
  if ! "${pip[@]}" install --quiet --no-index --find-links "$bundle/wheels" "$wheel"; then
    say "pip could not resolve the wheel's dependencies from the bundle (above): every bundled wheel is installed without resolving; pip check says what is missing"
    "${pip[@]}" install --quiet --no-index --no-deps "$bundle"/wheels/*.whl
  fi
  "${pip[@]}" check || true
fi
runuser -u "$account" -- "$venv/bin/gpubook" --version
say "done: $account (uid $uid), podman $("$P/podman-wrap" --version | cut -d' ' -f3), venv $venv"
