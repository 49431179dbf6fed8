"""Who a booking is for (issue 9, finding 5): an ORGANIZER who is a known user books only for
themselves, and `[policy] identity = "organizer"` accepts nothing but a known ORGANIZER."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpubook.scheduler.config import ConfigError, PolicyConfig, parse
from gpubook.scheduler.core.bookings import Booking, Rejection
from tests.kits.booking_kit import make_config, raw, read, vcalendar, vevent

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


# --- per-user calendars: an identity the calendar server vouches for (issue 22, finding 7) ---------

MALLORYS = "http://127.0.0.1:5232/mallory/gpus/"


def owned_config(policy: object = None) -> object:
    return parse({"host": {"name": "devbox1", "timezone": "UTC"},
                  "calendar": [{"url": MALLORYS, "user": "mallory"}],
                  "users": {"alice": {"uid": 2001, "email": ["alice@lab.example"]}, "mallory": {"uid": 2002}},
                  "policy": policy or {}}, Path("g.toml"))


def in_mallorys(*lines: str, config: object = None) -> Booking | Rejection:
    result = read(raw(vcalendar(vevent("m1", START, END, *lines)), calendar_url=MALLORYS),
                  config=config or owned_config(), calendar_url=MALLORYS)  # type: ignore[arg-type]
    assert result.problems == () and len(result.occurrences) == 1, result
    return result.occurrences[0]


def test_a_per_user_calendar_books_for_its_owner_only() -> None:
    """Hostile: mallory writes into her own calendar an event that names alice (a `user:` line, the
    title's short form, alice's ORGANIZER address); before, the default identity booked alice (her
    quota, her reminder mail with mallory's title, her no-show). Now each is refused, for mallory."""
    for lines in (("DESCRIPTION:user: alice",), ("SUMMARY:alice debian-ssh gpus=1",)):
        refused = in_mallorys(*lines)
        assert isinstance(refused, Rejection), refused
        assert refused.reason == ("this calendar books for mallory only, but the booking names user 'alice'; "
                                  "remove that name, or let alice book in their own calendar")
        assert refused.user == "mallory"
    spoofed = in_mallorys("ORGANIZER:mailto:alice@lab.example", "DESCRIPTION:gpus: 1")
    assert isinstance(spoofed, Rejection) and spoofed.reason == (
        "this calendar books for mallory only, but the booking's organizer alice@lab.example is alice; "
        "let alice book in their own calendar")
    for lines in ((), ("DESCRIPTION:user: mallory",), ("SUMMARY:a run",), ("ORGANIZER:mailto:m@else.example",)):
        own = in_mallorys(*lines)
        assert isinstance(own, Booking) and own.user == "mallory", own
    # [policy] identity = "organizer" does not undo it: the calendar's owner is who the server let write
    own = in_mallorys(config=owned_config({"identity": "organizer"}))
    assert isinstance(own, Booking) and own.user == "mallory"


def test_a_calendar_user_must_be_a_known_user() -> None:
    base = {"calendar": [{"url": "https://cal.example/x/", "user": "zed"}], "users": {"alice": {"uid": 2001}}}
    with pytest.raises(ConfigError, match=r"calendar\[0\]\.user: 'zed' is not a user of \[users\]"):
        parse(base, Path("g.toml"))
    with pytest.raises(ConfigError, match=r"calendar\[0\]\.user"):
        parse({**base, "calendar": [{"url": "https://cal.example/x/", "user": "Bad Name"}]}, Path("g.toml"))
    assert parse({**base, "calendar": [{"url": "https://cal.example/x/", "user": "alice"}]},
                 Path("g.toml")).calendars[0].user == "alice"


def test_doctor_warns_when_a_shared_calendar_relies_on_description_identity() -> None:
    from gpubook.scheduler.commands import doctor

    shared = doctor.identity_check(make_config())
    assert not shared.ok and shared.optional
    assert "anyone who can write it can book as any user" in shared.detail
    assert shared.fix is not None and "[[calendar]] user = \"NAME\"" in shared.fix
    assert doctor.identity_check(owned_config()).ok  # type: ignore[arg-type]
    assert doctor.identity_check(ORGANIZER_ONLY).ok
