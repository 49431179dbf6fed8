#!/usr/bin/env bash
# On the GPU host, as root: the rootless install (tests/gpu/rootless_install.sh) and then
# tests/gpu/test_install_gpu.py against it, everything written under OUT.
#   tests/gpu/run_install_gpu.sh BUNDLE OUT
# Run from a folder whose tests/ is the project's tests/ and which has no gpubook/ (the test must
# import the installed wheel). Radicale (the test's calendar, not part of the install) goes into
# BUNDLE/testsite for the test's own python3.
set -uo pipefail
bundle=$(cd "${1:?usage: run_install_gpu.sh BUNDLE OUT}" && pwd)
out=${2:?usage: run_install_gpu.sh BUNDLE OUT}
mkdir -p "$out"
account=gpubook
[ ! -d gpubook ] || { echo "run from a folder without gpubook/: the test imports the installed wheel"; exit 2; }

begin=$(date +%s.%N)
bash tests/gpu/rootless_install.sh "$bundle" "$account" > "$out/setup.log" 2>&1
status=$?
echo "setup: exit $status in $(python3 -c "import time; print(round(time.time() - $begin, 1))") s" | tee -a "$out/setup.log"
[ "$status" = 0 ] || { tail -30 "$out/setup.log"; exit 1; }
site=$(echo /opt/gpubook/venv/lib/python3*/site-packages)
{ echo "== /opt/gpubook/venv"; /usr/bin/python3 -m pip --python /opt/gpubook/venv/bin/python list 2>&1; du -sh /opt/gpubook/venv; } > "$out/extra.log"

/usr/bin/python3 -m pip install --quiet --break-system-packages --no-index --find-links "$bundle/wheels" \
  --find-links "$bundle/wheels-test" --target "$bundle/testsite" radicale \
  >> "$out/extra.log" 2>&1 || { echo "Radicale for the test's calendar did not install:"; tail "$out/extra.log"; }

PYTHONPATH=.:$site:$bundle/testsite GPUBOOK_BUNDLE=$bundle GPUBOOK_GPU_RESULTS=$out NCCL_NVLS_ENABLE=0 \
  python3 -m pytest tests/gpu/test_install_gpu.py -m gpu -v -s --confcutdir=tests/gpu -p no:cacheprovider \
  2>&1 | tee "$out/pytest.log" | tail -60
echo "pytest: exit ${PIPESTATUS[0]}"
uid=$(id -u "$account")
config=$(ls -d /home/"$account"/install-test-*/gpubook.toml 2>/dev/null | tail -1)
{ echo "== gpubook doctor --json as $account (after the test: its calendar is gone)"
  (cd / && timeout 120 runuser -u "$account" -- env -i HOME="/home/$account" XDG_RUNTIME_DIR="/run/user/$uid" \
     PATH=/usr/local/bin:/usr/bin:/bin /opt/gpubook/venv/bin/gpubook doctor --json --config "$config")
  echo "== the kernel's OOM lines"; dmesg 2>/dev/null | grep -i -A1 "killed process" | tail -6
} >> "$out/extra.log" 2>&1
