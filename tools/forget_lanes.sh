#!/usr/bin/env bash
# Removes what the test lanes of `./quickstart test` left beyond the first account (tools/lanes.py): the
# other lanes' accounts (gpubook-test2, gpubook-test3, …) and the Slurm tests' account (gpubook-slurm),
# with their homes (podman stores, image caches), subordinate ids and runtime folders, and the lanes'
# data mounts. ../shared/fresh-machine.sh resets the first account only; run this before it, as root,
# for a machine as fresh as a new one:  tools/forget_lanes.sh && ../shared/fresh-machine.sh --ci
set -u
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 2; }
first=${GPUBOOK_TEST_USER:-gpubook-test}
for user in $(cut -d: -f1 /etc/passwd | grep -E "^($first[0-9]+|${GPUBOOK_SLURM_TEST_USER:-gpubook-slurm})$"); do
  uid=$(id -u "$user")
  runuser -u "$user" -- env XDG_RUNTIME_DIR="/run/user/$uid" podman system reset -f >/dev/null 2>&1
  for pid in $(pgrep -u "$uid"); do kill -9 "$pid" 2>/dev/null; done
  sleep 1
  userdel -r "$user" >/dev/null 2>&1
  sed -i "/^$user:/d" /etc/subuid /etc/subgid
  rm -rf "/run/user/$uid"
  echo "forget_lanes: removed $user"
done
data=${GPUBOOK_TEST_DATA_ROOT:-/srv/gpubook-test-data}
full=${GPUBOOK_TEST_FULL_ROOT:-/srv/gpubook-test-full}
udocker=${GPUBOOK_TEST_UDOCKER_ROOT:-/srv/gpubook-test-udocker}
for mount in "$data"-* "$full" "$full"-* "$udocker" "$udocker"-*; do
  [ -e "$mount" ] || continue
  mountpoint -q "$mount" && umount "$mount"
  rmdir "$mount" 2>/dev/null
done
rm -rf /var/tmp/gpubook-lanes-*
echo "forget_lanes: done"
