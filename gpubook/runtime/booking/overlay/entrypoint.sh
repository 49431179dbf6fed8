#!/bin/sh
# gpubook's entrypoint, bind-mounted read-only at /.gpubook/entrypoint.sh into every booking's container.
#
# Plain POSIX sh with nothing but coreutils, grep and awk, because it must run unchanged in Debian,
# Ubuntu 16.04 (CUDA 8 images) and RHEL-family images alike. It runs as root of the container's own
# user namespace (never root of the host) and:
#   1. creates the booker's account (name, uid, gid) and passwordless sudo,
#   2. installs the booker's public keys and the daemon's restricted probe key,
#   3. waits until the booking's start (GPUBOOK_NOT_BEFORE, epoch seconds) when the container was
#      run ahead of it ("armed"): nothing below runs before that moment,
#   4. runs sshd with the host key gpubook made for this booking, on the booking's port
#      (keys only: password, keyboard-interactive and root logins are off),
#   5. runs the template's command, if any, and JupyterLab (GPUBOOK_JUPYTER=1), as the booker,
#   6. forwards SIGTERM to all, so a stop gives the booker's work its grace period.
# It also links the booking's booking.json and the gpubook-booking command where bookers look;
# GPUBOOK_BOOKING, GPUBOOK_END and GPUBOOK_GPUS go on to the booker's SSH sessions.
# Inputs come from the environment (GPUBOOK_*), set by gpubook/runtime/booking/ssh.py.
set -eu

say() { echo "gpubook-entrypoint: $*" >&2; }
die() { say "$*"; exit 70; }

user=${GPUBOOK_USER:?GPUBOOK_USER is not set}
uid=${GPUBOOK_UID:?GPUBOOK_UID is not set}
gid=${GPUBOOK_GID:?GPUBOOK_GID is not set}
port=${GPUBOOK_PORT:?GPUBOOK_PORT is not set}
home=/home/$user
state=/run/gpubook
mkdir -p "$state/keys"
chmod 755 "$state" "$state/keys"

# The booking, for the booker's scripts: booking.json is gpubook's, kept up to date on the host and
# bound read-only at /.gpubook-booking (gpubook/runtime/booking/booking_json.py); linked where bookers look,
# beside the overlay's `gpubook-booking` command, which reads it.
if [ -f /.gpubook-booking/booking.json ]; then
  ln -sfn /.gpubook-booking/booking.json "$state/booking.json"
fi
if [ -f /.gpubook/gpubook-booking ]; then
  { mkdir -p /usr/local/bin && ln -sfn /.gpubook/gpubook-booking /usr/local/bin/gpubook-booking; } ||
    say "warning: no gpubook-booking command (cannot link it into /usr/local/bin)"
fi

# One id (udocker): the container's root is the daemon's own uid, the booker's uid is the same host
# id seen through a nested user namespace, which GPUBOOK_AS_BOOKER (a program gpubook binds in)
# enters. Everything here is that one id's already; there is no root for the booker, so no sudo.
single=0
[ -n "${GPUBOOK_AS_BOOKER:-}" ] && single=1

# The daemon validated the name already; checked again because this file is what runs as root.
case "$user" in
  ''|*[!a-z0-9_-]*|[!a-z_]*) die "refusing user name '$user'" ;;
esac

# --- 1. account -----------------------------------------------------------------------------------
# Drop any entry that holds the name or the ids (an image's own 'ubuntu' user at uid 1000), then add
# the booker. Editing the files in place works in every image, with or without useradd.
rewrite() {  # rewrite FILE AWK-PROGRAM: filter FILE through awk, keeping the file (and its mode)
  awk -F: -v user="$user" -v uid="$uid" -v gid="$gid" "$2" "$1" > "$state/rewrite.tmp"
  cat "$state/rewrite.tmp" > "$1"
  rm -f "$state/rewrite.tmp"
}
rewrite /etc/passwd '$1 != user && $3 != uid'
group_name=$(awk -F: -v gid="$gid" '$3 == gid { print $1; exit }' /etc/group)
if [ -z "$group_name" ]; then
  rewrite /etc/group '$1 != user'
  echo "$user:x:$gid:" >> /etc/group
fi
shell=/bin/sh
[ -x /bin/bash ] && shell=/bin/bash
echo "$user:x:$uid:$gid:gpubook booker:$home:$shell" >> /etc/passwd
if [ -f /etc/shadow ]; then
  # '*': no password can ever match, yet the account is not "locked" (sshd refuses locked ones).
  rewrite /etc/shadow '$1 != user'
  echo "$user:*:19000:0:99999:7:::" >> /etc/shadow
fi
if [ ! -d "$home" ]; then
  mkdir -p "$home"
  if [ -d /etc/skel ]; then cp -R /etc/skel/. "$home/" 2>/dev/null || true; fi
  [ "$single" = 1 ] || chown -R "$uid:$gid" "$home"
  chmod 750 "$home"
fi
if [ "$single" = 1 ]; then
  say "the booker is this container's only user: no root and no sudo inside"
  # sshd gives a session's terminal to the group "tty", an id this namespace does not have (the
  # chown fails and the session with it): the booker's own group stands in for it.
  awk -F: -v OFS=: -v gid="$gid" '$1 == "tty" { $3 = gid } { print }' /etc/group > "$state/group.tmp" &&
    cat "$state/group.tmp" > /etc/group
  rm -f "$state/group.tmp"
elif [ -d /etc/sudoers.d ]; then
  echo "$user ALL=(ALL:ALL) NOPASSWD: ALL" > /etc/sudoers.d/gpubook
  chmod 440 /etc/sudoers.d/gpubook
elif [ -f /etc/sudoers ]; then
  echo "$user ALL=(ALL:ALL) NOPASSWD: ALL" >> /etc/sudoers
else
  say "warning: this image has no sudo; the booker gets no root inside"
fi

# --- GPU loader -----------------------------------------------------------------------------------
# gpubook/runtime/nvidia binds the host driver's libraries under GPUBOOK_LIBRARY_DIR and an ld.so.conf.d
# entry for it; ldconfig makes them visible to every process. Without ldconfig, prepend the folder.
if [ -n "${GPUBOOK_LIBRARY_DIR:-}" ]; then
  if command -v ldconfig >/dev/null 2>&1 || [ -x /sbin/ldconfig ]; then
    PATH=$PATH:/sbin:/usr/sbin ldconfig || die "ldconfig failed"
  else
    LD_LIBRARY_PATH=$GPUBOOK_LIBRARY_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
  fi
fi

# --- environment for SSH sessions -----------------------------------------------------------------
# sshd gives sessions a fresh environment; carry the image's and template's (PATH with CUDA's bin,
# LD_LIBRARY_PATH, ...) over: /etc/profile.d for login shells, SetEnv for plain `ssh host cmd`.
env_file=$state/environment
: > "$env_file"
env | while IFS= read -r line; do
  name=${line%%=*}
  case "$name" in
    GPUBOOK_USER|GPUBOOK_UID|GPUBOOK_GID|GPUBOOK_PORT|GPUBOOK_KEYS|GPUBOOK_JUPYTER|GPUBOOK_NOT_BEFORE|GPUBOOK_AS_BOOKER) continue ;;
    HOME|USER|LOGNAME|SHELL|PWD|OLDPWD|SHLVL|HOSTNAME|TERM|MAIL|_|container) continue ;;
  esac
  case "$name" in *[!A-Za-z0-9_]*|'') continue ;; esac
  printf '%s\n' "$line" >> "$env_file"
done
if [ -d /etc/profile.d ]; then
  awk '{ i = index($0, "="); v = substr($0, i + 1); gsub(/\047/, "\047\\\047\047", v);
         printf "export %s=\047%s\047\n", substr($0, 1, i - 1), v }' "$env_file" > /etc/profile.d/gpubook.sh
fi

# --- 2. keys --------------------------------------------------------------------------------------
# Outside the home folder, so a persistent home with loose modes cannot break (or widen) key login.
printf '%s\n' "${GPUBOOK_KEYS:-}" > "$state/keys/$user"
chmod 644 "$state/keys/$user"

# --- JupyterLab (templates with jupyter = true; gpubook/runtime/booking/jupyter.py) ------------------------------
# Decided before sshd starts, so the daemon can read the outcome once SSH answers. It listens on a
# unix socket in a folder only the booker may enter, never on TCP: on the host network this
# container's loopback is the host's. The token is made here, passed in the environment (argv is
# visible to every host user through ps) and kept in a file of the booker's, mode 600.
jupyter_dir=$state/jupyter
jupyter=
rm -rf "$jupyter_dir"
if [ "${GPUBOOK_JUPYTER:-}" = 1 ]; then
  if jupyter=$(command -v jupyter-lab 2>/dev/null); then
    (umask 077; mkdir -p "$jupyter_dir/runtime"; : > "$jupyter_dir/log") || die "cannot make $jupyter_dir"
    token=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
    [ ${#token} -eq 48 ] || die "cannot read 24 random bytes for the JupyterLab token"
    (umask 077; printf 'http://127.0.0.1:8888/lab?token=%s\n' "$token" > "$jupyter_dir/url")
    [ "$single" = 1 ] || chown -R "$uid:$gid" "$jupyter_dir"
    echo starting > "$state/jupyter-state"
  else
    echo "not available in this image (no jupyter-lab on its PATH)" > "$state/jupyter-state"
    say "JupyterLab: not available in this image (no jupyter-lab on its PATH)"
  fi
  chmod 644 "$state/jupyter-state"
fi

# --- sshd --------------------------------------------------------------------------------------
sshd=$(PATH=$PATH:/usr/sbin:/sbin command -v sshd) || die "this image has no sshd"
mkdir -p /run/sshd /var/empty/sshd
chmod 755 /run/sshd
# The host key is gpubook's, made for this booking and bound read-only at /.gpubook-hostkey: the
# daemon's probe trusts only it, and the booker's known_hosts line names it. Copied so that it is
# root's, mode 600, whatever host ids the bound file shows here.
given=/.gpubook-hostkey/ssh_host_ed25519_key
[ -f "$given" ] || die "no host key at $given (gpubook binds one into every booking)"
rm -f "$state/ssh_host_ed25519_key"
(umask 077; cat "$given" > "$state/ssh_host_ed25519_key") || die "cannot read the host key $given"
config=$state/sshd_config
cat > "$config" <<EOF
Port $port
HostKey $state/ssh_host_ed25519_key
PidFile $state/sshd.pid
AuthorizedKeysFile $state/keys/%u
PubkeyAuthentication yes
PasswordAuthentication no
ChallengeResponseAuthentication no
PermitEmptyPasswords no
PermitRootLogin no
AllowUsers $user
UsePAM no
PrintMotd no
X11Forwarding no
Subsystem sftp internal-sftp
EOF
# SetEnv exists from OpenSSH 7.8 on; older sshd (Ubuntu 16.04) only gets the profile.d file. One
# SetEnv line with every variable: sshd keeps the first SetEnv line only (its "first value wins"),
# so a line a variable (as before) gave sessions the first variable and dropped the rest (PATH too).
# A value with a quote or backslash cannot be written in it: it goes to the profile.d file only.
cp "$config" "$config.new"
grep -v '[\\"]' "$env_file" |
  awk '{ line = line " \"" $0 "\"" } END { if (line != "") print "SetEnv" line }' >> "$config.new" || true
if "$sshd" -t -f "$config.new" 2>/dev/null; then mv "$config.new" "$config"; else rm -f "$config.new"; fi
"$sshd" -t -f "$config" || die "sshd refuses its configuration"

# --- 3. the booking's start ----------------------------------------------------------------------
# An armed container (run ahead of its booking) has made everything above; SSH, JupyterLab and the
# template's command start only at the booking's start, so nobody logs in and nothing of the
# booker's runs before it. `sleep` in the background and `wait`, so that a stop ends it at once.
if [ -n "${GPUBOOK_NOT_BEFORE:-}" ]; then
  case "$GPUBOOK_NOT_BEFORE" in *[!0-9.]*) die "GPUBOOK_NOT_BEFORE is not epoch seconds" ;; esac
  delay=$(awk -v t="$GPUBOOK_NOT_BEFORE" -v n="$(date +%s.%N)" 'BEGIN { d = t - n; if (d > 0) printf "%.3f", d }')
  if [ -n "$delay" ]; then
    say "waiting ${delay} s for the booking's start"
    trap 'exit 0' TERM INT
    sleep "$delay" &
    wait $! || die "the wait for the booking's start failed"
    trap - TERM INT
  fi
fi

# --- 4 and 5. run -------------------------------------------------------------------------------
set +e
children=
forward() { trap - TERM INT; say "stopping"; kill -TERM $children 2>/dev/null; }
trap forward TERM INT
if [ "$single" = 1 ]; then
  "$GPUBOOK_AS_BOOKER" "$sshd" -D -e -f "$config" &  # sshd as the booker: it lets in that one user
else
  "$sshd" -D -e -f "$config" &
fi
children=$!
as_booker() {  # as_booker ARGV...: exec the argv as the booker, in their home
  cd "$home" || exit 70
  export HOME="$home" USER="$user" LOGNAME="$user"
  [ "$single" = 1 ] && exec "$GPUBOOK_AS_BOOKER" "$@"
  if command -v setpriv >/dev/null 2>&1; then
    exec setpriv --reuid="$uid" --regid="$gid" --init-groups -- "$@"
  fi
  exec su -s /bin/sh "$user" -c 'exec "$0" "$@"' -- "$@"
}
if [ $# -gt 0 ]; then
  ( as_booker "$@" ) &
  children="$children $!"
fi
if [ -n "$jupyter" ]; then
  # Both spellings: JupyterLab 3+ runs on jupyter_server (ServerApp), 2.x (NGC's images) on the
  # classic notebook server (NotebookApp); each ignores the other's. No --ip/--port: socket only.
  (
    export JUPYTER_TOKEN="$token" JUPYTER_RUNTIME_DIR="$jupyter_dir/runtime"
    exec >> "$jupyter_dir/log" 2>&1 < /dev/null
    as_booker "$jupyter" --no-browser \
      "--ServerApp.sock=$jupyter_dir/socket" --ServerApp.sock_mode=0600 \
      "--NotebookApp.sock=$jupyter_dir/socket" --NotebookApp.sock_mode=0600
  ) &
  children="$children $!"
  say "JupyterLab for $user started on the unix socket $jupyter_dir/socket"
fi
say "sshd for $user on port $port started"
# `wait` returns early (status > 128) when a trapped signal arrives; then wait for the children.
while :; do
  wait
  [ $? -gt 128 ] || break
done
