#!/usr/bin/env bash
# On the GPU host, as root, after run_udocker_gpu.sh (its account has the sshd image in udocker's
# store): what udocker's own `setup --nvidia` gives a container, for the comparison with gpubook's
# injection (docs/guides/operate.md): which device nodes, which /proc/driver/nvidia entries, which
# driver files (copied into the container's root).
#   bash tests/gpu/udocker_setup_nvidia_probe.sh [ACCOUNT]
set -uo pipefail
account=${1:-gpubook-ud}
home=$(getent passwd "$account" | cut -d: -f6)
tree=$home/gpubook-tree
cd "$tree" || exit 1
runuser -u "$account" -- env -i HOME="$home" PATH="$tree/.bundle/site/bin:/usr/bin:/bin:/usr/sbin:/sbin" \
  PYTHONPATH="$tree/.bundle/site" UDOCKER_TARBALL= UDOCKER_DEFAULT_EXECUTION_MODE=R1 \
  UDOCKER_USE_RUNC_EXECUTABLE="${GPUBOOK_UDOCKER_RUNC:-/opt/pm/runc-wrap}" sh -c '
udocker rm -f nvprobe >/dev/null 2>&1
udocker create --name=nvprobe localhost/gpubook/gpu-sshd:test
echo "== udocker setup --nvidia"; udocker setup --nvidia nvprobe 2>&1 | tail -5
echo "== driver files copied into the container root"
ls "$HOME"/.udocker/containers/nvprobe/ROOT/usr/lib/x86_64-linux-gnu | grep -E "nvidia|cuda" | head -40
echo "== inside (udocker run, R1)"
udocker run --nobanner nvprobe /bin/sh -c "ls -l /dev/ | grep nvidia; echo /proc/driver/nvidia/gpus:; ls /proc/driver/nvidia/gpus" 2>&1 | tail -20
udocker rm -f nvprobe >/dev/null 2>&1'
