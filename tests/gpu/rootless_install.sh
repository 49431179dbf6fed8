#!/usr/bin/env bash
# Run as root on the GPU test host (Ubuntu 24.04, no package registry): the rootless podman stack
# from the bundle of tests/gpu/prepare_rootless_bundle.sh, an unprivileged account that runs it, a
# delegated cgroup v2 subtree for that account, and gpubook's wheel installed into /opt/gpubook/venv
# with `pip install --no-index --find-links` (no checkout, no PYTHONPATH).
#   tests/gpu/rootless_install.sh BUNDLE [ACCOUNT [DATA_ROOT]]   (gpubook, /srv/gpubook-data)
# Idempotent: a second run finds each step done. Prints each step.
#
# The packages (what `apt-get install podman uidmap slirp4netns` does on a host with a registry)
# come from the bundle; gpubook goes into /opt/gpubook/venv as docs/guides/install.md says (`pip install
# --no-index --find-links BUNDLE/wheels`); then `gpubook setup --user ACCOUNT --data-root DATA_ROOT`
# does the admin's set-up, as it would on any host. Only what that setup leaves undone here is done
# by hand below, each saying so. BY_HAND=1 (or a gpubook without `setup`): every step by hand.
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
#   - a venv of the host's /usr/bin/python3 (/opt/gpubook/venv, docs/guides/install.md), the wheel and its
#     dependencies from BUNDLE/wheels only.
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
for pair in conmon:usr/bin/conmon runc:usr/sbin/runc podman:usr/bin/podman slirp4netns:usr/bin/slirp4netns; do
  name=${pair%%:*}
  printf '#!/bin/sh\nexport LD_LIBRARY_PATH=%s\nexec %s "$@"\n' "$libs" "$P/${pair#*:}" > "$P/$name-wrap"
  chmod 755 "$P/$name-wrap"
done
ln -sf "$P/podman-wrap" /usr/local/bin/podman
ln -sf "$P/slirp4netns-wrap" /usr/local/bin/slirp4netns  # on PATH, as the package puts it (doctor looks there)

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
network_cmd_path = "$P/slirp4netns-wrap"
runtime = "runc"
[engine.runtimes]
runc = ["$P/runc-wrap"]
EOC

say "/ made a shared mount (no systemd here: it is private, and rootless podman's namespace would never see a later mount such as data_root)"
mount --make-rshared /

say "gpubook's wheel into /opt/gpubook/venv, from $bundle/wheels only"
venv=/opt/gpubook/venv
wheel=$(ls "$bundle"/wheels/gpubook-*.whl)
if [ ! -x "$venv/bin/gpubook" ]; then
  begin=$(date +%s.%N)
  # Ubuntu's python3 has no ensurepip without python3-venv; its own pip (24.0) installs into the venv.
  /usr/bin/python3 -m venv --without-pip "$venv"
  pip=(/usr/bin/python3 -m pip --python "$venv/bin/python" --disable-pip-version-check)
  PIP_NO_CACHE_DIR=1 "${pip[@]}" install --quiet --no-index --find-links "$bundle/wheels" "$wheel"
  "${pip[@]}" check
  say "venv made in $(python3 -c "import time; print(round(time.time() - $begin, 1))") s: $(du -sh "$venv" | cut -f1)"
fi
"$venv/bin/gpubook" --version

uses_setup=no
if [ -z "${BY_HAND:-}" ] && "$venv/bin/gpubook" setup --help >/dev/null 2>&1; then
  uses_setup=yes
  say "gpubook setup --user $account --data-root $data --dry-run, then without --dry-run"
  "$venv/bin/gpubook" setup --user "$account" --data-root "$data" --dry-run || true
  begin=$(date +%s.%N)
  status=0
  "$venv/bin/gpubook" setup --user "$account" --data-root "$data" || status=$?
  say "gpubook setup: exit $status in $(python3 -c "import time; print(round(time.time() - $begin, 1))") s (its exit status is doctor's)"
fi
uid=$(id -u "$account")
gid=$(id -g "$account")
home=$(getent passwd "$account" | cut -d: -f6)

if [ "$uses_setup" = no ]; then
  say "by hand: account $account with subordinate ids, /run/user/$uid, /dev/net/tun, overlay storage.conf"
  id "$account" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$account"
  uid=$(id -u "$account"); gid=$(id -g "$account"); home=$(getent passwd "$account" | cut -d: -f6)
  for file in /etc/subuid /etc/subgid; do
    touch "$file"
    grep -q "^$account:" "$file" || echo "$account:1000000:1000000" >> "$file"
  done
  install -d -o "$uid" -g "$gid" -m 700 "/run/user/$uid"
  chmod 0666 /dev/net/tun
  install -d -o "$uid" -g "$gid" -m 755 "$home/.config" "$home/.config/containers"
  printf '[storage]\ndriver = "overlay"\nrunroot = "/run/user/%s/containers"\ngraphroot = "%s/.local/share/containers/storage"\n' \
    "$uid" "$home" > "$home/.config/containers/storage.conf"
  chown "$uid:$gid" "$home/.config/containers/storage.conf"
  say "by hand: data_root $data, a nosuid,nodev tmpfs owned by $account"
  mkdir -p "$data"
  mountpoint -q "$data" || mount -t tmpfs -o "nosuid,nodev,mode=0755,uid=$uid,gid=$gid,size=8g" tmpfs "$data"
fi

# A rootless namespace made before the data_root mount (the pause process of an earlier podman call)
# never sees it: podman system migrate ends that pause process (no booking may be running then).
# Seen on a GPU host kept from an earlier run. Where there is none, `podman unshare` makes it now.
if ! runuser -u "$account" -- env XDG_RUNTIME_DIR="/run/user/$uid" HOME="$home" podman unshare mountpoint -q "$data"; then
  say "$account's podman namespace predates the data_root mount: podman system migrate ends its pause process"
  runuser -u "$account" -- env XDG_RUNTIME_DIR="/run/user/$uid" HOME="$home" podman system migrate
fi

cg=/sys/fs/cgroup/gpubook
if [ "$(stat -c %u "$cg/daemon" 2>/dev/null)" != "$uid" ]; then
  say "by hand (setup did not delegate it): cgroup v2 subtree $cg delegated to $account (cpu memory pids), its leaf daemon"
  mkdir -p "$cg" "$cg/daemon"
  for controller in cpu memory pids; do
    grep -qw "$controller" /sys/fs/cgroup/cgroup.subtree_control || echo "+$controller" > /sys/fs/cgroup/cgroup.subtree_control
    grep -qw "$controller" "$cg/cgroup.subtree_control" || echo "+$controller" > "$cg/cgroup.subtree_control"
  done
  chown -R "$uid:$gid" "$cg"
else
  say "$cg is delegated to $account (by gpubook setup)"
fi
say "done: $account (uid $uid), podman $("$P/podman-wrap" --version | cut -d' ' -f3), gpubook $("$venv/bin/gpubook" --version), set up by $([ "$uses_setup" = yes ] && echo "gpubook setup" || echo hand)"
