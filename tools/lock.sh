#!/usr/bin/env bash
# Writes constraints.txt: the exact version of every distribution that `pip install '.[test]'` puts
# into a fresh venv (gpubook itself left out). quickstart and tests/test_package.py install with
# `-c constraints.txt`, so a server gets the versions the tests ran with. Re-run it after a change
# to pyproject.toml's dependencies (or to take newer releases), run the tests, commit both.
#   tools/lock.sh            # Debian's /usr/bin/python3, the interpreter gpubook runs on
#   PYTHON=python3.12 tools/lock.sh
# pip also reads a site's own constraints (PIP_CONSTRAINT, /etc/xdg/pip/constraints.txt): the venv
# is resolved under them, so the lock never contradicts them.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-/usr/bin/python3}
work=$(mktemp -d /tmp/gpubook-lock.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -qq --disable-pip-version-check ".[test]"
version=$("$work/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
{
  echo "# gpubook's lock: every distribution of a fresh venv with '.[test]' (Python $version), made by tools/lock.sh."
  echo "# Install with: pip install -c constraints.txt '.[EXTRAS]' (only what is asked for is installed)."
  "$work/venv/bin/python" -m pip freeze --disable-pip-version-check | grep -v -i -E '^gpubook( |=|@)' | LC_ALL=C sort -f
} >constraints.txt.new
mv constraints.txt.new constraints.txt
echo "tools/lock.sh: constraints.txt: $(grep -c '==' constraints.txt) distributions pinned (Python $version)"
