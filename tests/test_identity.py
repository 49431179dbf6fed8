"""Who a booking is for (issue 9, finding 5): an ORGANIZER who is a known user books only for
themselves, and `[policy] identity = "organizer"` accepts nothing but a known ORGANIZER."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from booking_kit import make_config, raw, read, vcalendar, vevent

from gpubook.scheduler.config import ConfigError, PolicyConfig, parse
from gpubook.scheduler.core.bookings import Booking, Rejection

START, END = "DTSTART:20261124T090000Z", "DTEND:20261124T110000Z"
ORGANIZER_ONLY = replace(make_config(), policy=PolicyConfig(identity="organizer"))


def one(*lines: str, config: object = None) -> Booking | Rejection:
    result = read(raw(vcalendar(vevent("u1", START, END, *lines))), config=config)  # type: ignore[arg-type]
    assert result.problems == () and len(result.occurrences) == 1, result
    return result.occurrences[0]


def test_a_known_organizer_cannot_book_for_someone_else() -> None:
    """Hostile: alice (the ORGANIZER, a known user) wrote `user: carol`; before, carol was booked
    (her uid, her data folders, her quota) on alice's say-so."""
    for lines in (("DESCRIPTION:user: carol",), ("SUMMARY:carol debian-ssh gpus=1",)):
        refused = one("ORGANIZER:mailto:alice@lab.example", *lines)
        assert isinstance(refused, Rejection), refused
        assert refused.reason == (
            "the organizer alice@lab.example is alice, who may book only for themselves, but the booking "
            "names user 'carol'; remove that name or let carol book from their own account")
        assert refused.user == "alice"


def test_a_known_organizer_books_for_themselves() -> None:
    for lines in ((), ("DESCRIPTION:user: alice\\ngpus: 1",), ("SUMMARY:alice run",)):
        booking = one("ORGANIZER;CN=Alice:mailto:Alice@lab.example", *lines)
        assert isinstance(booking, Booking) and booking.user == "alice", booking


def test_organizer_policy_refuses_a_booking_without_a_known_organizer() -> None:
    """Hostile: with `[policy] identity = "organizer"`, a `user: alice` line from an event with no
    ORGANIZER, or with one who is nobody, is refused (before, both booked for alice)."""
    missing = one("DESCRIPTION:user: alice", config=ORGANIZER_ONLY)
    assert isinstance(missing, Rejection)
    assert missing.reason == ("the booking has no organizer; on this server a booking is for its organizer, "
                              "so book from your own calendar account")
    stranger = one("ORGANIZER:mailto:mallory@evil.example", "DESCRIPTION:user: alice", config=ORGANIZER_ONLY)
    assert isinstance(stranger, Rejection)
    assert stranger.reason == ("the organizer mallory@evil.example is not a known user; on this server a booking "
                               "is for its organizer: ask the admin to add this e-mail address to your user")
    own = one("ORGANIZER:mailto:bob@lab.example", config=ORGANIZER_ONLY)
    assert isinstance(own, Booking) and own.user == "bob"


def test_description_policy_keeps_booking_systems_that_fill_only_the_description() -> None:
    booking = one("DESCRIPTION:user: carol")
    assert isinstance(booking, Booking) and booking.user == "carol"
    relayed = one("ORGANIZER:mailto:rooms@lab.example", "DESCRIPTION:user: carol")
    assert isinstance(relayed, Booking) and relayed.user == "carol"


def _config(policy: object) -> dict[str, object]:
    return {"calendar": [{"url": "https://cal.example/lab/"}], "users": {"alice": {"uid": 2001}},
            "policy": policy}


def test_policy_identity_is_read_and_checked() -> None:
    assert parse(_config({}), Path("g.toml")).policy.identity == "description"
    assert parse(_config({"identity": "organizer"}), Path("g.toml")).policy.identity == "organizer"
    with pytest.raises(ConfigError) as wrong:
        parse(_config({"identity": "anyone", "identiy": 1}), Path("g.toml"))
    assert 'policy.identity: must be "description" or "organizer"' in str(wrong.value)
    assert "policy.identiy: unknown key; did you mean 'identity'?" in str(wrong.value)
