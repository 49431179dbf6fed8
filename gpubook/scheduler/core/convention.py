"""The booking convention: who books, which template and which GPUs, read from one event.

`key: value` lines in the description win, then the title's short form (`alice tensorflow-cuda9
gpus=2`), then GPUs named in LOCATION, then the organizer's e-mail and the config's defaults.
`gpus:` is always the booking's whole count; `nodes: 2` (a Slurm cluster) spreads it evenly over
that many nodes (without `gpus:`, each node gets the default count).
Every value is checked here (names against gpubook/runtime/names.py, no look-alikes); a wrong one becomes
`Refused` with the sentence the booker reads. Pure: no I/O.
"""

from __future__ import annotations

import re
import unicodedata
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import icalendar

from gpubook.runtime.names import TEMPLATE_NAME, USER_NAME
from gpubook.scheduler.core.topology import ONE_MACHINE, Topology
from gpubook.scheduler.settings import Config
from gpubook.scheduler.sources.block import strip_block
from gpubook.scheduler.sources.richtext import description_source, lines

# Matched against one line with its blanks stripped: anchored, with no pattern after the value,
# so a line of blanks costs a single scan (a `(.*?)[ \t]*$` cost seconds on 80 KB of them).
_DESCRIPTION_LINE = re.compile(r"(user|template|gpus|nodes)[ \t]*:(.*)", re.IGNORECASE | re.DOTALL)
_LOCATION_GPUS = re.compile(
    r"\bgpus?[ \t]*[#:]?[ \t]*([0-9]{1,3}(?:[ \t]*,[ \t]*(?:gpu[ \t]*)?[0-9]{1,3})*)",
    re.IGNORECASE | re.ASCII)
_COUNT = re.compile(r"[0-9]{1,3}", re.ASCII)
MAX_NODES = 64
_INDICES = re.compile(r"[0-9]{1,3}(?:[ \t]*,[ \t]*[0-9]{1,3})*[ \t]*,?", re.ASCII)


@dataclass(frozen=True)
class Request:
    user: str
    template: str
    gpu_count: int
    gpu_indices: tuple[int, ...] | None
    nodes: int | None = None  # `nodes: K` (a multi-node booking); None: as few as its GPUs fit on


class Refused(Exception):
    """A booking convention value that is wrong; the message is the rejection reason."""

    def __init__(self, reason: str, user: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.user = user


def request(component: icalendar.Event, *, config: Config, templates: Collection[str],
            owner: str | None = None, topology: Topology = ONE_MACHINE) -> Request:
    """Read who books, which template and which GPUs; raise Refused with the reason. `owner`: the
    user of a per-user calendar (`[[calendar]] user`), the only one its events may book for;
    `topology`: where the backend runs bookings (a cluster picks a node's GPUs itself)."""
    # The lines the booker sees (plain or HTML); gpubook's own write-back block is never read as
    # the booker's `key: value` lines.
    # (the block is taken out first, so that its text never decides whether the rest is HTML).
    source, as_html = description_source(component)
    described = _description_values(lines(strip_block(source), as_html=as_html))
    titled = _summary_values(text(component.get("SUMMARY")), users=config.users,
                             templates=templates)

    user = _owned(component, described, titled, owner=owner, config=config) if owner is not None \
        else _booker(component, described, titled, config=config)
    try:
        template = _checked_name(described["template"], TEMPLATE_NAME, "template") \
            if "template" in described else titled.get("template") or config.defaults.template
        if "gpus" in described:
            count, indices = _gpus(described["gpus"], "gpus:")
        elif "gpus" in titled:
            count, indices = _gpus(titled["gpus"], "gpus=")
        elif (located := _location_gpus(text(component.get("LOCATION")))) is not None:
            count, indices = _gpus(located, "the location's GPU")
        else:
            count, indices = config.defaults.gpus, None
        if indices is not None and not topology.picks_gpus:
            raise Refused(f"on a Slurm cluster a booking asks for a number of GPUs (gpus: {len(indices)}), not GPU "
                          "indices: Slurm picks which GPUs of a node")
        nodes = _nodes(described.get("nodes", titled.get("nodes")), "nodes:" if "nodes" in described else "nodes=")
        if nodes is not None and nodes > 1:
            if indices is not None:
                raise Refused(f"a booking on {nodes} nodes asks for a number of GPUs (gpus: {nodes * len(indices)}), "
                              "not GPU indices: Slurm picks which GPUs of each node")
            if "gpus" not in described and "gpus" not in titled:
                count = nodes * config.defaults.gpus
            elif count % nodes:
                raise Refused(f"{count} GPUs cannot be spread evenly over {nodes} nodes; ask for a multiple of "
                              f"{nodes} GPUs")
    except Refused as refused:
        raise Refused(refused.reason, user) from None
    return Request(user=user, template=template, gpu_count=count, gpu_indices=indices, nodes=nodes)


def _booker(component: icalendar.Event, described: Mapping[str, str], titled: Mapping[str, str], *,
            config: Config) -> str:
    """Who the booking is for. An ORGANIZER who is a known user books only for themselves (a
    `user:` line or title naming someone else is refused); `[policy] identity = "organizer"`
    accepts nothing else. Otherwise the description's or title's user, then the organizer."""
    claimed = _checked_name(described["user"], USER_NAME, "user") if "user" in described \
        else titled.get("user")
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


def _owned(component: icalendar.Event, described: Mapping[str, str], titled: Mapping[str, str], *,
           owner: str, config: Config) -> str:
    """The booker in a per-user calendar: its owner, always. The calendar server's login and rights
    decided who wrote the event, so a `user:` line, a title or an ORGANIZER naming someone else is
    a booking for another user made from the owner's calendar, and is refused (issue 22, finding 7)."""
    claimed = _checked_name(described["user"], USER_NAME, "user") if "user" in described \
        else titled.get("user")
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


def _description_values(description: list[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in description:
        match = _DESCRIPTION_LINE.match(line.strip(" \t"))
        if match is None:
            continue
        key, value = match[1].lower(), match[2].strip(" \t")
        if key in values and values[key] != value:
            raise Refused(f"the description has more than one `{key}:` line "
                           f"({show(values[key])} and {show(value)}); keep one")
        values[key] = value
    return values


def _summary_values(summary: str, *, users: Collection[str],
                    templates: Collection[str]) -> dict[str, str]:
    """The title's short form, e.g. `alice tensorflow-cuda9 gpus=2`; other words are ignored."""
    found: dict[str, set[str]] = defaultdict(set)
    for word in summary.split():
        word = word.strip(",;:()[]")
        lower = word.lower()
        if lower.startswith("gpus="):
            found["gpus"].add(word[len("gpus="):])
        elif lower.startswith("nodes="):
            found["nodes"].add(word[len("nodes="):])
        elif lower in users:
            found["user"].add(lower)
        elif lower in templates:
            found["template"].add(lower)
    values = {}
    for key, candidates in found.items():
        if len(candidates) > 1:
            shown = ", ".join(show(c) for c in sorted(candidates))
            raise Refused(f"the title names more than one {key} ({shown}); "
                           f"put a `{key}: …` line in the description")
        values[key] = candidates.pop()
    return values


def _location_gpus(location: str) -> str | None:
    """GPU indices named in LOCATION (`gpu 1`, `GPU0,GPU2`), as booking systems fill it."""
    matches = _LOCATION_GPUS.findall(location)
    if not matches:
        return None
    return ",".join(n for match in matches for n in re.findall(r"[0-9]+", match)) + ","


def _checked_name(value: str, pattern: re.Pattern[str], what: str) -> str:
    """A user or template name exactly as configured: ASCII, no look-alikes, no path tricks."""
    normal = unicodedata.normalize("NFKC", value)
    if any(unicodedata.category(c).startswith("C") for c in value) or normal != value \
            or not normal.isascii() or not pattern.match(normal):
        rule = ("lower-case ASCII letters, digits, '_' and '-', starting with a letter"
                if what == "user" else "lower-case ASCII letters, digits, '.', '_' and '-'")
        raise Refused(f"{what} {show(value)} is not a valid {what} name ({rule})")
    return normal


def _gpus(value: str, where: str) -> tuple[int, tuple[int, ...] | None]:
    """`2` is a count; `0,2` (or `1,` for one GPU) are indices."""
    if _COUNT.fullmatch(value):
        count = int(value)
        if count == 0:
            raise Refused(f"{where} 0 asks for no GPU; ask for 1 or more")
        return count, None
    if _INDICES.fullmatch(value):
        indices = [int(n) for n in re.findall(r"[0-9]+", value)]
        for index in indices:
            if indices.count(index) > 1:
                raise Refused(f"{where} {show(value)} names GPU {index} twice")
        return len(indices), tuple(sorted(indices))
    raise Refused(f"{where} {show(value)} is neither a number of GPUs (such as 2) nor a list of "
                   "GPU indices (such as 0,2)")


def _nodes(value: str | None, where: str) -> int | None:
    """`nodes: K`: how many nodes a booking spans (1 to 64)."""
    if value is None:
        return None
    if not _COUNT.fullmatch(value) or not 1 <= int(value) <= MAX_NODES:
        raise Refused(f"{where} {show(value)} is not a number of nodes from 1 to {MAX_NODES}")
    return int(value)


def text(prop: object) -> str:
    return "" if prop is None else str(prop)


def show(value: str, *, quote: bool = True, limit: int = 40) -> str:
    """A calendar value made safe to print: escaped, ASCII, truncated."""
    shown = ascii(value[:limit] + ("…" if len(value) > limit else ""))
    shown = shown.replace("\\u2026", "…")
    return shown if quote else shown[1:-1]
