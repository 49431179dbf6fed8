"""docs/reference/cli.md, generated from the `gpubook` command line's own parser.

    python tools/cli_reference.py            # print the page
    python tools/cli_reference.py --write    # write docs/reference/cli.md
    python tools/cli_reference.py --check    # exit 1, saying so, when the page is stale

Every command, subcommand and option comes from `gpubook.scheduler.commands.cli.build_parser`,
so the page cannot list an option the program lacks; tests/test_docs.py runs --check's comparison.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from tools import reference_page  # noqa: E402 - after the path it is found on

PAGE = ROOT / "docs" / "reference" / "cli.md"

HEAD = """# Command reference

Every `gpubook` command and option, generated from the program's own parser by
`tools/cli_reference.py` (`python tools/cli_reference.py --write`; `tests/test_docs.py` fails when
this page is stale). How the commands are used day to day is in
[Operating gpubook](../guides/operate.md).

Every command that reads a config finds it the same way: `--config FILE` (before or after the
command), else `$GPUBOOK_CONFIG`, else `~/.config/gpubook/gpubook.toml`, else
`/etc/gpubook/gpubook.toml`. Exit status: 0 ok, 1 a problem (one line on stderr), 2 a usage error,
3 from `gpubook status` when no daemon holds the state folder's lock.
"""


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.nargs == 0:
        return names
    value = action.metavar or (("{" + ",".join(action.choices) + "}") if action.choices else action.dest.upper())
    return f"{names} `{value}`"


def _help(action: argparse.Action, *, top: bool) -> str:
    if action.dest == "config" and not top:
        return "the config file, as for `gpubook` itself (above)"
    text = _cell(action.help or "")
    if action.required and action.option_strings:
        text += " (required)"
    elif not action.option_strings and action.nargs == "?":
        text += " (optional)"
    return text or "—"


def _section(path: str, parser: argparse.ArgumentParser, level: int) -> Iterator[str]:
    yield f"{'#' * level} `{path}`"
    yield ""
    if parser.description and level > 2:
        text = _cell(parser.description)
        yield text[0].upper() + text[1:] + "."
        yield ""
    usage = " ".join(parser.format_usage().removeprefix("usage: ").split())
    yield "```"
    yield usage
    yield "```"
    yield ""
    rows = [action for action in parser._actions
            if action.help != argparse.SUPPRESS and not isinstance(action, (argparse._HelpAction,
                                                                            argparse._SubParsersAction))]
    if rows:
        yield "| option | what |"
        yield "| --- | --- |"
        yield from (f"| {_option(action)} | {_help(action, top=level == 2)} |" for action in rows)
        yield ""
    for name, sub in _subcommands(parser):
        yield from _section(f"{path} {name}", sub, min(level + 1, 4))


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from gpubook.scheduler.commands.cli import build_parser

    parser = build_parser()
    lines = [HEAD, *_section("gpubook", parser, 2)]  # the program's own description is its module docstring
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    return reference_page.main(argv, page=PAGE, render=render, script="tools/cli_reference.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
