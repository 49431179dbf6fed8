"""Groups as projects (issue 38): [groups.NAME] quotas beside each user's, the booking's `project:`,
and GPUs at once (`max_gpus`) for users and groups. Pure: the config, the convention and the plan
with plain data; events are read by the real booking reader.

Every expected figure is computed by hand in the comment beside it."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpubook.runtime.errors import ConfigError
from gpubook.scheduler.config import Config, parse
from gpubook.scheduler.core import policy
from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import Plan, Slot, plan, seen_key, to_json
from tests.kits.booking_kit import CALENDAR, TEMPLATES, raw, read, utc, vcalendar, vevent

NOW = utc(2026, 11, 23, 8)  # a Monday


def config(*, groups: dict[str, dict[str, Any]] | None = None, policy_table: dict[str, Any] | None = None,
           **users: dict[str, Any]) -> Config:
    """alice in vision then nlp, bob in vision, carol in no group (unless a test says otherwise)."""
    people: dict[str, dict[str, Any]] = {
        "alice": {"uid": 1000, "email": ["alice@lab.example"], "groups": ["vision", "nlp"]},
        "bob": {"uid": 1001, "email": ["bob@lab.example"], "groups": ["vision"]},
        "carol": {"uid": 1002, "email": ["carol@lab.example"]},
    }
    for name, extra in users.items():
        people[name] = {**people.get(name, {"uid": 1003}), **extra}
    return parse({
        "host": {"name": "devbox1", "timezone": "Europe/Berlin"},
        "calendar": [{"url": CALENDAR, "gpus": "all"}],
        "defaults": {"max_hours": 72},
        "users": people,
        "groups": groups if groups is not None else {"vision": {}, "nlp": {}, "speech": {}},
        "policy": policy_table or {},
    }, Path("/etc/gpubook/gpubook.toml"))


def booking(id: str, *, user: str = "alice", project: str | None = "vision", day: int = 24, start: int = 10,
            hours: float = 2, gpus: int = 1) -> Booking:
    """A booking starting at `start` o'clock UTC on `day` November 2026."""
    begin = utc(2026, 11, day, start)
    return Booking(id=id, uid=id, user=user, template="debian-ssh", gpu_count=gpus, gpu_indices=None,
                   start=begin, end=begin + timedelta(hours=hours), created=None, dtstamp=None,
                   calendar_url=CALENDAR, href=f"{CALENDAR}{id}.ics", project=project)


def run(*items: Booking, cfg: Config, now: datetime = NOW, running: dict[str, tuple[int, ...]] | None = None) -> Plan:
    """The bookings in the order given: each was accepted before the next was seen."""
    order = {item.id: NOW - timedelta(days=30) + timedelta(minutes=n) for n, item in enumerate(items)}
    slots = {seen_key(item): Slot(seen_at=order[item.id], accepted_at=order[item.id]) for item in items}
    return plan(items, inventory=(0, 1, 2, 3, 4, 5, 6, 7), config=cfg, templates=TEMPLATES, now=now,
                running=running or {}, first_seen={seen_key(i): order[i.id] for i in items}, slots=slots)


def verdicts(result: Plan) -> dict[str, str]:
    """Each booking: "ok", or its refusal."""
    return {**{a.booking.id: "ok" for a in result.accepted}, **{r.id: r.reason for r in result.rejected}}


# -- the config ----------------------------------------------------------------------------------


def test_groups_and_membership_are_read_in_the_files_order() -> None:
    cfg = config(groups={"vision": {"week_gpu_hours": 40, "max_gpus": 4, "max_future_bookings": 5}, "nlp": {},
                         "speech": {}})
    assert list(cfg.groups) == ["vision", "nlp", "speech"]
    assert policy.group_limits(cfg, "vision") == policy.Limits(week_gpu_hours=40, max_future_bookings=5, max_gpus=4)
    assert policy.group_limits(cfg, "nlp") == policy.Limits()  # 0: no limit
    assert (cfg.groups_of("alice"), cfg.groups_of("bob"), cfg.groups_of("carol")) == (("vision", "nlp"),
                                                                                      ("vision",), ())
    # A week quota of a group alone makes the daemon read the two weeks back that the week needs.
    assert policy.reach_back(cfg) == timedelta(days=14, hours=72)


@pytest.mark.parametrize(("groups", "users", "said"), [
    ({"vision": {"week_gpu_hours": -1}}, {}, "groups.vision.week_gpu_hours: must be 0 or more"),
    ({"vision": {"max_gpus": -2}}, {}, "groups.vision.max_gpus: must be 0 or more"),
    ({"vision": {"max_gpu": 2}}, {}, "groups.vision.max_gpu: unknown key; did you mean 'max_gpus'?"),
    ({"vision": {"max_gpus": "4"}}, {}, "groups.vision.max_gpus: must be an integer, not a string '4'"),
    ({"Vision!": {}}, {}, "groups.Vision!: is not a valid group name"),
    ({"vision": 3}, {}, "groups.vision: must be a table ([groups.vision]), not an integer"),
    ({"vision": {}}, {"alice": {"groups": ["visoin"]}},
     "users.alice.groups[0]: 'visoin' is not a [groups.NAME] table; did you mean 'vision'?"),
    ({"vision": {}}, {"alice": {"groups": ["vision", "vision"]}},
     "users.alice.groups[1]: names the group 'vision' twice"),
    ({}, {"alice": {"groups": ["vision"]}}, "users.alice.groups[0]: 'vision' is not a [groups.NAME] table "
     "(there is no [groups.NAME] table)"),
    ({"vision": {}}, {"alice": {"max_gpus": -1}}, "users.alice.max_gpus: must be 0 or more"),
])
def test_bad_group_config_names_the_key(groups: dict[str, Any], users: dict[str, Any], said: str) -> None:
    people = {"alice": {"uid": 1000}, "bob": {"uid": 1001}}
    for name, extra in users.items():
        people[name] = {**people[name], **extra}
    with pytest.raises(ConfigError) as error:
        parse({"calendar": [{"url": CALENDAR}], "users": people, "groups": groups}, Path("/etc/gpubook/gpubook.toml"))
    assert said in str(error.value)


def test_max_gpus_at_once_from_the_policy_a_user_overrides_and_zero_means_no_limit() -> None:
    cfg = config(policy_table={"max_gpus": 3}, bob={"max_gpus": 5}, carol={"max_gpus": 0})
    assert [policy.limits(cfg, name).max_gpus for name in ("alice", "bob", "carol")] == [3, 5, None]


# -- the ledger: a group's quotas beside its members' ---------------------------------------------

_GROUP_WEEK = {"vision": {"week_gpu_hours": 10}}
_GROUP_AT_ONCE = {"vision": {"max_gpus": 3}}


@pytest.mark.parametrize(("groups", "users", "items", "expected"), [
    # vision's week: alice's 8 GPU-hours are accepted, bob's 4 more would make 12 > 10.
    (_GROUP_WEEK, {}, [booking("a", hours=8), booking("b", user="bob", day=25, hours=4)],
     {"a": "ok", "b": "group vision has 8 of 10 GPU-hours in the week before this booking ends; "
                       "this booking needs 4"}),
    # Exactly the quota fits: 8 + 2 = 10.
    (_GROUP_WEEK, {}, [booking("a", hours=8), booking("b", user="bob", day=25, hours=2)], {"a": "ok", "b": "ok"}),
    # alice's booking counted against nlp is not vision's: vision's week stays empty.
    (_GROUP_WEEK, {}, [booking("a", hours=8, project="nlp"), booking("b", user="bob", day=25, hours=10)],
     {"a": "ok", "b": "ok"}),
    # A booking with no project (carol is in no group) counts against no group.
    (_GROUP_WEEK, {}, [booking("c", user="carol", project=None, hours=30)], {"c": "ok"}),
    # A later booking of the group may not overfill the week of an accepted one (bob's on the 26th, 2 h x 2 GPUs).
    (_GROUP_WEEK, {}, [booking("b", user="bob", day=26, hours=2, gpus=2), booking("a", day=25, hours=7)],
     {"b": "ok", "a": "group vision has 4 of 10 GPU-hours in the week before 2026-11-26 13:00 (CET) (the end of "
                       "another booking of the group's); this booking needs 7"}),
    # vision at once: alice holds 2 GPUs 10-12, bob asks for 2 from 11: 4 > 3.
    (_GROUP_AT_ONCE, {}, [booking("a", gpus=2), booking("b", user="bob", start=11, gpus=2)],
     {"a": "ok", "b": "group vision may hold at most 3 GPUs at once; the group's other bookings hold 2 during "
                       "this booking's time, and it asks for 2"}),
    # Back to back is never at once: bob's starts when alice's ends.
    (_GROUP_AT_ONCE, {}, [booking("a", gpus=2), booking("b", user="bob", start=12, gpus=2)], {"a": "ok", "b": "ok"}),
    # The peak is what counts, not the sum: 1 GPU 10-12 and 1 GPU 12-14 are 1 at once; with 2 more, 3 fits.
    (_GROUP_AT_ONCE, {}, [booking("a"), booking("b", user="bob", start=12), booking("c", start=11, hours=2, gpus=2)],
     {"a": "ok", "b": "ok", "c": "ok"}),
    # A single booking over the group's GPUs at once.
    (_GROUP_AT_ONCE, {}, [booking("a", gpus=4)],
     {"a": "group vision may hold at most 3 GPUs at once; the group's other bookings hold 0 during this booking's "
           "time, and it asks for 4"}),
    # Bookings not started yet: the group holds at most 1.
    ({"vision": {"max_future_bookings": 1}}, {}, [booking("a"), booking("b", user="bob", day=25)],
     {"a": "ok", "b": "group vision may hold at most 1 booking that have not started; 1 is held already"}),
    # The tighter wins: alice's own week (100) is loose, the group's (10) is not.
    (_GROUP_WEEK, {"alice": {"week_gpu_hours": 100}}, [booking("a", hours=11)],
     {"a": "group vision has 0 of 10 GPU-hours in the week before this booking ends; this booking needs 11"}),
    # ... and the other way round: alice's 5 is tighter than the group's 10.
    (_GROUP_WEEK, {"alice": {"week_gpu_hours": 5}}, [booking("a", hours=6)],
     {"a": "alice has 0 of 5 GPU-hours in the week before this booking ends; this booking needs 6"}),
    # Over both: both named, the user's first.
    (_GROUP_WEEK, {"alice": {"week_gpu_hours": 5}}, [booking("a", hours=11)],
     {"a": "alice has 0 of 5 GPU-hours in the week before this booking ends; this booking needs 11; and group "
           "vision has 0 of 10 GPU-hours in the week before this booking ends; this booking needs 11"}),
    # A user's GPUs at once: alice holds 1 from 10 to 12, 2 more from 11 make 3 > 2.
    ({"vision": {}}, {"alice": {"max_gpus": 2}}, [booking("a"), booking("b", start=11, gpus=2)],
     {"a": "ok", "b": "alice may hold at most 2 GPUs at once; their other bookings hold 1 during this booking's "
                       "time, and it asks for 2"}),
    # A single booking over the user's max_gpus is refused by the plan as before.
    ({"vision": {}}, {"alice": {"max_gpus": 2}}, [booking("a", gpus=3)],
     {"a": "alice may book at most 2 GPUs; this booking asks for 3"}),
])
def test_a_group_over_its_quota_is_refused_naming_the_group(groups: dict[str, Any], users: dict[str, Any],
                                                            items: list[Booking], expected: dict[str, str]) -> None:
    cfg = config(groups={**groups, **{name: {} for name in ("vision", "nlp") if name not in groups}}, **users)
    assert verdicts(run(*items, cfg=cfg)) == expected


def test_a_users_max_gpus_at_once_comes_from_the_policy() -> None:
    cfg = config(policy_table={"max_gpus": 2})
    result = run(booking("a"), booking("b", user="alice", start=11, gpus=2), booking("c", user="bob", gpus=2),
                 cfg=cfg)
    assert verdicts(result) == {"a": "ok", "b": "alice may hold at most 2 GPUs at once; their other bookings hold 1 "
                                               "during this booking's time, and it asks for 2", "c": "ok"}


def test_a_running_booking_of_the_group_is_never_refused_and_counts() -> None:
    """bob's running booking (12 GPU-hours) is over the group's 10 on its own: it runs on, and alice's
    booking that would add to it is refused."""
    cfg = config(groups={"vision": {"week_gpu_hours": 10}, "nlp": {}})
    now = utc(2026, 11, 24, 11)
    result = run(booking("b", user="bob", hours=6, gpus=2), booking("a", day=25, hours=1), cfg=cfg, now=now,
                 running={"b": (0, 1)})
    assert verdicts(result) == {"b": "ok", "a": "group vision has 12 of 10 GPU-hours in the week before this "
                                                "booking ends; this booking needs 1"}


def test_lowering_a_group_quota_refuses_the_later_bookings_in_order() -> None:
    items = (booking("a", hours=4), booking("b", user="bob", day=25, hours=4), booking("c", day=26, hours=4))
    loose = config(groups={"vision": {"week_gpu_hours": 12}, "nlp": {}})
    assert set(verdicts(run(*items, cfg=loose)).values()) == {"ok"}
    tight = replace(loose, groups={**loose.groups, "vision": replace(loose.groups["vision"], week_gpu_hours=8)})
    assert verdicts(run(*items, cfg=tight))["c"].startswith("group vision has 8 of 8 GPU-hours")
    assert [verdicts(run(*items, cfg=tight))[name] for name in "ab"] == ["ok", "ok"]


# -- the booking's project -----------------------------------------------------------------------


def _read(description: str = "", *, summary: str = "GPU time", organizer: str = "alice@lab.example",
          cfg: Config | None = None) -> Booking | Rejection:
    lines = ["DTSTART:20261124T090000Z", "DTEND:20261124T100000Z", f"SUMMARY:{summary}",
             f"ORGANIZER:mailto:{organizer}"]
    if description:
        lines.append("DESCRIPTION:" + description.replace("\n", "\\n"))
    result = read(raw(vcalendar(vevent("u1", *lines))), config=cfg or config())
    assert result.problems == () and len(result.occurrences) == 1, result
    return result.occurrences[0]


@pytest.mark.parametrize(("description", "summary", "organizer", "expected"), [
    ("", "GPU time", "alice@lab.example", "vision"),  # none named: alice's first group
    ("project: nlp", "GPU time", "alice@lab.example", "nlp"),
    ("Project = NLP  # the thesis", "GPU time", "alice@lab.example", "nlp"),  # any case, `=`, a comment
    ("projects: nlp", "GPU time", "alice@lab.example", "nlp"),
    ("", "alice project=nlp", "alice@lab.example", "nlp"),  # the title's short form
    ("", "GPU time", "carol@lab.example", None),  # carol is in no group and names none
    ("", "GPU time", "bob@lab.example", "vision"),
])
def test_the_project_is_the_one_named_else_the_users_first_group(description: str, summary: str, organizer: str,
                                                                 expected: str | None) -> None:
    found = _read(description, summary=summary, organizer=organizer)
    assert isinstance(found, Booking), found
    assert found.project == expected


@pytest.mark.parametrize(("description", "organizer", "said"), [
    ("projet: nlp", "alice@lab.example", "the description's `projet:` is not a key gpubook knows; "
     "did you mean `project:`?"),
    ("project: visoin", "alice@lab.example", "there is no project 'visoin'; did you mean vision?"),
    ("project: speech", "alice@lab.example", "alice is not in the group speech (project: 'speech'); "
     "alice's groups are vision, nlp"),
    ("project: nlp", "bob@lab.example", "bob is not in the group nlp (project: 'nlp'); bob's groups are vision"),
    ("project: nlp", "carol@lab.example", "carol is not in the group nlp (project: 'nlp'); carol is in no group"),
    ("project: robotics", "alice@lab.example", "project: 'robotics' is not a group; alice's groups are vision, nlp"),
    ("project: ../x", "alice@lab.example", "project '../x' is not a valid project name"),
])
def test_a_project_the_booker_is_not_in_is_refused_naming_their_groups(description: str, organizer: str,
                                                                       said: str) -> None:
    found = _read(description, organizer=organizer)
    assert isinstance(found, Rejection), found
    assert said in found.reason


def test_a_group_over_its_quota_is_refused_naming_the_group_from_the_calendar() -> None:
    """Events read by the booking reader, planned: bob's booking would take vision over its week."""
    cfg = config(groups={"vision": {"week_gpu_hours": 3}, "nlp": {}})
    events = vcalendar(
        vevent("a1", "DTSTART:20261124T090000Z", "DTEND:20261124T110000Z", "SUMMARY:alice gpus=1",
               "CREATED:20261101T000000Z"),
        vevent("b1", "DTSTART:20261124T120000Z", "DTEND:20261124T140000Z", "SUMMARY:bob gpus=1",
               "CREATED:20261102T000000Z"),
        vevent("a2", "DTSTART:20261124T120000Z", "DTEND:20261124T140000Z", "SUMMARY:alice gpus=1",
               "DESCRIPTION:project: nlp", "CREATED:20261103T000000Z"))
    read_back = read(raw(events), config=cfg)
    result = plan(read_back.occurrences, inventory=(0, 1), config=cfg, templates=TEMPLATES, now=NOW)
    assert verdicts(result) == {
        "a1": "ok", "a2": "ok",  # a2 counts against nlp, which has no quota
        "b1": "group vision has 2 of 3 GPU-hours in the week before this booking ends; this booking needs 2"}
    # `gpubook bookings --json` names each accepted booking's project.
    assert {row["id"]: row["project"] for row in to_json(result)["accepted"]} == {"a1": "vision", "a2": "nlp"}


# -- the fair-share tie-break --------------------------------------------------------------------


def _contending(groups: dict[str, Any]) -> Plan:
    """vision used 6 GPU-hours yesterday (a booking accepted before); now two new requests of one pass
    want the one GPU at the same time: bob's for vision, saved first, and alice's for nlp."""
    cfg = config(groups=groups)
    past = booking("p", user="bob", day=22, hours=6)
    first = replace(booking("v", user="bob"), created=utc(2026, 11, 1))
    second = replace(booking("n", project="nlp"), created=utc(2026, 11, 2))
    slots = {seen_key(past): Slot(seen_at=utc(2026, 11, 20), accepted_at=utc(2026, 11, 20))}
    return plan((past, first, second), inventory=(0,), config=cfg, templates=TEMPLATES, now=NOW, slots=slots)


def test_among_new_requests_the_group_further_under_its_share_goes_first() -> None:
    # vision used 6 of its 10 in the week before now, nlp 0 of its 10: nlp's request goes first.
    result = _contending({"vision": {"week_gpu_hours": 10}, "nlp": {"week_gpu_hours": 10}})
    assert [a.booking.id for a in result.accepted] == ["p", "n"]
    assert [r.id for r in result.rejected] == ["v"]
    assert policy.used_shares(config(groups={"vision": {"week_gpu_hours": 10}, "nlp": {"week_gpu_hours": 10}}),
                              [booking("p", user="bob", day=22, hours=6)], now=NOW) == {"vision": 0.6, "nlp": 0.0}


def test_without_shares_created_decides_as_before() -> None:
    # No week quota: no share, so the request saved first (bob's, for vision) goes first.
    result = _contending({"vision": {}, "nlp": {}})
    assert [a.booking.id for a in result.accepted] == ["p", "v"]
    assert [r.id for r in result.rejected] == ["n"]


def test_without_groups_a_project_line_is_the_bookers_own_text() -> None:
    """A config with no [groups.NAME] has no project to name: `project: thesis` and a word close to it
    stay the booker's text, as before groups."""
    cfg = config(groups={}, alice={"groups": []}, bob={"groups": []})
    for description in ("project: my thesis", "projet: x", "project: x"):
        found = _read(description, cfg=cfg)
        assert isinstance(found, Booking) and found.project is None, found
    found = _read("", summary="alice project=x", cfg=cfg)
    assert isinstance(found, Booking) and found.project is None, found


@pytest.mark.parametrize("seed", range(5))
def test_a_groups_running_weeks_are_the_sums_a_naive_count_gives(seed: int) -> None:
    """The ledger keeps each accepted end's week as bookings are added (linear, not quadratic: a group
    holds hundreds); after every add it equals the plain sum over every booking held."""
    import random

    from gpubook.scheduler.core.policy import WEEK, _Account, _Held

    rng = random.Random(seed)
    account, held = _Account(weekly=True), []
    for _ in range(200):
        start = NOW + timedelta(minutes=30 * rng.randrange(-20 * 48, 20 * 48))
        item = _Held(start, start + timedelta(hours=rng.choice([0.5, 1, 4, 24, 72])), rng.choice([1, 2, 4]))
        account.add(item, now=NOW)
        held.append(item)
        end = rng.choice(held).end
        assert account.week[end] == sum((h.within(end - WEEK, end) for h in held), timedelta(0))
        since = NOW + timedelta(hours=rng.randrange(-500, 500))
        assert sorted(account.overlapping(since, since + WEEK), key=id) == \
            sorted((h for h in held if h.start < since + WEEK and h.end > since), key=id)
    assert all(account.week[h.end] == sum((o.within(h.end - WEEK, h.end) for o in held), timedelta(0)) for h in held)
    assert account.future == sum(1 for h in held if h.start > NOW)


def test_an_ended_booking_keeps_its_project_in_the_status() -> None:
    """The status's timelines: a planned booking carries its project; one that ended and left the
    plan keeps the project the previous status knew (as its title), so `gpubook mine` still shows it."""
    from gpubook.scheduler.outbox.status import GpuSummary, Status, hosts_status
    from gpubook.scheduler.state.records import ContainerRecord

    cfg = config()
    now = utc(2026, 11, 24, 18)
    first = plan((booking("done", start=10), booking("next", project="nlp", start=20)), inventory=(0,), config=cfg,
                 templates=TEMPLATES, now=utc(2026, 11, 24, 9))
    record = ContainerRecord(id=1, booking_id="done", name="gpubook-done", user="alice", gpu_count=1,
                             started_at=utc(2026, 11, 24, 10), stopped_at=utc(2026, 11, 24, 12), exit_reason="ended",
                             restarts=0)
    summaries = {"local": GpuSummary(source="config", count=1)}
    before = hosts_status(summaries, plan=first, now=utc(2026, 11, 24, 11))
    previous = Status(hosts=before, updated=utc(2026, 11, 24, 11).isoformat())
    later = plan((booking("next", project="nlp", start=20),), inventory=(0,), config=cfg, templates=TEMPLATES, now=now)
    hosts = hosts_status(summaries, plan=later, now=now, records=[record], previous=previous)
    segments = {s.booking: (s.kind, s.project) for lane in hosts[0].timeline for s in lane.segments}
    assert segments == {"done": ("ended", "vision"), "next": ("booked", "nlp")}
