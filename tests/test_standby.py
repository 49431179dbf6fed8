"""Standby (issue 40): a booking with `standby: yes` whose GPUs are taken, or whose quota is spent,
waits instead of being refused; the first plan with room for it accepts it, before any request made
after it, and it never displaces an accepted booking. Read from real event text, planned by the real
plan, written as the real block and attendee answer."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import pytest

from gpubook.scheduler.core.bookings import Booking, Rejection
from gpubook.scheduler.core.plan import STANDBY, Plan, Slot, plan, seen_key
from gpubook.scheduler.sources import block
from gpubook.scheduler.sources.attendee import Answer
from tests.kits.booking_kit import TEMPLATES, booking, make_config, raw, read, utc, vcalendar, vevent

NOW = utc(2026, 11, 23, 8)
CONFIG = make_config()


def waiting(booking_: Booking) -> Booking:
    return dataclasses.replace(booking_, standby=True)


def run(*items: Booking | Rejection, accepted: dict[str, datetime] | None = None,
        asked: dict[str, datetime] | None = None, inventory: tuple[int, ...] = (0, 1)) -> Plan:
    """`accepted`: booking id → when gpubook accepted it at its slot; `asked`: → when gpubook saw a
    request not accepted (yet) ask for its slot."""
    slots = {seen_key(item): Slot(seen_at=at, accepted_at=at) for item in items
             if (at := (accepted or {}).get(item.id)) is not None}
    slots |= {seen_key(item): Slot(seen_at=at) for item in items if (at := (asked or {}).get(item.id)) is not None}
    return plan(items, inventory=inventory, config=CONFIG, templates=TEMPLATES, now=NOW, slots=slots)


def _description(*lines: str) -> Booking | Rejection:
    event = vevent("s1", "DTSTART:20261124T100000Z", "DTEND:20261124T120000Z", "SUMMARY:run",
                   "DESCRIPTION:" + "\\n".join(lines))
    return read(raw(vcalendar(event))).occurrences[0]


def test_standby_yes_is_read_from_the_event_and_a_wrong_value_is_one_sentence() -> None:
    assert isinstance(found := _description("user: alice", "standby: yes"), Booking) and found.standby
    assert isinstance(found := _description("user: alice", "Standby: ON"), Booking) and found.standby
    assert isinstance(found := _description("user: alice", "standby: no"), Booking) and not found.standby
    assert isinstance(found := _description("user: alice"), Booking) and not found.standby
    refused = _description("user: alice", "standby: maybe")
    assert isinstance(refused, Rejection) and refused.reason == "standby: 'maybe' is not yes or no"
    typo = _description("user: alice", "stanby: yes")
    assert isinstance(typo, Rejection) and "did you mean `standby:`?" in typo.reason


def test_a_standby_whose_gpus_are_taken_waits_instead_of_being_refused() -> None:
    holder = booking("holder", indices=(0, 1))
    result = run(holder, waiting(booking("wait", user="bob", gpus=2)), booking("plain", user="bob", gpus=2),
                 accepted={"holder": utc(2026, 11, 20)})
    rejected = {r.id: r for r in result.rejected}
    assert rejected["wait"].standby and rejected["wait"].reason.startswith(STANDBY + "none of the 2 GPUs asked for")
    assert "GPUs 0,1 are free tomorrow from 13:00" in rejected["wait"].reason  # the next free time, as any says
    assert not rejected["plain"].standby and not rejected["plain"].reason.startswith(STANDBY)
    assert [a.booking.id for a in result.accepted] == ["holder"]  # a standby displaces nobody


def test_a_standby_refused_for_what_it_asks_is_refused_for_good() -> None:
    wrong = waiting(booking("wrong", template="no-such-template"))
    too_many = waiting(booking("many", gpus=3))
    result = run(wrong, too_many)
    assert {r.id: r.standby for r in result.rejected} == {"wrong": False, "many": False}


def test_when_the_gpus_free_up_the_earliest_standby_goes_first_and_no_later_request_overtakes_it() -> None:
    holder = booking("holder", indices=(0,))
    first = waiting(booking("first", user="bob", indices=(0,), created=utc(2026, 11, 21)))
    second = waiting(booking("second", user="bob", indices=(0,), created=utc(2026, 11, 1)))
    # A request made after both, its CREATED forged to 1970: client stamps never order standbys.
    later = booking("later", user="bob", indices=(0,), created=utc(1970, 1, 1))
    asked = {"first": utc(2026, 11, 22, 9), "second": utc(2026, 11, 22, 10), "later": utc(2026, 11, 23, 7)}
    held = run(holder, first, second, later, accepted={"holder": utc(2026, 11, 20)}, asked=asked)
    assert [a.booking.id for a in held.accepted] == ["holder"]
    assert {r.id for r in held.rejected if r.standby} == {"first", "second"}
    # The holder cancels: the next plan has room for one, and it is the standby that asked first.
    freed = run(first, second, later, asked=asked)
    assert [a.booking.id for a in freed.accepted] == ["first"]
    rejected = {r.id: r for r in freed.rejected}
    assert rejected["second"].standby and not rejected["later"].standby


def test_a_standby_over_its_quota_waits_and_runs_once_the_quota_has_room() -> None:
    mine = booking("mine", gpus=2)  # alice may hold 2 GPUs at once (booking_kit's config)
    more = waiting(booking("more", indices=(2,)))
    at = utc(2026, 11, 20)
    both = run(mine, more, accepted={"mine": at}, asked={"more": at}, inventory=(0, 1, 2))
    (rejection,) = both.rejected
    assert rejection.standby and rejection.reason.startswith(STANDBY), rejection.reason
    alone = run(more, asked={"more": at}, inventory=(0, 1, 2))
    assert [a.booking.id for a in alone.accepted] == ["more"]


def test_a_standby_is_written_tentative_and_its_block_says_it_waits() -> None:
    outcome = block.rejected(STANDBY + "the GPUs asked for are taken", standby=True)
    assert outcome.status == block.Status.STANDBY and outcome.answer == Answer.TENTATIVE
    assert outcome.lines == ("on standby, waiting for its GPUs to free up: the GPUs asked for are taken",)
    assert block.rejected("no such template").answer == Answer.DECLINED


@pytest.mark.parametrize("value", ["yes", "true", "on", "Y"])
def test_every_yes_reads_as_yes(value: str) -> None:
    found = _description("user: alice", f"standby: {value}")
    assert isinstance(found, Booking) and found.standby
    assert timedelta(0) < found.end - found.start
