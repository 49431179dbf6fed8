#!/usr/bin/env bash
# On the GPU host, as root: bench/gpu_overhead.py with udocker as the third place (bare metal,
# rootful podman, udocker as an ordinary account), everything written under OUT.
#   source .bundle/podman-on-gpuhost.sh .bundle && source .bundle/install-daemon-deps.sh .bundle
#   bash tests/gpu/run_udocker_bench.sh .bundle OUT [ACCOUNT] [gpu_overhead.py's arguments...]
# The account gets a copy of the source tree it can read (/opt/ACCOUNT-tree) and udocker from the
# bundle's site folder; the measurements alternate the three places round by round.
set -uo pipefail
bundle=$(cd "${1:?usage: run_udocker_bench.sh BUNDLE OUT [ACCOUNT] [ARGS...]}" && pwd)
out=${2:?usage: run_udocker_bench.sh BUNDLE OUT [ACCOUNT] [ARGS...]}
account=${3:-gpubook-ub}
shift 3 2>/dev/null || shift $#
python=${GPUBOOK_PYTHON:-$(command -v python3)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
tree=/opt/$account-tree
{
  id "$account" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$account"
  rm -rf "$tree" && mkdir -p "$tree"
  tar --exclude=./.bundle --exclude=./.git -cf - . | tar -C "$tree" -xf -
  mkdir -p "$tree/.bundle" && cp -a "$bundle/site" "$tree/.bundle/"
  if [ ! -x "$tree/.bundle/site/bin/udocker" ]; then  # the wheels unpacked without pip: no scripts
    mkdir -p "$tree/.bundle/site/bin"
    printf '#!%s\nimport sys\nfrom udocker.maincmd import main\nsys.exit(main())\n' "$python" > "$tree/.bundle/site/bin/udocker"
  fi
  chmod -R a+rX "$tree" && chmod 755 "$tree/.bundle/site/bin/udocker"
  echo "account $account, tree $tree, python $python"
  ls -ld /opt/torch /opt/torch/.venv "$python"; runuser -u "$account" -- "$python" -c 'import sys; print(sys.version)'
} > "$out/bench-setup.log" 2>&1
cat "$out/bench-setup.log"
cd "$tree" || exit 1
PATH="$tree/.bundle/site/bin:$PATH" PYTHONPATH="$tree:$tree/.bundle/site" NCCL_NVLS_ENABLE=0 \
  "$python" bench/gpu_overhead.py --udocker-account "$account" --out "$out/gpu-overhead-udocker.json" "$@" \
  2>&1 | tee "$out/bench.log" | tail -40
echo "bench: exit ${PIPESTATUS[0]}"
