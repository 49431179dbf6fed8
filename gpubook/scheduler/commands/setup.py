"""`gpubook setup --user ACCOUNT --data-root PATH [--dry-run] [--config-from FILE]`, run once as root.

It does what an admin would otherwise do by hand (docs/guides/install.md, step for step): the account,
its subordinate ids, linger, the nosuid,nodev data_root, the overlay storage.conf, /dev/net/tun,
cgroup delegation, the config, the default template's image and the systemd user unit; then it runs
`gpubook doctor` as the account, whose verdict is setup's exit status. Each step is printed as it
is done; a second run changes nothing and says "already"; --dry-run only prints.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

from gpubook.runtime import cgroups
from gpubook.runtime.errors import GpubookError
from gpubook.runtime.templates.catalog import get_template
from gpubook.scheduler import config as config_module
from gpubook.scheduler.commands import setup_host as host
from gpubook.scheduler.commands import setup_steps as steps
from gpubook.scheduler.commands.setup_host import Facts, SetupError
from gpubook.scheduler.commands.setup_steps import Options, Step

DOCTOR_SECONDS = 600
NOT_ROOT = ("gpubook setup changes the system (an account, a mount, files under /etc) and must run as root; "
            "--dry-run shows what it would do without root")
LABELS = {"already": "already", "skipped": "skipped", "attention": "ATTENTION", "change": "change"}


def check_input(*, account: str, data_root: str, euid: int, dry_run: bool) -> Path:
    """The data root as an absolute, normal path; SetupError says in one sentence what is wrong."""
    if euid != 0 and not dry_run:
        raise SetupError(NOT_ROOT)
    if not steps.ACCOUNT_NAME.fullmatch(account) or account == "root":
        raise SetupError(f"--user {account!r} is not a valid account name (lower-case letters, digits, "
                         "'_' and '-', at most 32, not root)")
    path = Path(os.path.normpath(data_root))
    if not path.is_absolute() or path == Path("/") or re.search(r"\s", data_root):
        raise SetupError(f"--data-root {data_root!r} must be an absolute path other than /, without spaces "
                         "(it becomes an /etc/fstab line)")
    if problem := host.data_root_problem(path):
        raise SetupError(problem)
    if path.exists() and not path.is_dir():
        raise SetupError(f"--data-root {path} exists and is not a folder")
    return path


def installed_binary() -> Path:
    """The gpubook of the interpreter running setup: the venv's bin/gpubook, never a fixed path."""
    beside = Path(sys.executable).parent / "gpubook"
    found = beside if beside.is_file() else (Path(shutil.which("gpubook") or "/nonexistent"))
    if not found.is_file():
        raise SetupError(f"no gpubook command beside {sys.executable}: run setup with the installed one "
                         "(/path/to/venv/bin/gpubook setup ...)")
    return found.absolute()


def unreachable(path: Path) -> Path | None:
    """The first folder or file on the way to `path` that an ordinary account cannot pass or run."""
    for candidate in (path, path.resolve()):
        for folder in reversed(candidate.parents):
            if not folder.stat().st_mode & stat.S_IXOTH:
                return folder
        if candidate.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH) != (stat.S_IROTH | stat.S_IXOTH):
            return candidate
    return None


def check_binary(binary: Path) -> None:
    """The account can run the binary and its interpreter (a venv under /root cannot be)."""
    first = binary.read_text(errors="replace").partition("\n")[0]
    interpreter = Path(first[2:].strip().split()[0]) if first.startswith("#!") and first[2:].strip() else None
    for path in (binary, *([interpreter] if interpreter else [])):
        if not path.exists():
            raise SetupError(f"{binary} runs {path}, which does not exist: reinstall gpubook in a working venv")
        blocked = unreachable(path)
        if blocked is not None:
            raise SetupError(f"{path} cannot be run by other accounts ({blocked} is closed to them): install gpubook "
                             "in a venv they can read, e.g. python3 -m venv /opt/gpubook/venv")


def config_text(source: Path | None, data_root: Path) -> str:
    """The account's new config: --config-from or the packaged example, data_root set, validated."""
    name = str(source) if source else "the packaged example config"
    try:
        text = source.read_text() if source else steps._packaged("config", "gpubook.example.toml")
    except OSError as error:
        raise SetupError(f"--config-from {source}: cannot read it: {error.strerror}") from None
    result = steps.with_data_root(text, data_root, source=name)
    try:
        config_module.parse(tomllib.loads(result), source.resolve() if source else Path("gpubook.toml"))
    except GpubookError as error:
        raise SetupError(f"{name} is not a valid gpubook config:\n{error}") from None
    return result


def prepare(*, account: str, data_root: str, dry_run: bool, config_from: str | None) -> Options:
    root = check_input(account=account, data_root=data_root, euid=os.geteuid(), dry_run=dry_run)
    binary = installed_binary()
    check_binary(binary)
    return Options(account=account, data_root=root, binary=binary, dry_run=dry_run,
                   config_text=config_text(Path(config_from) if config_from else None, root),
                   image=get_template(steps.TEMPLATE).image, home=host.account_home(account))


def show(step: Step, *, dry_run: bool) -> None:
    label = "would change" if dry_run and step.state == "change" else LABELS[step.state]
    print(f"{step.name}: {label}: {step.text}", flush=True)


def facts_for(options: Options, make: object) -> tuple[Facts, Options]:
    image = options.image if make is steps.step_image or options.dry_run else None
    if problem := host.data_root_problem(options.data_root):  # again before each step: it may have changed
        raise SetupError(problem)
    facts = host.read_facts(options.account, options.data_root, image=image)
    home = facts.account.home if facts.account else options.home
    return facts, dataclasses.replace(options, home=home)


def apply(options: Options) -> list[Step]:
    """Every step in order: read the host, say, act. Returns the steps as they were found."""
    done = []
    facts, options = facts_for(options, None)
    for make in steps.STEPS:
        if not options.dry_run:
            facts, options = facts_for(options, make)
        step = make(facts, options)
        show(step, dry_run=options.dry_run)
        for action in step.actions:
            print(f"  $ {action.shell()}", flush=True)
            if not options.dry_run:
                output = host.perform(action, cwd=options.home)
                if output.strip() and isinstance(action, host.Call):
                    print(f"    {output.strip()}")
        done.append(step)
    return done


def daemon_leaf(uid: int | None, *, root: Path = cgroups.ROOT) -> Path | None:
    """The delegated subtree's daemon leaf (hosts without systemd, cgroup v2) when it is the account's:
    doctor must run where the daemon runs, or it reports limits "not enforced" that the daemon has
    (seen on the GPU host: setup's doctor ran in root's cgroup)."""
    leaf = root / cgroups.SUBTREE / cgroups.DAEMON_LEAF
    try:
        return leaf if uid is not None and leaf.stat().st_uid == uid else None
    except OSError:
        return None


def _enter_leaf() -> None:
    """In the child, before runuser drops to the account: move into the daemon leaf (root may)."""
    cgroups.enter(os.getpid())


def doctor(options: Options) -> int:
    account = host.account(options.account)
    argv = host.as_account(options.account, (str(options.binary), "doctor", "--config", str(options.file(
        steps.CONFIG))), uid=account.uid if account else None, home=options.home)
    print(f"doctor: {'would run' if options.dry_run else 'running'} as {options.account}:\n  $ {shlex.join(argv)}",
          flush=True)
    if options.dry_run:
        return 0
    leaf = daemon_leaf(account.uid if account else None)
    if leaf is not None:
        print(f"    (in {leaf}, where the daemon runs: its limits are the ones doctor checks)", flush=True)
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=DOCTOR_SECONDS, check=False,
                                cwd=options.home, preexec_fn=None if leaf is None else _enter_leaf)
    except subprocess.TimeoutExpired:
        raise SetupError(f"gpubook doctor did not finish within {DOCTOR_SECONDS} s") from None
    for line in (result.stdout + result.stderr).splitlines():
        print(f"    {line}")
    return result.returncode


def run(*, account: str, data_root: str, dry_run: bool = False, config_from: str | None = None) -> int:
    options = prepare(account=account, data_root=data_root, dry_run=dry_run, config_from=config_from)
    what = "what it would do (--dry-run: nothing is changed)" if dry_run else "each step as it is done"
    print(f"gpubook setup: account {account}, data_root {options.data_root}, gpubook {options.binary}; {what}")
    found = apply(options)
    options = dataclasses.replace(options, home=host.account_home(account))
    status = doctor(options)
    attention = [step.name for step in found if step.state == "attention"]
    if attention:
        print(f"gpubook setup: needs your attention: {', '.join(attention)} (ATTENTION lines above)")
    if dry_run:
        print("gpubook setup: dry run, nothing was changed")
        return 0
    if status == 0:
        print("gpubook setup: done; gpubook doctor: all ok")
        return 0
    print("gpubook setup: done, but gpubook doctor found problems (FAIL lines above): fix them and run it again")
    return 1
