#!/usr/bin/env bash
# One command for a release's files: the source distribution and the wheel of gpubook/__init__.py's
# version, with the runtime lock beside them and their SHA-256 sums, built from a clean copy of the
# committed tree (nothing untracked goes in):
#   tools/release.sh                 # into dist/vX.Y.Z/
#   tools/release.sh --out DIR       # into DIR
#   tools/release.sh --worktree ...  # from the working tree's files as git lists them, uncommitted
#                                    # changes included (tests/test_package.py's way; never with --tag)
#   tools/release.sh --tag           # also tags the commit vX.Y.Z, the sums in the tag's message
# A release is its tag and these files: an admin downloads the wheel and the lock from the release
# (docs/guides/install.md, "Where the wheel comes from") or runs this at the tag.
set -euo pipefail
cd "$(dirname "$0")/.."
out= tag= worktree=
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --tag) tag=yes; shift ;;
    --worktree) worktree=yes; shift ;;
    *) echo "usage: tools/release.sh [--out DIR] [--tag | --worktree]" >&2; exit 2 ;;
  esac
done
version=$(/usr/bin/python3 -c 'import re, pathlib; print(re.search(r"__version__ = \"([^\"]+)\"", pathlib.Path("gpubook/__init__.py").read_text())[1])')
out=${out:-dist/v$version}
if [ -n "$tag" ]; then
  if [ -n "$(git status --porcelain)" ]; then echo "tools/release.sh: the tree has uncommitted changes; commit them before tagging v$version" >&2; exit 1; fi
  if git rev-parse -q --verify "refs/tags/v$version" >/dev/null; then
    echo "tools/release.sh: v$version is already tagged (at $(git rev-parse --short "v$version^{commit}")); raise gpubook/__init__.py's version first" >&2; exit 1
  fi
fi
work=$(mktemp -d /var/tmp/gpubook-release.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir "$work/source"
if [ -n "$worktree" ] && [ -z "$tag" ]; then
  git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -c 2>/dev/null | tar -x -C "$work/source"
else
  git archive --format=tar HEAD | tar -x -C "$work/source"
fi
# uv builds both (PEP 517, isolated, setuptools from pyproject's build-system); fetched for this run only.
/usr/bin/python3 -m venv "$work/uv" && "$work/uv/bin/python" -m pip install -q --disable-pip-version-check "uv==0.13.9"
"$work/uv/bin/uv" build -q --sdist --wheel --out-dir "$work/dist" "$work/source"
mkdir -p "$out"
cp "$work/dist/gpubook-$version.tar.gz" "$work/dist/gpubook-$version-py3-none-any.whl" "$out/"
cp "$work/source/constraints-runtime.txt" "$out/gpubook-$version-constraints.txt"
(cd "$out" && sha256sum "gpubook-$version.tar.gz" "gpubook-$version-py3-none-any.whl" "gpubook-$version-constraints.txt" >SHA256SUMS)
if [ -n "$tag" ]; then
  git tag -a "v$version" -F - <<MSG
gpubook $version

Built by tools/release.sh from this commit:
$(cat "$out/SHA256SUMS")
MSG
fi
echo "tools/release.sh: gpubook $version in $out:"
cat "$out/SHA256SUMS"
