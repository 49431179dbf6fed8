"""The steps of `gpubook setup`, each a pure function of the host's facts (setup_host.Facts).

Each step, like a pyinfra operation, looks at the facts, then either says "already" or names the
actions that change the host; setup.py prints them and runs them in order, or only prints them with
--dry-run. A second run finds every change made and says "already". docs/guides/install.md is these
steps by hand, in the same order.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from gpubook.scheduler.commands import setup_host as host
from gpubook.scheduler.commands.setup_host import Action, AppendLine, Call, Facts, Run, SetupError, Write

ACCOUNT_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
SUBID_COUNT = 65536
SUBID_FIRST = 100000  # /etc/login.defs SUB_UID_MIN
DELEGATE_TEXT = "[Service]\nDelegate=cpu cpuset io memory pids\n"
UDEV_TEXT = 'KERNEL=="tun", MODE="0666"\n'
STORAGE_TEXT = '[storage]\ndriver = "overlay"\n'
TEMPLATE = "debian-ssh"
CONFIG = ".config/gpubook/gpubook.toml"
UNIT = ".config/systemd/user/gpubook.service"
STORAGE_CONF = ".config/containers/storage.conf"


@dataclass(frozen=True)
class Options:
    account: str
    data_root: Path
    binary: Path  # the gpubook the daemon runs: this interpreter's own
    config_text: str  # the config a new account gets: data_root set
    image: str  # the default template's image
    dry_run: bool = False
    home: Path = field(default=Path("/nonexistent"))  # the account's home, or where useradd puts it

    def file(self, relative: str) -> Path:
        return self.home / relative


@dataclass(frozen=True)
class Step:
    name: str
    state: str  # "already", "change", "skipped" (not for this host) or "attention" (the admin decides)
    text: str
    actions: tuple[Action, ...] = ()


def _as_account(options: Options, facts: Facts, *argv: str) -> tuple[str, ...]:
    uid = facts.account.uid if facts.account else None
    return host.as_account(options.account, argv, uid=uid, home=options.home)


def _install_file(options: Options, facts: Facts, relative: str, text: str, *, mode: str,
                  shown: str | None = None) -> tuple[Run, Run]:
    """A file of the account's, written by the account itself (root writes nothing into its home):
    made empty with its mode first, then filled (tee reads the text on its stdin, a pipe that
    /dev/stdin could not reopen as the account)."""
    path = str(options.file(relative))
    return (Run(_as_account(options, facts, "install", "-D", "-m", mode, "/dev/null", path)),
            Run(_as_account(options, facts, "tee", path), stdin=text, shown_stdin=shown))


def step_account(facts: Facts, options: Options) -> Step:
    if facts.account is not None:
        return Step("account", "already", f"{options.account} exists (uid {facts.account.uid}, "
                    f"home {facts.account.home})")
    return Step("account", "change", f"make {options.account}: a home, bash, no password (nobody logs in with one)",
                (Run(("useradd", "--create-home", "--shell", "/bin/bash", "--comment", "gpubook daemon",
                      options.account)),))


def subid_ranges(text: str) -> list[tuple[str, int, int]]:
    """(owner, first, count) of each line of /etc/subuid or /etc/subgid."""
    ranges = []
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            ranges.append((parts[0], int(parts[1]), int(parts[2])))
    return ranges


def free_subid_start(texts: tuple[str, ...]) -> int:
    """The first id after every range in both files: one range free for subuids and subgids alike."""
    ends = [first + count for text in texts for _, first, count in subid_ranges(text)]
    return max([SUBID_FIRST, *ends])


def step_subids(facts: Facts, options: Options) -> Step:
    owners = {options.account, str(facts.account.uid) if facts.account else options.account}
    missing, found = [], []
    for label, text in zip(("subuids", "subgids"), facts.subids, strict=True):
        mine = [(first, count) for owner, first, count in subid_ranges(text) if owner in owners]
        big = [(first, count) for first, count in mine if count >= SUBID_COUNT]
        if not big:
            missing.append(label)
            continue
        first, count = big[0]
        others = [owner for owner, start, length in subid_ranges(text)
                  if owner not in owners and start < first + count and first < start + length]
        if others:
            return Step("subids", "attention", f"{options.account}'s {label} {first}-{first + count - 1} overlap "
                        f"those of {', '.join(sorted(others))}: containers of both could reach each other's files; "
                        f"give {options.account} a range of its own (usermod --del-subuids/--add-subuids)")
        found.append(f"{label} {first}-{first + count - 1}")
    if not missing:
        return Step("subids", "already", f"{options.account} has {' and '.join(found)}")
    start = free_subid_start(facts.subids)
    span = f"{start}-{start + SUBID_COUNT - 1}"
    flags = [arg for label in missing for arg in (f"--add-{label}", span)]
    return Step("subids", "change", f"give {options.account} {' and '.join(missing)} {span} (65536 ids for "
                "rootless containers, free in both files)", (Run(("usermod", *flags, options.account)),))


def step_linger(facts: Facts, options: Options) -> Step:
    if facts.systemd:
        if facts.lingering:
            return Step("linger", "already", f"{options.account}'s user manager lingers")
        return Step("linger", "change", f"keep {options.account}'s user manager running without a login "
                    "(and start it at boot)", (Run(("loginctl", "enable-linger", options.account)),))
    uid = str(facts.account.uid) if facts.account else f"$(id -u {options.account})"
    why = "systemd is not PID 1 here, so there is no user manager to linger"
    if facts.runtime_dir:
        return Step("linger", "skipped", f"{why}; podman's runtime folder /run/user/{uid} is there")
    return Step("linger", "change", f"{why}; make podman's runtime folder /run/user/{uid} instead (a reboot "
                "empties /run: run setup again after one)",
                (Run(("install", "-d", "-m", "0700", "-o", options.account, "-g", options.account,
                      f"/run/user/{uid}")),))


def step_data_root(facts: Facts, options: Options) -> Step:
    root, state = options.data_root, facts.data_root
    if not state.exists:
        return Step("data_root", "change", f"make {root}, owned by {options.account}",
                    (Run(("mkdir", "-p", str(root))), Run(("chown", "-h", f"{options.account}:", str(root)))))
    if facts.account is None or state.owner != facts.account.uid:
        return Step("data_root", "change", f"give {root} to {options.account}",
                    (Run(("chown", "-h", f"{options.account}:", str(root))),))
    return Step("data_root", "already", f"{root} exists and belongs to {options.account}")


def fstab_entry(fstab: str, path: Path) -> list[str] | None:
    """The fields of /etc/fstab's line that mounts `path`, if any (the last one wins at boot)."""
    found = None
    for line in fstab.splitlines():
        fields = line.split()
        if len(fields) >= 4 and not fields[0].startswith("#") and fields[1] == str(path):
            found = fields
    return found


def fstab_line(path: Path) -> str:
    return f"{path} {path} none bind,nosuid,nodev 0 0"


def step_mount(facts: Facts, options: Options) -> Step:
    root = str(options.data_root)
    entry = fstab_entry(facts.fstab, options.data_root)
    entry_safe = entry is not None and {"nosuid", "nodev"} <= set(entry[3].split(","))
    if facts.data_root.nosuid_nodev:
        where = "; /etc/fstab mounts it at boot" if entry_safe else ""
        return Step("data_root mount", "already", f"{root} is on a nosuid,nodev mount{where}")
    if entry is not None and not entry_safe:
        return Step("data_root mount", "attention", f"/etc/fstab mounts {root} without nosuid,nodev: add both to "
                    f"its options ({entry[3]}) and remount it (mount -o remount,nosuid,nodev {root}); bookings "
                    "are refused until then")
    if entry is not None:
        return Step("data_root mount", "change", f"mount {root} as /etc/fstab says (nosuid,nodev)",
                    (Run(("mount", root)),))
    return Step("data_root mount", "change", f"bind-mount {root} onto itself with nosuid,nodev (files made in "
                "containers must not act as setuid programs or devices), now and at boot",
                (Run(("mount", "--bind", root, root)), Run(("mount", "-o", "remount,bind,nosuid,nodev", root)),
                 AppendLine(host.FSTAB, fstab_line(options.data_root))))


def step_storage(facts: Facts, options: Options) -> Step:
    path = options.file(STORAGE_CONF)
    reset = (f"reset it as {options.account} (runuser -u {options.account} -- podman system reset: "
             "it deletes that store's images and containers)")
    driver = host.storage_driver(facts.storage_conf)
    if driver == "overlay":
        if "vfs" in facts.stores:
            return Step("storage.conf", "attention", f"{path} says overlay, but a vfs store exists: {reset}")
        return Step("storage.conf", "already", f"{path} says overlay")
    if facts.storage_conf is not None:
        return Step("storage.conf", "attention", f"{path} says driver {driver or '(none)'}, kept: gpubook wants "
                    f'overlay (vfs copies a whole image per start); set driver = "overlay" there, then {reset}')
    text = f"write {path} with the overlay driver, before the account's podman makes its store"
    if "vfs" in facts.stores:
        text += f"; a vfs store exists already: {reset}"
    return Step("storage.conf", "change", text,
                _install_file(options, facts, STORAGE_CONF, STORAGE_TEXT, mode="0644"))


def step_tun(facts: Facts, options: Options) -> Step:
    if facts.tun_mode is None:
        return Step("/dev/net/tun", "attention", "there is no /dev/net/tun: load the tun module (modprobe tun); "
                    "slirp4netns needs it for each booking's private network")
    if facts.tun_mode & 0o666 == 0o666:
        return Step("/dev/net/tun", "already", f"mode {facts.tun_mode:04o}: usable by {options.account}")
    actions: tuple[Action, ...] = (Run(("chmod", "0666", str(host.TUN))),)
    if facts.udev:
        actions += (Write(host.UDEV_RULE, UDEV_TEXT),)
        lasting = f"and {host.UDEV_RULE} keeps it so at boot"
    else:
        lasting = "(no udev runs here: run setup again after a reboot)"
    return Step("/dev/net/tun", "change", f"mode {facts.tun_mode:04o} → 0666 so that slirp4netns can open it for "
                f"{options.account} (creating an interface still needs a namespace of one's own) {lasting}", actions)


def step_cgroups(facts: Facts, options: Options) -> Step:
    if facts.systemd:
        if facts.delegate_conf == DELEGATE_TEXT:
            return Step("cgroup delegation", "already", f"{host.DELEGATE_CONF} delegates cpu cpuset io memory pids")
        if facts.delegate_conf is not None:
            return Step("cgroup delegation", "attention", f"{host.DELEGATE_CONF} exists and differs, kept: it "
                        "should say Delegate=cpu cpuset io memory pids for memory, CPU and pids limits")
        return Step("cgroup delegation", "change", "delegate the cpu, cpuset, io, memory and pids controllers to "
                    "user managers, so that rootless podman can set bookings' limits",
                    (Write(host.DELEGATE_CONF, DELEGATE_TEXT), Run(("systemctl", "daemon-reload"))))
    cgroups = delegation_module()
    if cgroups is None:
        return Step("cgroup delegation", "skipped", "systemd is not PID 1 here and this gpubook cannot delegate a "
                    "cgroup subtree itself (no gpubook.runtime.cgroups.make_delegated_subtree): memory, CPU and "
                    "pids limits are not enforced (gpubook doctor says which hold)")
    if not facts.cgroup_v2:
        return Step("cgroup delegation", "skipped", "systemd is not PID 1 here and this host has cgroups v1, where "
                    "rootless podman enforces no memory, CPU or pids limit (boot with "
                    "systemd.unified_cgroup_hierarchy=1 for them; gpubook doctor says which hold)")
    leaf = host.CGROUP_ROOT / host.SUBTREE_LEAF
    if facts.account is not None and facts.subtree_owner == facts.account.uid:
        return Step("cgroup delegation", "already", f"{leaf.parent} is delegated to {options.account}")
    shown = tuple(cgroups.delegation_commands(options.account))
    account = facts.account
    if account is None:  # a dry run before the account exists: shown, never run
        return Step("cgroup delegation", "change", f"delegate {leaf.parent} to {options.account}",
                    (Call(lambda: None, shown),))
    make = cgroups.make_delegated_subtree
    return Step("cgroup delegation", "change", f"delegate the cgroup subtree {leaf.parent} to {options.account} "
                "(systemd is not PID 1 here; cgroupfs forgets it at a reboot: run setup again after one)",
                (Call(lambda: make(account.uid, account.gid), shown),))


def delegation_module():  # type: ignore[no-untyped-def]
    """gpubook.runtime.cgroups where this gpubook has make_delegated_subtree(uid, gid) and
    delegation_commands(account) (the limits work), else None."""
    try:
        from gpubook.runtime import cgroups  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return None
    wanted = ("make_delegated_subtree", "delegation_commands")
    return cgroups if all(callable(getattr(cgroups, name, None)) for name in wanted) else None


def start_by_hand(facts: Facts, options: Options) -> str:
    """How to start the daemon without systemd: as the account, in the delegated subtree's leaf if any."""
    run = host.shell_line(_as_account(options, facts, str(options.binary), "run", "--config",
                                      str(options.file(CONFIG))))
    if not facts.cgroup_v2 or delegation_module() is None:
        return run
    procs = host.CGROUP_ROOT / host.SUBTREE_LEAF / "cgroup.procs"
    return f"sh -c 'echo $$ > {procs} && exec \"$@\"' sh {run}"


def step_config(facts: Facts, options: Options) -> Step:
    path = options.file(CONFIG)
    if facts.config:
        return Step("config", "already", f"{path} exists, kept as it is (setup never overwrites it)")
    return Step("config", "change", f"write {path} (mode 0600) with data_root = {options.data_root}",
                _install_file(options, facts, CONFIG, options.config_text, mode="0600",
                              shown="the example config with data_root set"))


def step_image(facts: Facts, options: Options) -> Step:
    if facts.image:
        return Step("image", "already", f"{options.image} is in {options.account}'s store")
    if not facts.mmdebstrap:
        return Step("image", "attention", f"{TEMPLATE}'s image is built with mmdebstrap, which is missing: "
                    "apt-get install mmdebstrap, then run setup again; or, offline, make it on a machine that has "
                    f"it (podman save -o {TEMPLATE}.tar {options.image}) and load it here as {options.account}: "
                    f"gpubook templates import {TEMPLATE} {TEMPLATE}.tar")
    return Step("image", "change", f"build {TEMPLATE}'s image {options.image} in {options.account}'s store "
                "(mmdebstrap; a minute or more)",
                (Run(_as_account(options, facts, str(options.binary), "templates", "--config",
                                 str(options.file(CONFIG)), "build", TEMPLATE)),))


def unit_text(packaged: str, binary: Path) -> str:
    """The packaged unit with ExecStart on the gpubook that is installed (this interpreter's)."""
    lines = [f"ExecStart={binary} run --config %E/gpubook/gpubook.toml" if line.startswith("ExecStart=")
             else line for line in packaged.splitlines()]
    return "\n".join(lines) + "\n"


def step_unit(facts: Facts, options: Options, *, packaged: str) -> Step:
    path, wanted = options.file(UNIT), unit_text(packaged, options.binary)
    actions: list[Action] = []
    said: list[str] = []
    if facts.unit == wanted:
        said.append(f"{path} runs {options.binary}")
    elif facts.unit is not None:
        return Step("unit", "attention", f"{path} differs from the unit this gpubook ships, kept: remove it and run "
                    "setup again to get the packaged one")
    else:
        said.append(f"install {path} (ExecStart: {options.binary})")
        actions += _install_file(options, facts, UNIT, wanted, mode="0644", shown="gpubook/systemd/gpubook.service")
    if not facts.systemd:
        said.append(f"systemd is not PID 1 here: start the daemon as {options.account} yourself: "
                    f"{start_by_hand(facts, options)}")
        return Step("unit", "change" if actions else "skipped", "; ".join(said), tuple(actions))
    if facts.unit_enabled:
        said.append("enabled and running")
    else:
        said.append("enable and start it in the account's user manager")
        manager = ("systemctl", "--user", "-M", f"{options.account}@")
        actions += [Run((*manager, "daemon-reload")), Run((*manager, "enable", "--now", "gpubook"))]
    return Step("unit", "change" if actions else "already", "; ".join(said), tuple(actions))


def steps(facts: Facts, options: Options) -> list[Step]:
    """The whole plan for hosts in these facts (what --dry-run prints)."""
    return [make(facts, options) for make in STEPS]


def _packaged(*parts: str) -> str:
    return resources.files("gpubook").joinpath(*parts).read_text()


STEPS: tuple[Callable[[Facts, Options], Step], ...] = (
    step_account, step_subids, step_linger, step_data_root, step_mount, step_storage, step_tun, step_cgroups,
    step_config, step_image, lambda facts, options: step_unit(facts, options, packaged=_packaged("systemd",
                                                                                                "gpubook.service")))


def with_data_root(text: str, data_root: Path, *, source: str) -> str:
    """The config text with [storage] data_root = data_root; the rest of the file as it was."""
    try:
        storage = tomllib.loads(text).get("storage", {})
    except tomllib.TOMLDecodeError as error:
        raise SetupError(f"{source} is not valid TOML: {error}") from None
    value = f"data_root = {json.dumps(str(data_root))}"
    lines = text.splitlines()
    header = next((n for n, line in enumerate(lines) if line.strip() == "[storage]"), None)
    if header is None:
        lines += ["", "[storage]", value]
    else:
        end = next((n for n in range(header + 1, len(lines)) if lines[n].lstrip().startswith("[")), len(lines))
        present = [n for n in range(header + 1, end) if re.match(r"\s*data_root\s*=", lines[n])]
        if present:
            lines[present[0]] = value
        else:
            lines.insert(header + 1, value)
    result = "\n".join(lines) + "\n"
    try:
        written = tomllib.loads(result).get("storage", {}).get("data_root")
    except tomllib.TOMLDecodeError:
        written = None
    if written != str(data_root):
        raise SetupError(f"{source}: cannot set [storage] data_root in it (found {storage.get('data_root')!r}); "
                         "write it as a [storage] table with a data_root line")
    return result
