#!/usr/bin/env bash
# Make the bundle for tests/gpu/rootless_install.sh and tests/gpu/test_install_gpu.py: what the
# Ubuntu GPU host lacks for a rootless gpubook, to be carried there (the device tool: 64 MiB).
#   BUNDLE/debs/             Debian 12's podman stack (../shared/gpuhost/prepare-bundle.sh --no-image,
#                            crun left out: runc is used) + uidmap (newuidmap/newgidmap), slirp4netns,
#                            libslirp0
#   BUNDLE/gpu-sshd.tar.xz   Debian 12 minbase + openssh-server + sudo, the booking image; the full
#                            perl that usrmerge pulls in and glibc's gconv modules are left out of
#                            the tarball (sshd needs neither; about 6 MiB less)
#   BUNDLE/cudacheck         tests/gpu/cudacheck.c built here (glibc 2.36)
#   BUNDLE/wheels/           gpubook's wheel built from this tree (`pip wheel --no-deps`) and its
#                            dependencies for CPython 3.12 at the versions of constraints.txt:
#                            what rootless_install.sh installs
#   BUNDLE/wheels-test/      what Radicale (the test's calendar, not part of the install) adds
# Usage, on the Debian 12 build machine, from the project root:
#   tests/gpu/prepare_rootless_bundle.sh BUNDLE
set -euo pipefail
dest=$(mkdir -p "${1:?usage: prepare_rootless_bundle.sh BUNDLE}" && cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
pip=${PIP:-/opt/gpubook/venv/bin/pip}

if [ ! -s "$dest/debs/podman_"*.deb ] 2>/dev/null || ! ls "$dest"/debs/uidmap_*.deb >/dev/null 2>&1; then
  /work/shared/gpuhost/prepare-bundle.sh "$dest" --no-image >/dev/null
  (cd "$dest/debs" && apt-get download uidmap slirp4netns libslirp0 2>&1 | grep -v -e '^Get:' -e '^Fetched' -e 'unsandboxed' || true)
  rm -f "$dest"/debs/crun_*.deb "$dest/podman-on-gpuhost.sh"
fi

if [ ! -s "$dest/gpu-sshd.tar.xz" ]; then
  mmdebstrap --quiet --variant=minbase --include=openssh-server,sudo \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' bookworm - \
  | python3 -c '
import sys, tarfile
drop = ("./usr/share/perl/5.36", "./usr/lib/x86_64-linux-gnu/perl/5.36", "./usr/lib/x86_64-linux-gnu/libperl.so",
        "./usr/lib/x86_64-linux-gnu/gconv/")
src = tarfile.open(fileobj=sys.stdin.buffer, mode="r|")
dst = tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT)
for member in src:
    if not member.name.startswith(drop):
        dst.addfile(member, src.extractfile(member) if member.isfile() else None)
dst.close()
' | xz -T0 -9 > "$dest/gpu-sshd.tar.xz.partial"
  mv "$dest/gpu-sshd.tar.xz.partial" "$dest/gpu-sshd.tar.xz"
fi

gcc -O2 -Wall -Wextra -Werror -o "$dest/cudacheck" "$here/cudacheck.c" -ldl
strip "$dest/cudacheck"

rm -rf "$dest/wheels" "$dest/wheels-test" && mkdir -p "$dest/wheels" "$dest/wheels-test"
fetch() {  # fetch FOLDER REQUIREMENT...: wheels for the GPU host's CPython 3.12
  local into=$1; shift
  "$pip" download --quiet --dest "$into" --only-binary :all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any ${lock:+-c "$lock"} "$@" 2>&1 | grep -v 'is ignored' || true
}
lock=$(ls "$root/constraints-runtime.txt" "$root/constraints.txt" 2>/dev/null | head -1 || true)  # the runtime lock: the versions the tests ran with
"$pip" wheel --quiet --no-deps --wheel-dir "$dest/wheels" "$root"
fetch "$dest/wheels" "$dest"/wheels/gpubook-*.whl
fetch "$dest/wheels-test" radicale
for wheel in "$dest"/wheels-test/*.whl; do  # the test's calendar only: what the install has already goes
  [ ! -e "$dest/wheels/$(basename "$wheel")" ] || rm "$wheel"
done
# PRUNE: distributions left out to keep within the device tool's 64 MiB (e.g. a base install that
# still needs matplotlib: PRUNE="matplotlib numpy pillow fonttools kiwisolver contourpy pyparsing
# cycler"); rootless_install.sh then says that pip could not resolve, and pip check names them.
for name in ${PRUNE:-}; do rm -f "$dest/wheels/$name"-*.whl; done
du -sh "$dest"/* | sort -h
du -sh "$dest"
