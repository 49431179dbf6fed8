"""The docs hold: generated pages are current, references name what the code has, links lead
somewhere, and the README leaves figures to BENCHMARKS.md (docs/development.md, "Generated docs")."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _cli_reference():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "tools" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(path: Path) -> list[str]:
    """The lines of a page outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, blanks as '-'."""
    found = set()
    for line in _prose(path):
        if match := re.match(r"^#{1,6} (.*)", line):
            found.add(re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-"))
    return found


def test_the_command_reference_is_generated_from_the_parser() -> None:
    page = ROOT / "docs" / "reference" / "cli.md"
    assert page.read_text() == _cli_reference().render(), \
        "docs/reference/cli.md is stale: run python tools/cli_reference.py --write"


def test_the_command_reference_names_every_command() -> None:
    """A command added to the parser shows up in the page (the generator walks subparsers)."""
    text = _cli_reference().render()
    for command in ("bookings", "config check", "gpus cdi", "templates validate", "doctor", "run", "status",
                    "stop", "images", "web", "log", "report", "setup", "demo"):
        assert f"`gpubook {command}`" in text, command
    assert "`--data-root` `PATH`" in text and "`-n`, `--lines` `LINES`" in text


def test_the_metrics_reference_lists_exactly_the_metrics_the_code_defines() -> None:
    source = (ROOT / "gpubook" / "scheduler" / "outbox" / "metrics.py").read_text()
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    documented = {name.removesuffix("_total") for name in re.findall(r"`(gpubook_[a-z_]+)`", page)}
    # Names written out whole, and those made in a loop (`{PREFIX}_{kind}_gpu_seconds`) as patterns.
    fixed = {f"gpubook_{name}" for name in re.findall(r'f"\{PREFIX\}_([a-z_]+)"', source)}
    # prometheus-client's Info("gpubook_build") is served as gpubook_build_info
    infos = {f"gpubook_{name}" for name in re.findall(r'Info\(f"\{PREFIX\}_([a-z_]+)"', source)}
    fixed = (fixed - infos) | {f"{name}_info" for name in infos}
    patterns = [re.compile("gpubook_" + re.sub(r"\\\{\w+\\\}", "[a-z_]+", re.escape(template)) + "$")
                for template in re.findall(r'f"\{PREFIX\}_([a-z_]*\{\w+\}[a-z_]*)"', source)]
    assert fixed and patterns
    assert fixed - documented == set(), "metrics the page does not list"
    for pattern in patterns:
        assert any(pattern.match(name) for name in documented), f"no metric on the page matches {pattern.pattern}"
    unknown = {name for name in documented - fixed if not any(p.match(name) for p in patterns)}
    assert unknown == set(), "metrics the page lists that the code does not define"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for line in _prose(page):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{target}: no such heading")
    assert broken == [], f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_leaves_figures_to_benchmarks() -> None:
    """No dated measurement and no bench path in the README; it links BENCHMARKS.md instead."""
    readme = ROOT / "README.md"
    text = "\n".join(_prose(readme))
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text), "a dated figure in the README: move it to BENCHMARKS.md"
    assert "bench/" not in readme.read_text(), "a bench path in the README: BENCHMARKS.md names the scripts"
    assert "(BENCHMARKS.md)" in text
    assert len(readme.read_text().splitlines()) <= 300, "the README is a front page; detail goes to docs/"


def test_the_quick_start_is_the_two_commands_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Quick start"):].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["./quickstart demo", "./quickstart test"]
    assert "./quickstart test" in (ROOT / ".ci" / "run").read_text()


def test_the_man_page_and_completion_scripts_are_made_from_the_parser() -> None:
    """gpubook/shell/: the man page (argparse-manpage) and the bash and zsh completions (shtab), installed
    with the package; stale ones are named (tools/shell_files.py writes them)."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "shell_files.py"), "--check"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_bash_completes_gpubooks_commands_and_options_from_the_script_it_prints() -> None:
    """`gpubook completion bash`, sourced by a real bash: `gpubook sta<TAB>` offers standby and status,
    `gpubook book --st<TAB>` offers --standby."""
    import shutil

    bash = shutil.which("bash")
    assert bash is not None
    script = subprocess.run([sys.executable, "-m", "gpubook.scheduler.commands.cli", "completion", "bash"],
                            capture_output=True, text=True, check=True, cwd=ROOT).stdout
    probe = (script + '\nCOMP_WORDS=(gpubook sta); COMP_CWORD=1; _shtab_gpubook; echo "${COMPREPLY[@]}"'
             '\nCOMP_WORDS=(gpubook book --st); COMP_CWORD=2; _shtab_gpubook; echo "${COMPREPLY[@]}"\n')
    first, second = subprocess.run([bash, "--norc", "-c", probe], capture_output=True, text=True, check=True,
                                   ).stdout.splitlines()[-2:]
    assert set(first.split()) == {"standby", "status"}, first
    assert second.split() == ["--standby"], second
