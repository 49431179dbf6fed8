"""The booking convention: who books, which template and which GPUs, read from one event.

`key: value` lines in the description win, then the title's short form (`alice tensorflow-cuda9
gpus=2`), then GPUs named in LOCATION, then the organizer's e-mail and the config's defaults.
`gpus:` is always the booking's whole count; `nodes: 2` (a Slurm cluster) spreads it evenly over
that many nodes (without `gpus:`, each node gets the default count).
`project: vision` names the group (a [groups.NAME] the booker is in) the booking counts against;
without it, the booker's first group (Config.groups_of). `standby: yes` waits for GPUs taken or a
quota spent instead of being refused (core/plan.py).

Understood, or refused by name, never silently defaulted (issue 37). The title and the description
follow one grammar: one table of keys (KEYS) and one reader per value, so the same words mean the
same in both. A key is matched forgivingly (any case, `:` or `=`, singular or plural, a trailing
`# comment` dropped), user and template names in any case. A word close to a key (`tempalte: x`),
or a name close to a known user or template (`user: Alcie`), is refused with "did you mean". A
word close to no key (`note: rerun with lr 0.1`) is the booker's own text. A word counts as a
misspelt key only with a value its key could take, so prose with a colon ("Note: the GPUs are
slow", a URL) is never refused.

`1,` is the list of one index, GPU 1, in the title as in the description. It is how the guide has
always named one GPU, a list reads the same wherever it is written, and the write-back names the
GPUs gpubook took, so a comma read otherwise than meant shows at once. (The title used to drop the
comma and read a count: two meanings in two places was the bug.)

Every value is checked here (names against gpubook/runtime/names.py, no look-alikes); a wrong one
becomes `Refused` with the sentence the booker reads. docs/reference/booking-convention.md is
printed by `reference()` from the same table. Pure: no I/O.
"""

from __future__ import annotations

import difflib
import math
import re
import unicodedata
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import icalendar

from gpubook.runtime.names import TEMPLATE_NAME, USER_NAME
from gpubook.scheduler.core.topology import ONE_MACHINE, Topology
from gpubook.scheduler.settings import Config
from gpubook.scheduler.sources.block import strip_block
from gpubook.scheduler.sources.richtext import description_source, lines

MAX_NODES = 64
CLOSE = 0.75  # difflib's ratio from which a word is read as a misspelt key, user or template
# Unknown `word: value` words looked at for a misspelt key, in the description and in the title each:
# a booking has a few, and a hostile 64 KiB description of them (each occurrence of a series reads
# it again) must cost about what it did before; like READ_LIMIT, a bound no booker meets.
MAX_GUESSES = 64
_ITEM = r"[0-9]{1,3}(?:[ \t]*-[ \t]*[0-9]{1,3})?"  # one GPU index, or a range of them
_COUNT = re.compile(r"[0-9]{1,3}", re.ASCII)
_INDICES = re.compile(rf"{_ITEM}(?:[ \t]*,[ \t]*{_ITEM})*[ \t]*,?", re.ASCII)


@dataclass(frozen=True)
class Key:
    """One key of the convention, as the reader and the reference page know it."""

    name: str  # as sentences write it
    spellings: tuple[str, ...]  # every way it may be written (in any case)
    value: str  # its value in words (the reference page)
    example: str
    # A value the booker may have meant for this key: only with one is a word close to it refused.
    shape: re.Pattern[str]


KEYS = (
    Key("user", ("user", "users"), "a user name of the users file, in any case (`Alice` is `alice`)",
        "user: alice", re.compile(r"[^\s0-9]\S{0,63}")),
    Key("template", ("template", "templates"), "a template name, in any case", "template: pytorch-cuda12",
        re.compile(r"\S{1,64}")),
    Key("gpus", ("gpus", "gpu"), "a number of GPUs (`2`: gpubook picks them), or GPU indices: `0,2`, a range "
        "`0-3`, both `0-2,5`; `1,` (a list of one) is GPU 1 alone", "gpus: 0-1", re.compile(r"[0-9][0-9 \t,-]*")),
    Key("nodes", ("nodes", "node"), f"how many nodes the booking spans, 1 to {MAX_NODES} (on a Slurm cluster "
        "only; its GPUs are spread evenly)", "nodes: 2", _COUNT),
    Key("project", ("project", "projects"), "a group (`[groups.NAME]`) the booker is in, in any case: the booking "
        "counts against its quotas as well as the booker's; default: the booker's first group (the first of their "
        "`groups`; with a directory, then the configured groups it lists them in, in the config's order)",
        "project: vision", re.compile(r"[^\s0-9]\S{0,63}")),
    Key("standby", ("standby",), "`yes` or `no` (default): with yes, a booking whose GPUs are taken, or whose "
        "quota is spent, waits on standby instead of being refused, and runs as soon as they free up in its "
        "time, before any request made after it", "standby: yes", re.compile(r"[A-Za-z]{1,8}")),
)
_SPELLINGS = {spelling: key for key in KEYS for spelling in key.spellings}
EVERY_KEY = frozenset(key.name for key in KEYS)
# Without [groups.NAME] tables there is no project to name: `project: x` stays the booker's own text,
# as it was before groups (a lab's descriptions may hold such lines), and no word is read as its typo.
WITHOUT_GROUPS = EVERY_KEY - {"project"}
# A word that may be a key or a misspelt one: no word shorter or longer can be CLOSE to a spelling
# (difflib's ratio is at most twice the shorter length over both lengths), so a line of another
# word costs one failed match, as before the guesses.
_SHORTEST = math.ceil(CLOSE * min(map(len, _SPELLINGS)) / (2 - CLOSE) - 1e-9)
_LONGEST = math.floor((2 / CLOSE - 1) * max(map(len, _SPELLINGS)) + 1e-9)
_WORD = rf"[A-Za-z][A-Za-z_-]{{{_SHORTEST - 1},{_LONGEST - 1}}}"

# One description line with its blanks stripped: anchored, with no pattern after the value, so a
# line of blanks costs a single scan (a `(.*?)[ \t]*$` cost seconds on 80 KB of them).
_LINE = re.compile(rf"({_WORD})[ \t]*([:=])(.*)", re.ASCII | re.DOTALL)
# A `key=value` or `key: value` in the title: a value that ends in a comma goes on over the next
# word when that is a number (`gpus=0, 2`).
_TITLE_PAIR = re.compile(rf"(?<![^\s,;:(\[])({_WORD})(?:[ \t]*(=)[ \t]*|:([ \t]*))"
                         r"(\S+(?:(?<=,)[ \t]+[0-9]\S*)*)", re.ASCII)
_COMMENT = re.compile(r"[ \t]#")
_LOCATION_GPUS = re.compile(
    rf"\bgpus?[ \t]*[#:]?[ \t]*({_ITEM}(?:[ \t]*,[ \t]*(?:gpus?[ \t]*#?[ \t]*)?{_ITEM})*)",
    re.IGNORECASE | re.ASCII)
_PUNCTUATION = ",;:()[]"


@dataclass(frozen=True)
class Request:
    user: str
    template: str
    gpu_count: int
    gpu_indices: tuple[int, ...] | None
    nodes: int | None = None  # `nodes: K` (a multi-node booking); None: as few as its GPUs fit on
    project: str | None = None  # the group it counts against; None: the booker is in no group
    standby: bool = False  # `standby: yes`: it waits for its GPUs instead of being refused


class Refused(Exception):
    """A booking convention value that is wrong; the message is the rejection reason."""

    def __init__(self, reason: str, user: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.user = user


class Value(NamedTuple):
    """A key's value as written, before it is read."""

    text: str
    where: str  # how a sentence names where it was written: `gpus:` the description, `gpus=` the title
    shown: str = ""  # how a sentence shows it, where not as `show(text)`


@dataclass(frozen=True)
class Said:
    """What an event's words say, before any value is read: each key's value, and each misspelt key."""

    values: Mapping[str, Value]
    typos: tuple[str, ...] = ()


@dataclass(frozen=True)
class Asked:
    """The template, GPUs and nodes an event asks for; None where it says nothing."""

    template: str | None
    gpus: tuple[int, tuple[int, ...] | None] | None
    nodes: int | None
    standby: bool = False


def request(component: icalendar.Event, *, config: Config, templates: Collection[str],
            owner: str | None = None, topology: Topology = ONE_MACHINE) -> Request:
    """Read who books, which template and which GPUs; raise Refused with the reason. `owner`: the
    user of a per-user calendar (`[[calendar]] user`), the only one its events may book for;
    `topology`: where the backend runs bookings (a cluster picks a node's GPUs itself)."""
    # The lines the booker sees (plain or HTML); gpubook's own write-back block is never read as
    # the booker's `key: value` lines.
    # (the block is taken out first, so that its text never decides whether the rest is HTML).
    source, as_html = description_source(component)
    words = said(lines(strip_block(source), as_html=as_html), text(component.get("SUMMARY")),
                 text(component.get("LOCATION")), users=config.users, templates=templates,
                 hosts=(config.host.name,), keys=EVERY_KEY if config.groups else WITHOUT_GROUPS)
    claimed = user_of(words, config.users)
    try:
        user = _owned(component, claimed, owner=owner, config=config) if owner is not None \
            else _booker(component, claimed, config=config)
    except Refused as refused:
        if words.typos and claimed is None:  # `usr: bob` is why the booking names no user
            raise Refused(words.typos[0], refused.user) from None
        raise
    try:
        asked = asked_of(words, templates)
        count, indices = asked.gpus or (config.defaults.gpus, None)
        if indices is not None and not topology.picks_gpus:
            raise Refused(f"on a Slurm cluster a booking asks for a number of GPUs (gpus: {len(indices)}), not GPU "
                          "indices: Slurm picks which GPUs of a node")
        nodes = asked.nodes
        if nodes is not None and nodes > 1:
            if indices is not None:
                raise Refused(f"a booking on {nodes} nodes asks for a number of GPUs (gpus: {nodes * len(indices)}), "
                              "not GPU indices: Slurm picks which GPUs of each node")
            if asked.gpus is None:
                count = nodes * config.defaults.gpus
            elif count % nodes:
                raise Refused(f"{count} GPUs cannot be spread evenly over {nodes} nodes; ask for a multiple of "
                              f"{nodes} GPUs")
        project = project_of(words, user, config)
    except Refused as refused:
        raise Refused(refused.reason, user) from None
    return Request(user=user, template=asked.template or config.defaults.template, gpu_count=count,
                   gpu_indices=indices, nodes=nodes, project=project, standby=asked.standby)


def project_of(words: Said, user: str, config: Config) -> str | None:
    """The group a booking counts against: the one `project:` names, which must be one of the user's
    groups, else the user's first group; None when they are in none and name none."""
    mine = config.groups_of(user)
    if "project" not in words.values or user not in config.users:  # an unknown user: the plan says so
        return mine[0] if mine else None
    value = words.values["project"]
    named = _name(value.text, known=tuple(config.groups), what="project")
    if named in mine:
        return named
    theirs = f"{user}'s groups are {', '.join(mine)}" if mine else f"{user} is in no group"
    if named in config.groups:
        raise Refused(f"{user} is not in the group {named} ({value.where} {show(value.text)}); {theirs}")
    raise Refused(f"{value.where} {show(value.text)} is not a group; {theirs}")


def said(description: Iterable[str], title: str, location: str, *, users: Collection[str],
         templates: Collection[str], hosts: Collection[str] = (), keys: Collection[str] = EVERY_KEY) -> Said:
    """The keys an event's description lines, title and location name (the description wins, then
    the title, then the location's GPUs). `hosts`: names that are never GPU words in the location;
    `keys`: the keys read (another key's words are the booker's text)."""
    described, typos = _description_values(description, keys)
    titled, title_typos = _title_values(title, users=users, templates=templates, keys=keys)
    values = {key: Value(value, f"{key}=") for key, value in titled.items()}
    values.update({key: Value(value, f"{key}:") for key, value in described.items()})
    if "gpus" not in values and (located := _location_gpus(location, hosts)) is not None:
        values["gpus"] = Value(located, "the location", show(location))
    return Said(values, (*typos, *title_typos))


def user_of(words: Said, users: Collection[str]) -> str | None:
    """The user the words name, read as a known user in any case; None: they name none."""
    if "user" not in words.values:
        return None
    return _name(words.values["user"].text, known=users, what="user")


def asked_of(words: Said, templates: Collection[str]) -> Asked:
    """The template, GPUs and nodes the words ask for, each read and checked (a misspelt key first)."""
    if words.typos:
        raise Refused(words.typos[0])
    values = words.values
    return Asked(template=_name(values["template"].text, known=templates, what="template") if "template" in values
                 else None,
                 gpus=_gpus(*values["gpus"]) if "gpus" in values else None,
                 nodes=_nodes(values["nodes"].text, values["nodes"].where) if "nodes" in values else None,
                 standby=_yes(values["standby"].text, values["standby"].where) if "standby" in values else False)


def _booker(component: icalendar.Event, claimed: str | None, *, config: Config) -> str:
    """Who the booking is for. An ORGANIZER who is a known user books only for themselves (a
    `user:` line or title naming someone else is refused); `[policy] identity = "organizer"`
    accepts nothing else. Otherwise the description's or title's user, then the organizer."""
    email = _organizer_email(component)
    organizer = config.user_by_email(email) if email else None
    if organizer is not None:
        if claimed is not None and claimed != organizer.name:
            raise Refused(f"the organizer {show(email, quote=False)} is {organizer.name}, who may book only "
                           f"for themselves, but the booking names user {show(claimed)}; remove that name "
                           f"or let {show(claimed, quote=False)} book from their own account", organizer.name)
        return organizer.name
    if config.policy.identity == "organizer":
        if not email:
            raise Refused("the booking has no organizer; on this server a booking is for its organizer, "
                           "so book from your own calendar account")
        raise Refused(f"the organizer {show(email, quote=False)} is not a known user; on this server a "
                       "booking is for its organizer: ask the admin to add this e-mail address to your user")
    if claimed is not None:
        return claimed
    if not email:
        raise Refused("the booking names no user; add a line `user: NAME` to its description "
                       "(or start its title with your user name)")
    raise Refused(f"{show(email, quote=False)} is not a known user; add `user: NAME` to the "
                   "description or ask the admin to add this e-mail address to your user")


def _owned(component: icalendar.Event, claimed: str | None, *, owner: str, config: Config) -> str:
    """The booker in a per-user calendar: its owner, always. The calendar server's login and rights
    decided who wrote the event, so a `user:` line, a title or an ORGANIZER naming someone else is
    a booking for another user made from the owner's calendar, and is refused (issue 22, finding 7)."""
    if claimed is not None and claimed != owner:
        raise Refused(f"this calendar books for {owner} only, but the booking names user {show(claimed)}; "
                      f"remove that name, or let {show(claimed, quote=False)} book in their own calendar", owner)
    email = _organizer_email(component)
    organizer = config.user_by_email(email) if email else None
    if organizer is not None and organizer.name != owner:
        raise Refused(f"this calendar books for {owner} only, but the booking's organizer "
                      f"{show(email, quote=False)} is {organizer.name}; let {organizer.name} book in "
                      "their own calendar", owner)
    return owner


def _organizer_email(component: icalendar.Event) -> str:
    organizer = component.get("ORGANIZER")
    return "" if organizer is None else re.sub(r"(?i)^mailto:", "", str(organizer).strip())


def _description_values(description: Iterable[str], keys: Collection[str]) -> tuple[dict[str, str], list[str]]:
    """Each key's value in the description's `key: value` lines, and a sentence for each misspelt key."""
    values: dict[str, str] = {}
    typos: list[str] = []
    guesses = 0
    for line in description:
        match = _LINE.match(line.strip(" \t"))
        if match is None:
            continue
        word, separator = match[1], match[2]
        key = _SPELLINGS.get(word.lower())
        if key is not None and key.name not in keys:
            continue
        if key is None:
            guesses += 1
            if not typos and guesses <= MAX_GUESSES \
                    and (meant := _misspelt(word, _uncommented(match[3]), keys)) is not None:
                typos.append(f"the description's `{word}{separator}` is not a key gpubook knows; "
                             f"did you mean `{meant.name}:`?")
            continue
        value = _uncommented(match[3])
        if key.name in values and values[key.name] != value:
            raise Refused(f"the description has more than one `{key.name}:` line "
                           f"({show(values[key.name])} and {show(value)}); keep one")
        values[key.name] = value
    return values, typos


def _title_values(title: str, *, users: Collection[str], templates: Collection[str],
                  keys: Collection[str] = EVERY_KEY) -> tuple[dict[str, str], list[str]]:
    """The title's short form, e.g. `alice tensorflow-cuda9 gpus=2`: `key=value` words as in the
    description, a known user's or template's name as a word of its own; other words are ignored."""
    found: dict[str, dict[str, str]] = {}  # key -> each value, by how it compares, as first written
    typos: list[str] = []
    used: list[tuple[int, int]] = []  # the spans of the key=value words: what is left are words of their own
    guesses = position = 0
    while (match := _TITLE_PAIR.search(title, position)) is not None:
        word, value = match[1], match[4].rstrip(";:)]")
        key = _SPELLINGS.get(word.lower())
        if key is not None and key.name not in keys:
            position = match.end()
            continue
        if key is not None:
            found.setdefault(key.name, {}).setdefault(_compared(value), value)
            used.append(match.span())
            position = match.end()
            continue
        guesses += 1
        if (match[2] or not match[3]) and not typos and guesses <= MAX_GUESSES \
                and (meant := _misspelt(word, value, keys)) is not None:
            typos.append(f"the title's `{word}{match[2] or ':'}` is not a key gpubook knows; "
                         f"did you mean `{meant.name}=`?")
        position = match.start(4)  # `alice:gpus=2`: the value may hold a key of its own
    rest: list[str] = []
    position = 0
    for start, end in used:
        rest.append(title[position:start])
        position = end
    rest.append(title[position:])
    for word in " ".join(rest).split():
        lower = word.strip(_PUNCTUATION).lower()
        if lower in users:
            found.setdefault("user", {}).setdefault(lower, lower)
        elif lower in templates:
            found.setdefault("template", {}).setdefault(lower, lower)
    values = {}
    for name, candidates in found.items():
        if len(candidates) > 1:
            shown = ", ".join(show(c) for c in sorted(candidates.values()))
            raise Refused(f"the title names more than one {name} ({shown}); "
                           f"put a `{name}: …` line in the description")
        values[name] = next(iter(candidates.values()))
    return values, typos


def _compared(value: str) -> str:
    """A title value as two of them are compared: `Alice` and `alice` name one user."""
    return value.lower() if value.isascii() else value


def _uncommented(value: str) -> str:
    """A value without its blanks and its trailing `# comment`."""
    value = value.strip(" \t")
    comment = _COMMENT.search(value)
    return value if comment is None else value[:comment.start()].rstrip(" \t")


def _misspelt(word: str, value: str, keys: Collection[str]) -> Key | None:
    """The key an unknown word was meant for: close to one of its spellings, with a value it could take."""
    spellings = [spelling for spelling, key in _SPELLINGS.items() if key.name in keys]
    close = difflib.get_close_matches(word.lower(), spellings, n=1, cutoff=CLOSE)
    key = _SPELLINGS[close[0]] if close else None
    return key if key is not None and key.shape.fullmatch(value) else None


def _location_gpus(location: str, hosts: Collection[str]) -> str | None:
    """GPU indices named in LOCATION (`gpu 1`, `GPU0,GPU2`, `GPUs 0-3`), as booking systems and
    gpubook's own availability feed write it (`devbox1 GPU 0,1`). A word that is a host's whole name
    is a name, never a GPU: on the host gpu1, `gpu1 GPU 1` is GPU 1. (Only a name that reads as GPU
    words is skipped: on a host named `gpu` or `1`, `GPU 1` keeps its words.)"""
    names = {host.lower() for host in hosts if _LOCATION_GPUS.search(host)}
    kept = " ".join(word for word in location.split() if word.strip(_PUNCTUATION).lower() not in names)
    matches = _LOCATION_GPUS.findall(kept)
    if not matches:
        return None
    return ",".join(item for match in matches for item in re.findall(_ITEM, match)) + ","


def _name(value: str, *, known: Collection[str], what: str) -> str:
    """A user or template name: a known one in any case, else exactly as the name rules allow
    (ASCII, no look-alikes, no path tricks); one close to a known name is refused with that name."""
    if value in known:
        return value
    if value.isascii() and value.lower() in known:
        return value.lower()
    pattern, rule = (USER_NAME, "lower-case ASCII letters, digits, '_' and '-', starting with a letter") \
        if what in ("user", "project") else (TEMPLATE_NAME, "lower-case ASCII letters, digits, '.', '_' and '-'")
    normal = unicodedata.normalize("NFKC", value)
    close = difflib.get_close_matches(normal[:64].lower(), sorted(known), n=1, cutoff=CLOSE)
    meant = f"; did you mean {close[0]}?" if close else ""
    if meant and value.isascii() and pattern.fullmatch(value.lower()):
        raise Refused(f"there is no {what} {show(value)}{meant}")
    if any(unicodedata.category(c).startswith("C") for c in value) or normal != value \
            or not normal.isascii() or not pattern.match(normal):
        raise Refused(f"{what} {show(value)} is not a valid {what} name ({rule}){meant}")
    return normal


def _gpus(value: str, where: str, shown: str = "") -> tuple[int, tuple[int, ...] | None]:
    """`2` is a count; `0,2`, `0-3`, `0-2,5` and `1,` (a list of one) are indices."""
    shown = shown or show(value)
    if _COUNT.fullmatch(value):
        count = int(value)
        if count == 0:
            raise Refused(f"{where} 0 asks for no GPU; ask for 1 or more")
        return count, None
    if _INDICES.fullmatch(value):
        indices: set[int] = set()
        for item in re.findall(_ITEM, value):
            first, _, last = item.partition("-")
            low, high = int(first), int(last or first)
            if low > high:
                raise Refused(f"{where} {shown} has the range {low}-{high}, which runs backwards; "
                              f"write {high}-{low}")
            for index in range(low, high + 1):
                if index in indices:
                    raise Refused(f"{where} {shown} names GPU {index} twice")
                indices.add(index)
        return len(indices), tuple(sorted(indices))
    raise Refused(f"{where} {shown} is neither a number of GPUs (such as 2) nor a list of "
                   "GPU indices (such as 0,2 or 0-3)")


def _nodes(value: str, where: str) -> int:
    """`nodes: K`: how many nodes a booking spans (1 to 64)."""
    if not _COUNT.fullmatch(value) or not 1 <= int(value) <= MAX_NODES:
        raise Refused(f"{where} {show(value)} is not a number of nodes from 1 to {MAX_NODES}")
    return int(value)


_YES, _NO = frozenset({"yes", "y", "true", "on"}), frozenset({"no", "n", "false", "off"})


def _yes(value: str, where: str) -> bool:
    """`standby: yes` (or true, on) and `no` (false, off), in any case."""
    word = value.strip().lower()
    if word in _YES or word in _NO:
        return word in _YES
    raise Refused(f"{where} {show(value)} is not yes or no")


def text(prop: object) -> str:
    return "" if prop is None else str(prop)


def show(value: str, *, quote: bool = True, limit: int = 40) -> str:
    """A calendar value made safe to print: escaped, ASCII, truncated."""
    shown = ascii(value[:limit] + ("…" if len(value) > limit else ""))
    shown = shown.replace("\\u2026", "…")
    return shown if quote else shown[1:-1]
