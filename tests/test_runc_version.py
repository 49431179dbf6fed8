"""Round 3, L2: doctor says whether the host's runc has the fix for CVE-2024-21626.

A udocker booker runs as the daemon's own uid, so runc's hardening is their only barrier. The real
runc here is judged by its version and, when older than 1.1.12, by its Debian package's changelog
(Debian 12's 1.1.5+ds1-1+deb12u1 carries the fix); the same binary copied where no package owns it
is an old runc nobody vouches for, and fails with what to install."""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpubook.runtime.engines.runc_version import CVE, runc_check

RUNC = shutil.which("runc") or shutil.which("runc", path="/usr/sbin:/sbin")
needs_runc = pytest.mark.skipif(RUNC is None, reason="runc is not installed")


def _version(runc: str) -> str:
    return subprocess.run([runc, "--version"], capture_output=True, text=True, check=True).stdout.split()[2]


def _older_than_the_fix(version: str) -> bool:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3]) < (1, 1, 12)


@needs_runc
def test_the_hosts_runc_is_judged_by_its_version_or_its_packages_changelog() -> None:
    assert RUNC is not None
    check = runc_check(RUNC)
    assert check.ok, check
    assert f"runc {_version(RUNC)}" in check.detail and CVE in check.detail
    if _older_than_the_fix(_version(RUNC)):  # a distribution's build of an older upstream release
        assert "changelog says so" in check.detail


@needs_runc
def test_an_old_runc_no_package_vouches_for_fails_and_says_what_to_install(tmp_path: Path) -> None:
    assert RUNC is not None
    if not _older_than_the_fix(_version(RUNC)):
        pytest.skip("this host's runc is new enough: no old binary to copy")
    copy = tmp_path / "runc"
    shutil.copy2(RUNC, copy)
    docs = tmp_path / "doc" / "runc"  # a changelog of a package that does not own the copy is never read
    docs.mkdir(parents=True)
    with gzip.open(docs / "changelog.Debian.gz", "wt") as changelog:
        changelog.write(f"runc (9) stable; urgency=high\n  * {CVE}\n")
    check = runc_check(str(copy), docs=tmp_path / "doc")
    assert not check.ok
    assert f"runc {_version(RUNC)} ({copy}, owned by no Debian package) is older than 1.1.12" in check.detail
    assert check.fix == "install runc 1.1.12 or newer, or your distribution's security update of runc"


@pytest.mark.parametrize(("printed", "ok"), [("runc version 1.1.12\ncommit: v1.1.12", True),
                                            ("runc version 1.2.0-rc.1", True),
                                            ("runc version 1.1.11", False),
                                            ("crun version 1.8", False)])
def test_the_version_line_decides_for_a_binary_no_package_owns(tmp_path: Path, printed: str, ok: bool) -> None:
    binary = tmp_path / "runc"
    binary.write_text(f"#!/bin/sh\nprintf '%s\\n' '{printed}'\n")
    binary.chmod(0o755)
    check = runc_check(str(binary))
    assert check.ok is ok, check
    if not ok:
        assert str(binary) in check.detail and check.fix
