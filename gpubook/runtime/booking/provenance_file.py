"""provenance.json written into a booker's output folder, which the booker controls.

The booker is root in their container and owns `<data_root>/<user>/output`: they may plant
`.gpubook` as a symlink to the daemon's config or another booker's folder, or `provenance.json`
as a symlink to any file. So nothing here follows a path the booker could have made:

- the output folder is opened with O_DIRECTORY|O_NOFOLLOW (`<data_root>/<user>` above it is the
  daemon's: gpubook/runtime/data/storage.py); everything below is reached by its descriptor (dir_fd);
- `.gpubook` is made there, or opened with O_DIRECTORY|O_NOFOLLOW: a symlink or a file by that
  name is refused, and so is a real folder owned by anyone but the output folder's owner;
- the card goes into a fresh file of a random name (O_CREAT|O_EXCL|O_NOFOLLOW), given to the
  output folder's owner (mode 0644: the booker reads it), then renamed onto `provenance.json`
  within that folder's descriptor: a symlink there is replaced, never written through.

A refusal is a `ProvenanceFileError`, one sentence; the caller logs it and the booking's end goes on.

Rootless podman's daemon cannot write in a booker's folder (it belongs to a subordinate id): it
runs this module as a program as the owner of every booker's file (`podman unshare`, root of its
user namespace), the card on standard input:

    python -P -m gpubook.runtime.booking.provenance_file OUTPUT_FOLDER < card.json
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from gpubook.runtime.booking.provenance import FILE, FOLDER
from gpubook.runtime.errors import GpubookError

MAX_BYTES = 64 * 1024  # a card is a few hundred bytes; more on standard input is not a card
WRITE_TIMEOUT = 30.0  # seconds the program may take (podman unshare's start included)
REFUSED = 3  # the program's exit status for a refusal (its one sentence on standard error)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ProvenanceFileError(GpubookError):
    """provenance.json was not written (the booker's folder is not as gpubook left it)."""


def write_into(output: Path, data: bytes) -> None:
    """`data` as `output`/.gpubook/provenance.json, through descriptors only (see the module's
    docstring); ProvenanceFileError when it may not or cannot be written."""
    try:
        out = os.open(output, _DIR)
    except OSError as error:
        raise ProvenanceFileError(f"{output} cannot be opened as a plain folder: {error.strerror}") from None
    try:
        owner = os.fstat(out)
        folder = _card_folder(out, output, uid=owner.st_uid, gid=owner.st_gid)
        try:
            _replace(folder, data, uid=owner.st_uid, gid=owner.st_gid)
        finally:
            os.close(folder)
    finally:
        os.close(out)


def _card_folder(out: int, output: Path, *, uid: int, gid: int) -> int:
    """`.gpubook` in the folder open as `out`: made (given to uid/gid, mode 0755), or a real folder
    of that owner, opened."""
    try:
        os.mkdir(FOLDER, 0o755, dir_fd=out)
        made = True
    except FileExistsError:
        made = False
    except OSError as error:
        raise ProvenanceFileError(f"{output}/{FOLDER} cannot be made: {error.strerror}") from None
    try:
        folder = os.open(FOLDER, _DIR, dir_fd=out)
    except OSError as error:  # ELOOP: a symlink; ENOTDIR: a file or anything else
        raise ProvenanceFileError(f"{output}/{FOLDER} is not a plain folder (a symbolic link or a file): "
                                  f"{error.strerror}; nothing written") from None
    try:
        info = os.fstat(folder)
        if made:
            os.fchown(folder, uid, gid)
            os.fchmod(folder, 0o755)
        elif info.st_uid != uid:
            raise ProvenanceFileError(f"{output}/{FOLDER} belongs to uid {info.st_uid}, not to the output "
                                      f"folder's owner (uid {uid}); nothing written")
    except BaseException:
        os.close(folder)
        raise
    return folder


def _replace(folder: int, data: bytes, *, uid: int, gid: int) -> None:
    partial = f".{FILE}.{secrets.token_hex(8)}"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=folder)
    except OSError as error:
        raise ProvenanceFileError(f"{FOLDER}/{partial} cannot be made: {error.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            os.fchmod(file.fileno(), 0o644)  # whatever the umask: the booker reads it
            os.fchown(file.fileno(), uid, gid)
            file.flush()
            os.fsync(file.fileno())
        os.rename(partial, FILE, src_dir_fd=folder, dst_dir_fd=folder)  # a symlink there is replaced
    except OSError as error:
        try:
            os.unlink(partial, dir_fd=folder)
        except OSError:
            pass
        raise ProvenanceFileError(f"{FOLDER}/{FILE} cannot be written: {error.strerror}") from None


def write(output: Path, data: bytes, *, owner_argv: Sequence[str] | None) -> None:
    """Write the card as the owner of the booker's files: in this process where the daemon is that
    owner already (`owner_argv` [] or None: root, udocker, an engine that maps no ids), else as this
    module's program run through `owner_argv` (rootless podman: `podman unshare`)."""
    if not owner_argv:
        write_into(output, data)
        return
    argv = [*owner_argv, sys.executable, "-P", "-m", "gpubook.runtime.booking.provenance_file", str(output)]
    try:
        done = subprocess.run(argv, input=data, capture_output=True, timeout=WRITE_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ProvenanceFileError(f"the writer of {output}/{FOLDER}/{FILE} did not run: {error}") from None
    if done.returncode != 0:
        why = " ".join(done.stderr.decode(errors="replace").split())[-300:] or f"exit status {done.returncode}"
        raise ProvenanceFileError(why)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m gpubook.runtime.booking.provenance_file OUTPUT_FOLDER < card.json", file=sys.stderr)
        return 2
    data = sys.stdin.buffer.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        print(f"a card of more than {MAX_BYTES} bytes; nothing written", file=sys.stderr)
        return 2
    try:
        write_into(Path(args[0]), data)
    except ProvenanceFileError as error:
        print(error, file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
