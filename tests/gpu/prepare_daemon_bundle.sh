#!/usr/bin/env bash
# Add to a GPU-host bundle (made by ../shared/gpuhost/prepare-bundle.sh BUNDLE --no-image) what
# tests/gpu/test_daemon_gpu.py needs there, where no registry or package index can be reached:
#   BUNDLE/gpu-sshd.tar.xz   Debian 12 minbase + openssh-server + sudo (docs, man pages, locales
#                            left out), the booking image; imported by the test with
#                            `podman --storage-driver overlay import` (the engine's own driver)
#   BUNDLE/wheels/           gpubook's and Radicale's dependencies as cp312 wheels, without those
#                            the host's Python 3.12 already has (../shared/gpuhost/README.md)
#   BUNDLE/cudacheck         tests/gpu/cudacheck.c, built here against glibc 2.36 (Debian 12): the
#                            booker runs it inside the container (dlopen libcuda.so.1, PTX kernel)
#   BUNDLE/install-daemon-deps.sh  run on the GPU host: wheels into BUNDLE/site (PYTHONPATH)
# Usage, from the project root on the Debian 12 build machine:
#   /work/shared/gpuhost/prepare-bundle.sh .bundle --no-image && tests/gpu/prepare_daemon_bundle.sh .bundle
# The device tool carries at most 64 MiB: the total with the source tree is printed at the end.
set -euo pipefail
dest=$(cd "${1:?usage: prepare_daemon_bundle.sh BUNDLE}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

if [ ! -s "$dest/gpu-sshd.tar.xz" ]; then
  mmdebstrap --quiet --variant=minbase --include=openssh-server,sudo \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' bookworm - | xz -T0 -9 > "$dest/gpu-sshd.tar.xz.partial"
  mv "$dest/gpu-sshd.tar.xz.partial" "$dest/gpu-sshd.tar.xz"
fi

# The host's python3 (PyTorch's venv) already has these; the rest is fetched for CPython 3.12.
host_has="lxml requests urllib3 certifi idna charset-normalizer six python-dateutil pyyaml
          typing-extensions nvidia-ml-py h11"
wanted="caldav icalendar recurring-ical-events x-wr-timezone apscheduler paramiko nvidia-ml-py radicale
        prometheus-client flask waitress"
mkdir -p "$dest/wheels"
pip=${PIP:-/opt/gpubook/venv/bin/pip}
"$pip" download --quiet --dest "$dest/wheels.all" --only-binary :all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any $wanted
for wheel in "$dest"/wheels.all/*.whl; do
  name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
  case " $(echo $host_has) " in *" $name "*) continue ;; esac
  cp "$wheel" "$dest/wheels/"
done
rm -rf "$dest/wheels.all"

gcc -O2 -Wall -Wextra -Werror -o "$dest/cudacheck" "$here/cudacheck.c" -ldl
strip "$dest/cudacheck"

cat > "$dest/install-daemon-deps.sh" <<'EOS'
# Source on the GPU host after podman-on-gpuhost.sh:  source BUNDLE/install-daemon-deps.sh BUNDLE
# The wheels go into BUNDLE/site (on PYTHONPATH, after the source tree); podman's storage driver is
# made "overlay" for every caller (gpubook's engine passes --storage-driver overlay; a store first
# made by a plain `podman` call would have driver "" and refuse it).
_b=$(cd "${1:?usage: source install-daemon-deps.sh BUNDLE}" && pwd)
if python3 -m pip --version >/dev/null 2>&1; then
  python3 -m pip install --quiet --no-index --no-deps --target "$_b/site" "$_b"/wheels/*.whl
else  # a venv made without pip: these wheels have no .data folder, so unpacking one installs it
  python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
    "$_b/site" "$_b"/wheels/*.whl
fi
export PYTHONPATH=$PWD:$_b/site${PYTHONPATH:+:$PYTHONPATH}
export GPUBOOK_BUNDLE=$_b  # tests/gpu/test_daemon_gpu.py finds gpu-sshd.tar.xz and cudacheck there
mkdir -p /etc/containers
[ -s /etc/containers/storage.conf ] || printf '[storage]\ndriver = "overlay"\nrunroot = "/run/containers/storage"\ngraphroot = "/var/lib/containers/storage"\n' > /etc/containers/storage.conf
EOS
du -sh "$dest"/* | sort -h
echo "total to carry (bundle + source tree without .git):"
du -sh --exclude=.git --exclude=.mypy_cache --exclude=__pycache__ --exclude=.ruff_cache "$root"
