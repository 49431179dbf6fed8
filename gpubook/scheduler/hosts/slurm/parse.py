"""Reading Slurm's own words: `scontrol show node|reservation --oneliner` into plain records.

Slurm 22.05's scontrol has no JSON output (`--json` came later), so each line is read as
`Key=value` pairs; a value runs up to the next ` Key=` (some values, such as OS and Reason,
hold spaces). Node lists come compressed (`node[1-3,7]`) and are expanded here, so comparing
what gpubook wants with what Slurm holds never needs `scontrol show hostnames`. Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_:/.]*)=")
_GRES_ITEM = re.compile(r"^gpu(?::(?P<type>[^:]+))?:(?P<count>\d+)$")
# Node states in which a node takes no new work: its GPUs are left out of the inventory.
_UNUSABLE = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "FUTURE", "MAINT",
                       "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN", "REBOOT_ISSUED",
                       "REBOOT_REQUESTED", "INVALID_REG", "UNKNOWN", "INVAL"})


@dataclass(frozen=True)
class Node:
    name: str
    gpus: int  # GRES gpu count (every type together)
    gpu_types: tuple[str, ...]  # the types named in its Gres (empty: untyped)
    partitions: tuple[str, ...]
    state: str  # as Slurm says it, such as IDLE, MIXED, IDLE+DRAIN, DOWN*

    @property
    def usable(self) -> bool:
        """Whether Slurm would give this node new work (not down, drained, failed or in maintenance)."""
        words = set(re.split(r"[+]", self.state.rstrip("*~#!%$@^-")))
        return not self.state.endswith("*") and not (words & _UNUSABLE)

    @property
    def silent(self) -> bool:
        """Not responding for now (`*`, as every node is for a moment after slurmctld restarts) but
        neither down, drained nor failed: its GPUs are kept in the plan rather than moved away."""
        words = set(re.split(r"[+]", self.state.rstrip("*~#!%$@^-")))
        return self.state.endswith("*") and not (words - {"UNKNOWN", "NOT_RESPONDING"}) & _UNUSABLE


@dataclass(frozen=True)
class Reservation:
    name: str
    nodes: tuple[str, ...]  # expanded, sorted
    start: datetime  # aware, UTC (scontrol runs with TZ=UTC)
    end: datetime
    users: tuple[str, ...]
    flags: tuple[str, ...]
    state: str  # ACTIVE or INACTIVE


def fields(line: str) -> dict[str, str]:
    """One `--oneliner` record as its `Key=value` pairs (later keys of the same name win)."""
    found = list(_KEY.finditer(line))
    pairs: dict[str, str] = {}
    for at, match in enumerate(found):
        stop = found[at + 1].start() if at + 1 < len(found) else len(line)
        pairs[match.group(1)] = line[match.end():stop].strip()
    return pairs


def records(text: str) -> list[dict[str, str]]:
    """Every record of a `--oneliner` listing (blank lines and "No reservations" sentences skipped)."""
    return [fields(line) for line in text.splitlines() if "=" in line]


def gres_gpus(gres: str) -> tuple[int, tuple[str, ...]]:
    """The gpu count and types of a Gres value such as `gpu:a100:4(S:0-1),gpu:v100:2` or `(null)`."""
    plain = re.sub(r"\([^)]*\)", "", gres)
    count, types = 0, []
    for item in plain.split(","):
        match = _GRES_ITEM.match(item.strip())
        if match:
            count += int(match.group("count"))
            if match.group("type") and match.group("type") not in types:
                types.append(match.group("type"))
    return count, tuple(types)


def nodes(text: str) -> tuple[Node, ...]:
    """`scontrol show node --oneliner` as nodes, in Slurm's order."""
    found = []
    for record in records(text):
        if "NodeName" not in record:
            continue
        count, types = gres_gpus(record.get("Gres", ""))
        parts = record.get("Partitions", "")
        found.append(Node(name=record["NodeName"], gpus=count, gpu_types=types,
                          partitions=tuple(p for p in parts.split(",") if p and p != "(null)"),
                          state=record.get("State", "UNKNOWN")))
    return tuple(found)


def reservations(text: str) -> tuple[Reservation, ...]:
    """`scontrol show reservation --oneliner` (run with TZ=UTC) as reservations."""
    found = []
    for record in records(text):
        if "ReservationName" not in record:
            continue
        found.append(Reservation(
            name=record["ReservationName"], nodes=tuple(sorted(expand_hostlist(record.get("Nodes", "")))),
            start=slurm_time(record["StartTime"]), end=slurm_time(record["EndTime"]),
            users=_list(record.get("Users", "")), flags=_list(record.get("Flags", "")),
            state=record.get("State", "")))
    return tuple(found)


def slurm_time(text: str) -> datetime:
    """A Slurm time stamp (`2026-11-22T23:57:26`, in the TZ scontrol ran with: UTC) as an aware time."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)


def expand_hostlist(text: str) -> list[str]:
    """`node[1-3,07],gpu5` → node1, node2, node3, node07, gpu5 (zero padding kept)."""
    names: list[str] = []
    for token in _top_level_split(text):
        names.extend(_expand_one(token))
    return names


def _expand_one(token: str) -> list[str]:
    match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", token)
    if not match:
        return [] if token in ("", "(null)") else [token]
    prefix, ranges, rest = match.groups()
    tails = _expand_one(rest) if rest else [""]
    out: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        numbers = range(int(low), int(high or low) + 1)
        out.extend(f"{prefix}{n:0{len(low)}d}{tail}" for n in numbers for tail in tails)
    return out


def _top_level_split(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _list(value: str) -> tuple[str, ...]:
    return tuple(v for v in value.split(",") if v and v != "(null)")
