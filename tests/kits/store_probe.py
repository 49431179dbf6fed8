"""What a failure message needs when a rootless start fails with "permission denied" on its own
rootfs (`open …/overlay/<layer>/merged/etc/hosts: permission denied`): the owners and modes along
the store's path and of every layer's root, the account's user namespace as the pause process
holds it, and the mounts podman's namespace has. Read-only; run as the store's account (root's
tests pass `user`)."""

from __future__ import annotations

import os
import pwd
import subprocess

PROBE = r"""
echo "inside podman's namespace: $(id -u):$(id -g) uid_map: $(tr -s ' ' < /proc/self/uid_map | tr '\n' ';')"
store="$HOME/.local/share/containers/storage"
for layer in "$store"/overlay/*/; do
  l=${layer%/}
  line=$(basename "$l" | cut -c1-12)
  for p in "$l" "$l/diff" "$l/diff/etc" "$l/diff/run" "$l/diff1" "$l/diff1/etc" "$l/diff1/run" "$l/merged"; do
    [ -e "$p" ] && line="$line ${p#$l}=$(stat -c '%a:%u:%g' "$p")"
  done
  for d in diff diff1; do
    [ -d "$l/$d" ] && line="$line $d-owners=$(find "$l/$d" -maxdepth 3 -printf '%U\n' 2>/dev/null \
      | sort | uniq -c | tr -s ' ' | tr '\n' ',')"
  done
  [ -f "$l/lower" ] && line="$line lower=$(tr ':' ' ' < "$l/lower" | wc -w)"
  echo "$line"
done
echo "overlay mounts in this namespace: $(grep -c ' overlay ' /proc/self/mountinfo)"
"""


def describe(text: str, user: str | None = None) -> str:
    """"" unless `text` (a daemon's log) has a start refused on its own rootfs; else the probe."""
    if "permission denied" not in text or "/merged/" not in text:
        return ""
    entry = pwd.getpwnam(user) if user else pwd.getpwuid(os.getuid())
    prefix = [] if user is None else ["runuser", "-u", entry.pw_name, "--", "env", f"HOME={entry.pw_dir}",
                                      f"XDG_RUNTIME_DIR=/run/user/{entry.pw_uid}"]
    lines = ["store probe (a start was refused on its own rootfs):"]
    path = f"{entry.pw_dir}/.local/share/containers/storage/overlay"
    parts = path.split("/")
    for depth in range(2, len(parts) + 1):
        part = "/".join(parts[:depth])
        try:
            stat = os.stat(part)
            lines.append(f"  {part} {stat.st_mode & 0o7777:o} {stat.st_uid}:{stat.st_gid}")
        except OSError as error:
            lines.append(f"  {part}: {error}")
    pause = f"/run/user/{entry.pw_uid}/libpod/tmp/pause.pid"
    try:
        pid = open(pause).read().strip()  # noqa: PTH123, SIM115 - a short read
        command = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()  # noqa: PTH123, SIM115
        lines.append(f"  pause process {pid} ({command}): user ns {os.readlink(f'/proc/{pid}/ns/user')}, "
                     f"mount ns {os.readlink(f'/proc/{pid}/ns/mnt')}")
    except OSError as error:
        lines.append(f"  pause process: {error}")
    for argv in (["podman", "unshare", "sh", "-c", PROBE],
                 ["podman", "ps", "-a", "--format", "{{.ID}} {{.State}} {{.Names}} {{.Image}}"],
                 ["podman", "images", "--format", "{{.ID}} {{.Repository}}:{{.Tag}}"]):
        try:
            done = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=60, check=False)
            lines.extend(f"  {line}" for line in (done.stdout + done.stderr).splitlines()
                         if "is not a shared mount" not in line)
        except (OSError, subprocess.SubprocessError) as error:
            lines.append(f"  {argv[:2]}: {error}")
    return "\n".join(lines) + "\n"
