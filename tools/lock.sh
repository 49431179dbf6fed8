#!/usr/bin/env bash
# Writes the two locks. constraints.txt, the test lock: the exact version of every distribution that
# `pip install '.[test]' --group dev` puts into a fresh venv (gpubook itself left out).
# constraints-runtime.txt, the runtime lock: what a lab's server gets with every extra and no test
# tool, resolved inside the test lock (the versions the tests ran with); tools/release.sh ships it
# beside the wheel. quickstart installs with `-c constraints.txt`, a server (and tests/test_package.py's
# venv) with `-c constraints-runtime.txt`: a server gets the versions the tests ran with. Re-run it after a change
# to pyproject.toml's dependencies (or to take newer releases), run the tests, commit both.
#   tools/lock.sh            # Debian's /usr/bin/python3, the interpreter gpubook runs on
#   PYTHON=python3.12 tools/lock.sh
# pip also reads a site's own constraints (PIP_CONSTRAINT, /etc/xdg/pip/constraints.txt): the venv
# is resolved under them, so the lock never contradicts them.
set -euo pipefail
cd "$(dirname "$0")/.."

# runtime_lock PYTHON FOLDER: constraints-runtime.txt from a venv with every extra, inside constraints.txt.
runtime_lock() {
  "$1" -m venv "$2"
  "$2/bin/python" -m pip install -qq --disable-pip-version-check -c constraints.txt ".[web,report,demo,udocker,ldap]"
  {
    echo "# gpubook's runtime lock: every distribution of a fresh venv with '.[web,report,demo,udocker,ldap]', inside"
    echo "# constraints.txt (the versions the tests ran with), made by tools/lock.sh. A server installs with:"
    echo "# pip install -c constraints-runtime.txt 'gpubook[EXTRAS] @ file:///PATH/gpubook-VERSION-py3-none-any.whl'"
    "$2/bin/python" -m pip freeze --disable-pip-version-check | grep -v -i -E '^gpubook( |=|@)' | LC_ALL=C sort -f
  } >constraints-runtime.txt
  echo "tools/lock.sh: constraints-runtime.txt: $(grep -c '==' constraints-runtime.txt) distributions pinned"
}
if [ "${1:-}" = --runtime-only ]; then  # the test lock kept as it is
  work=$(mktemp -d /tmp/gpubook-lock.XXXXXX); trap 'rm -rf "$work"' EXIT
  runtime_lock "${PYTHON:-/usr/bin/python3}" "$work/runtime"; exit 0
fi
python=${PYTHON:-/usr/bin/python3}
work=$(mktemp -d /tmp/gpubook-lock.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -qq --disable-pip-version-check "pip>=25.1"  # reads --group
"$work/venv/bin/python" -m pip install -qq --disable-pip-version-check ".[test]" --group dev
version=$("$work/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
{
  echo "# gpubook's test lock: every distribution of a fresh venv with '.[test]' --group dev (Python $version), made by tools/lock.sh."
  echo "# Install with: pip install -c constraints.txt '.[EXTRAS]' (only what is asked for is installed)."
  "$work/venv/bin/python" -m pip freeze --disable-pip-version-check | grep -v -i -E '^gpubook( |=|@)' | LC_ALL=C sort -f
} >constraints.txt.new
mv constraints.txt.new constraints.txt
echo "tools/lock.sh: constraints.txt: $(grep -c '==' constraints.txt) distributions pinned (Python $version)"
runtime_lock "$python" "$work/runtime"

