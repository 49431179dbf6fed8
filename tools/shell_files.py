"""The man page and the shell completion scripts, made from the `gpubook` command line's own parser
and installed with the package (pyproject.toml's data-files: share/man/man1, share/bash-completion,
share/zsh/site-functions):

    python tools/shell_files.py            # write gpubook/shell/{gpubook.1,gpubook,_gpubook}
    python tools/shell_files.py --check    # exit 1, naming the stale ones

The man page is argparse-manpage's, the completions shtab's (`gpubook completion SHELL` prints the
same scripts at run time); tests/test_docs.py fails when a file here is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

FOLDER = ROOT / "gpubook" / "shell"


def files() -> dict[Path, str]:
    """Each file's path and what it should hold."""
    from argparse_manpage.manpage import Manpage

    from gpubook import __version__
    from gpubook.scheduler.commands import cli

    parser = cli.build_parser()
    # The footer's date is the version: a page made again on another day is the same page.
    page = str(Manpage(parser, _data={"project_name": "gpubook", "description": cli.DESCRIPTION,
                                      "date": f"gpubook {__version__}", "source": "gpubook",
                                      "manual_title": "gpubook manual"}))
    return {FOLDER / "gpubook.1": page if page.endswith("\n") else page + "\n",
            FOLDER / "gpubook": cli.completion_script("bash"),
            FOLDER / "_gpubook": cli.completion_script("zsh")}


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--check", action="store_true", help="exit 1 when a file is stale; write nothing")
    args = options.parse_args()
    stale = [path for path, text in files().items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python tools/shell_files.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
