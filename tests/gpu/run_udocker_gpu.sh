#!/usr/bin/env bash
# On the GPU host, as root (commands run as root there; udocker refuses root): make an ordinary
# account, give it the source tree and the bundle's site folder, a nosuid,nodev data mount and a
# runtime folder, and run tests/gpu/test_udocker_gpu.py as that account, results under OUT.
#   source .bundle/podman-on-gpuhost.sh .bundle && source .bundle/install-daemon-deps.sh .bundle
#   bash tests/gpu/run_udocker_gpu.sh .bundle OUT [ACCOUNT]
# Nothing is given to the account but what any user of a lab server has: the GPUs' device nodes
# (0666, as the driver makes them), the driver's files, the host's runc and Python.
set -uo pipefail
bundle=$(cd "${1:?usage: run_udocker_gpu.sh BUNDLE OUT [ACCOUNT]}" && pwd)
out=${2:?usage: run_udocker_gpu.sh BUNDLE OUT [ACCOUNT]}
account=${3:-gpubook-ud}
python=${GPUBOOK_PYTHON:-$(command -v python3)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
{
  id "$account" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$account"
  uid=$(id -u "$account")
  home=$(getent passwd "$account" | cut -d: -f6)
  tree=$home/gpubook-tree
  rm -rf "$tree" && mkdir -p "$tree"
  tar --exclude=./.bundle --exclude=./.git -cf - . | tar -C "$tree" -xf -
  mkdir -p "$tree/.bundle" && cp -a "$bundle/site" "$bundle/cudacheck" "$bundle/gpu-sshd.tar.xz" "$tree/.bundle/"
  if [ ! -x "$tree/.bundle/site/bin/udocker" ]; then  # the wheels unpacked without pip: no scripts
    mkdir -p "$tree/.bundle/site/bin"
    printf '#!%s\nimport sys\nfrom udocker.maincmd import main\nsys.exit(main())\n' "$python" > "$tree/.bundle/site/bin/udocker"
    chmod 755 "$tree/.bundle/site/bin/udocker"
  fi
  chown -R "$account:" "$tree"
  mkdir -p "/run/user/$uid" && chown "$account:" "/run/user/$uid" && chmod 700 "/run/user/$uid"
  data=/srv/$account-data
  mkdir -p "$data"
  mountpoint -q "$data" || mount -t tmpfs -o nosuid,nodev,mode=0755,size=2g tmpfs "$data"
  chown "$account:" "$data"
  results=$home/results  # OUT may be under root's home, which the account cannot reach
  rm -rf "$results" && mkdir -p "$results" && chown "$account:" "$results"
  echo "account $account (uid $uid), python $python, runc ${GPUBOOK_UDOCKER_RUNC:-/opt/pm/runc-wrap}"
  ls -l /dev/nvidia* ; cat /proc/sys/kernel/unprivileged_userns_clone 2>/dev/null; unshare --version
} > "$out/udocker-setup.log" 2>&1
cat "$out/udocker-setup.log"
cd "$tree" || exit 1
runuser -u "$account" -- env -i HOME="$home" USER="$account" LOGNAME="$account" XDG_RUNTIME_DIR="/run/user/$uid" \
  PATH="$tree/.bundle/site/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin" LANG=C.UTF-8 \
  PYTHONPATH="$tree:$tree/.bundle/site" GPUBOOK_BUNDLE="$tree/.bundle" GPUBOOK_TEST_DATA_ROOT="$data" \
  GPUBOOK_UDOCKER_RUNC="${GPUBOOK_UDOCKER_RUNC:-/opt/pm/runc-wrap}" GPUBOOK_GPU_RESULTS="$results" \
  GPUBOOK_UDOCKER_STAGGER="${GPUBOOK_UDOCKER_STAGGER:-12}" \
  NCCL_NVLS_ENABLE=0 PYTHONDONTWRITEBYTECODE=1 \
  "$python" -m pytest tests/gpu/test_udocker_gpu.py -m gpu -v -s --confcutdir=tests/gpu -p no:cacheprovider \
  2>&1 | tee "$out/udocker-pytest.log" | tail -80
status=${PIPESTATUS[0]}
cp -r "$results" "$out/udocker"
echo "pytest: exit $status"
