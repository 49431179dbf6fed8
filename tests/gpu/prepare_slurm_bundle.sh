#!/usr/bin/env bash
# Add Slurm and munge to a GPU-host bundle, for tests/gpu/test_slurm_gpu.py: the GPU host (Ubuntu
# 24.04, root, no package index reachable) has neither. Debian 12's slurm-wlm 22.05 and munge debs,
# fetched here with `apt-get download` with the libraries that host lacks (json-c, lua 5.1, yaml,
# dbus; it has hwloc, numa, lz4, readline, gcrypt, pam, ssl), 3.5 MiB:
#   BUNDLE/slurm-debs/       the .debs
#   BUNDLE/install-slurm.sh  sourced there: unpacks them (dpkg -x) and copies into / only the files
#                            that host does not have (its own libraries are never replaced)
# Usage, from the project root on the Debian 12 build machine, after prepare_daemon_bundle.sh:
#   tests/gpu/prepare_slurm_bundle.sh .bundle
set -euo pipefail
dest=$(cd "${1:?usage: prepare_slurm_bundle.sh BUNDLE}" && pwd)
mkdir -p "$dest/slurm-debs"
(cd "$dest/slurm-debs" && apt-get download slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge libmunge2 \
  libjson-c5 liblua5.1-0 libyaml-0-2 libdbus-1-3 >/dev/null)

cat > "$dest/install-slurm.sh" <<'EOF'
# Source on the GPU host (root):  source BUNDLE/install-slurm.sh BUNDLE
# Slurm's binaries look for their plugins where Debian puts them (/usr/lib/x86_64-linux-gnu/slurm-wlm),
# so the files go to their Debian paths; --skip-old-files keeps every file the host already has,
# --keep-directory-symlink keeps Ubuntu's /lib -> usr/lib.
_sb=$(cd "${1:?usage: source install-slurm.sh BUNDLE}" && pwd)
_stage=$(mktemp -d /tmp/slurm-stage.XXXXXX)
for _d in "$_sb"/slurm-debs/*.deb; do dpkg -x "$_d" "$_stage"; done
tar -C "$_stage" -cf - $(ls -A "$_stage") | tar -C / -xf - --skip-old-files --keep-directory-symlink --no-same-owner
rm -rf "$_stage"
for _n in slurmctld slurmd slurmstepd; do  # Debian's update-alternatives links (postinst, not run here)
  [ -e "/usr/sbin/$_n" ] || ln -s "/usr/sbin/$_n-wlm" "/usr/sbin/$_n"
done
ldconfig
command -v slurmctld slurmd munged scontrol sbatch srun
EOF
du -sh "$dest/slurm-debs"
