#!/usr/bin/env bash
# The GPU host's rootless path, probed step by step (as root; every outcome is written, none stops
# the probe): tests/gpu/rootless_install.sh, then as the account: podman info, the sshd image
# imported, a container on the private network (slirp4netns) answering SSH on a published port,
# the GPU in a rootless container (nvidia-smi -L, tests/gpu/cudacheck.c's kernel), and the cgroup
# v2 experiment for docs/guides/limits.md: --memory/--pids-limit from inside the delegated subtree with
# and without --cgroup-parent, and a memory hog beside a second container.
#   tests/gpu/rootless_probe.sh BUNDLE OUT
bundle=$(cd "${1:?usage: rootless_probe.sh BUNDLE OUT}" && pwd)
out=${2:?usage: rootless_probe.sh BUNDLE OUT}
mkdir -p "$out"
account=gpubook
image=localhost/gpubook/gpu-sshd:test
step() { printf '\n===== %s\n' "$*"; }
try() { printf '$ %s\n' "$*"; "$@"; printf '[exit %s]\n' "$?"; }

step "host"
date -u; uname -a; head -2 /etc/os-release; id; nproc; free -g | head -2
cat /proc/self/cgroup; cat /sys/fs/cgroup/cgroup.subtree_control; ls /sys/fs/cgroup | head -40
cat /proc/swaps; ls -la /dev/nvidia* /dev/net/tun /dev/fuse
/usr/local/nvidia/bin/nvidia-smi -L || nvidia-smi -L
ls /usr/lib/python3/dist-packages 2>&1 | tr '\n' ' '; echo
try /usr/bin/python3 -c 'import ensurepip, sys; print(sys.version)'
for lib in libaudit.so.1 libselinux.so.1 libseccomp.so.2 libcap.so.2 libcrypt.so.1; do
  printf '%s: %s\n' "$lib" "$(ldconfig -p | grep -m1 "$lib " || echo missing)"
done

step "install (tests/gpu/rootless_install.sh)"
try bash "$(dirname "$0")/rootless_install.sh" "$bundle" "$account"
uid=$(id -u "$account")
ls -la /usr/local/bin/newuidmap /usr/local/bin/newgidmap; ldd /usr/local/bin/newuidmap
cat /etc/subuid /etc/subgid; ls -la /sys/fs/cgroup/gpubook; cat /sys/fs/cgroup/gpubook/cgroup.subtree_control
ldd /opt/pm/usr/bin/slirp4netns | grep -i 'not found' || echo "slirp4netns: every library found (with LD_LIBRARY_PATH of podman-wrap)"

# as the account, in the delegated leaf or not
as() { runuser -u "$account" -- env -i HOME="/home/$account" USER="$account" LOGNAME="$account" \
         XDG_RUNTIME_DIR="/run/user/$uid" PATH=/usr/local/bin:/usr/bin:/bin "$@"; }
in_leaf() { sh -c 'echo $$ > /sys/fs/cgroup/gpubook/daemon/cgroup.procs && exec "$@"' sh \
              runuser -u "$account" -- env -i HOME="/home/$account" USER="$account" LOGNAME="$account" \
              XDG_RUNTIME_DIR="/run/user/$uid" PATH=/usr/local/bin:/usr/bin:/bin "$@"; }
pm="podman --storage-driver overlay --cgroup-manager cgroupfs --events-backend file"

step "rootless podman info"
try as $pm info --format '{{.Host.Security.Rootless}} {{.Store.GraphDriverName}} {{.Host.CgroupsVersion}} {{.Host.CgroupManager}} {{.Host.OCIRuntime.Name}} slirp={{.Host.Slirp4NetNS.Executable}}'
try as $pm unshare cat /proc/self/uid_map

step "image import"
start=$(date +%s.%N)
xz -dc "$bundle/gpu-sshd.tar.xz" > /tmp/gpu-sshd.tar && chmod 644 /tmp/gpu-sshd.tar
try as $pm import -q /tmp/gpu-sshd.tar "$image"
echo "import took $(echo "$(date +%s.%N) - $start" | bc) s"
try as $pm run --rm "$image" sh -c 'id; cat /proc/self/uid_map'

step "private network: slirp4netns, sshd on a published port"
try as $pm run -d --name probe-ssh --network slirp4netns:port_handler=rootlesskit,allow_host_loopback=false \
  -p 127.0.0.1:22022:22 "$image" sh -c 'ssh-keygen -A >/dev/null && mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e'
for i in $(seq 1 50); do
  banner=$(timeout 2 python3 -c 'import socket; s=socket.create_connection(("127.0.0.1",22022),2); print(s.recv(64).decode().strip())' 2>/dev/null) && break
  sleep 0.2
done
echo "banner: ${banner:-none}"
try as $pm logs probe-ssh
try as $pm rm -f probe-ssh

step "GPU in a rootless container"
lib=/usr/local/nvidia/lib64
drv=$(ls $lib/libcuda.so.*.* | head -1); ver=${drv##*.so.}
cp "$bundle/cudacheck" /tmp/cudacheck && chmod 755 /tmp/cudacheck
try as $pm run --rm --network none --device /dev/nvidia0 --device /dev/nvidiactl --device /dev/nvidia-uvm \
  -v $lib/libnvidia-ml.so.$ver:/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.$ver:ro \
  -v $lib/libcuda.so.$ver:/usr/lib/x86_64-linux-gnu/libcuda.so.$ver:ro \
  -v $lib/libnvidia-ptxjitcompiler.so.$ver:/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.$ver:ro \
  -v /usr/local/nvidia/bin/nvidia-smi:/usr/bin/nvidia-smi:ro -v /tmp/cudacheck:/cudacheck:ro \
  "$image" sh -c 'ldconfig; ls -la /dev/nvidia*; nvidia-smi -L; /cudacheck'

step "cgroup v2: limits outside the delegated subtree (the account in root's cgroup)"
try as cat /proc/self/cgroup
try as $pm run --rm --network none --pids-limit 4096 "$image" cat /sys/fs/cgroup/pids.max
try as $pm run --rm --network none --memory 256m --pids-limit 100 "$image" sh -c 'cat /proc/self/cgroup /sys/fs/cgroup/memory.max /sys/fs/cgroup/pids.max'

step "cgroup v2: inside the delegated leaf /gpubook/daemon, no --cgroup-parent"
try in_leaf cat /proc/self/cgroup
try in_leaf $pm run --rm --network none --memory 256m --pids-limit 100 "$image" sh -c 'cat /proc/self/cgroup /sys/fs/cgroup/memory.max /sys/fs/cgroup/pids.max'
try in_leaf $pm run --rm --network none --pids-limit 4096 "$image" sh -c 'cat /proc/self/cgroup /sys/fs/cgroup/pids.max'

step "cgroup v2: inside the leaf, --cgroup-parent /gpubook/bookings"
try in_leaf $pm run --rm --network none --cgroup-parent /gpubook/bookings --memory 256m --pids-limit 100 "$image" \
  sh -c 'cat /proc/self/cgroup /sys/fs/cgroup/memory.max /sys/fs/cgroup/pids.max /sys/fs/cgroup/memory.swap.max'
find /sys/fs/cgroup/gpubook -maxdepth 3 -type d
cat /sys/fs/cgroup/gpubook/bookings/cgroup.subtree_control 2>&1

step "cgroup v2: --cgroups split, and the account's podman from outside the leaf with --cgroup-parent"
try in_leaf $pm run --rm --network none --cgroups split --memory 256m "$image" sh -c 'cat /proc/self/cgroup /sys/fs/cgroup/memory.max'
try as $pm run --rm --network none --cgroup-parent /gpubook/bookings --memory 256m --pids-limit 100 "$image" \
  sh -c 'cat /proc/self/cgroup /sys/fs/cgroup/memory.max /sys/fs/cgroup/pids.max'

step "memory hog (--memory 128m) beside a quiet container; pids bomb (--pids-limit 50)"
try in_leaf $pm run -d --name quiet --network none --cgroup-parent /gpubook/bookings --memory 128m "$image" sleep 300
try in_leaf $pm run --name hog --network none --cgroup-parent /gpubook/bookings --memory 128m --memory-swap 128m "$image" \
  sh -c 'cat /sys/fs/cgroup/memory.max; timeout 60 tail /dev/zero; echo "tail ended with $?"'
try as $pm inspect hog --format 'hog: exit {{.State.ExitCode}} oomkilled {{.State.OOMKilled}}'
try as $pm inspect quiet --format 'quiet: {{.State.Status}}'
try as $pm exec quiet sh -c 'echo quiet alive; cat /sys/fs/cgroup/memory.events'
try in_leaf $pm run --rm --network none --cgroup-parent /gpubook/bookings --pids-limit 50 "$image" \
  sh -c 'cat /sys/fs/cgroup/pids.max; for i in $(seq 1 200); do sleep 30 & done 2>&1 | tail -2; echo "started: $(jobs -p | wc -l)"; cat /sys/fs/cgroup/pids.events'
try as $pm rm -f hog quiet
grep -h oom_kill /sys/fs/cgroup/gpubook/bookings/*/memory.events 2>/dev/null
dmesg 2>/dev/null | grep -i -m5 'killed process'
free -m | head -2
uptime
step "end"; date -u
