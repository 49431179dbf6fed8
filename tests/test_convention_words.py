"""The booking convention's words (issue 37): understood, or refused by name, never silently defaulted.

A table of booking texts as bookers write them (phones' capitals, Outlook's and Google's HTML, typos,
ranges, locations on hosts named gpuN, titles, comments, equals signs), each read through the
booking reader: either exactly the request the booker meant, or a refusal whose sentence names the
word. Then `1,` read alike in the title and the description, the reference page printed from the
parser, and every booking gpubook itself writes (the guide's examples, the demo, the availability
feed's events) read back as itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from datetime import UTC, datetime, timedelta
from pathlib import Path

import icalendar
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gpubook.scheduler.commands.demo import demo_events
from gpubook.scheduler.config import Config, parse
from gpubook.scheduler.core.bookings import Booking, BookingReader, Rejection
from gpubook.scheduler.core.convention import Request
from gpubook.scheduler.core.free import Block
from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.core.topology import CLUSTER, ONE_MACHINE, Topology
from gpubook.scheduler.outbox.free_feed import feed
from tests.kits.booking_kit import CALENDAR, TEMPLATES, WINDOW, make_config, raw

ROOT = Path(__file__).resolve().parents[1]
START = datetime(2026, 11, 24, 9, tzinfo=UTC)


@dataclasses.dataclass(frozen=True)
class Words:
    """A refusal whose sentence holds each of these words."""

    words: tuple[str, ...]


def ok(user: str, template: str = "debian-ssh", gpus: int = 1, indices: tuple[int, ...] | None = None,
       nodes: int | None = None) -> Request:
    return Request(user=user, template=template, gpu_count=len(indices) if indices else gpus, gpu_indices=indices,
                   nodes=nodes)


def refused(*words: str) -> Words:
    return Words(words)


def event(*, summary: str = "", description: str | None = None, html: str | None = None, location: str = "",
          organizer: str = "") -> str:
    """One event as a calendar program writes it; `html`: Outlook's X-ALT-DESC beside an empty DESCRIPTION."""
    one = icalendar.Event()
    one.add("uid", "u1")
    one.add("dtstamp", START)
    one.add("dtstart", START)
    one.add("dtend", START + timedelta(hours=2))
    if summary:
        one.add("summary", summary)
    if description is not None:
        one.add("description", description)
    if html is not None:
        one.add("description", "")
        one.add("x-alt-desc", html, parameters={"FMTTYPE": "text/html"})
    if location:
        one.add("location", location)
    if organizer:
        one.add("organizer", f"mailto:{organizer}")
    calendar = icalendar.Calendar()
    calendar.add("prodid", "-//gpubook tests//EN")
    calendar.add("version", "2.0")
    calendar.add_component(one)
    return calendar.to_ical().decode()


def on_host(config: Config, host: str) -> Config:
    return dataclasses.replace(config, host=dataclasses.replace(config.host, name=host))


def occurrence(ical: str, *, config: Config, templates: frozenset[str] = TEMPLATES,
               topology: Topology = ONE_MACHINE) -> Booking | Rejection:
    calendar = next(c for c in config.calendars if c.url == CALENDAR)
    found = BookingReader().read([raw(ical)], config=config, calendar=calendar, templates=templates,
                                 window_start=WINDOW[0], window_end=WINDOW[1], topology=topology)
    assert not found.problems and len(found.occurrences) == 1, found
    return found.occurrences[0]


def asked(one: Booking | Rejection) -> Request | str:
    if isinstance(one, Rejection):
        return one.reason
    return Request(user=one.user, template=one.template, gpu_count=one.gpu_count, gpu_indices=one.gpu_indices,
                   nodes=one.nodes)


# (what the booker wrote, what gpubook must read); the kit's users are alice, bob and carol, its
# templates debian-ssh (the default), tensorflow-cuda9 and digits-cuda8, its default one GPU.
ROWS = [
    # Phones: autocorrect's capitals, a blank before the colon.
    ("phone capitals", dict(description="User: Alice\nGpus: 2"), ok("alice", gpus=2)),
    ("phone template", dict(description="User: Alice\nTemplate: Tensorflow-cuda9\nGpus: 1"),
     ok("alice", "tensorflow-cuda9")),
    ("phone shouting", dict(description="USER: BOB\nGPU: 0,1"), ok("bob", indices=(0, 1))),
    ("plural and singular", dict(description="Users: carol\nTemplates: debian-ssh\nNode: 1"),
     ok("carol", nodes=1)),
    ("blank before colon", dict(description="user : alice\ngpus : 2"), ok("alice", gpus=2)),
    ("phone title", dict(summary="Alice Tensorflow-CUDA9 gpus=2"), ok("alice", "tensorflow-cuda9", gpus=2)),
    ("phone title colon", dict(summary="Bob Gpus: 2"), ok("bob", gpus=2)),
    # Equals signs.
    ("equals", dict(description="user=alice\ngpus=2"), ok("alice", gpus=2)),
    ("equals with blanks", dict(description="user = bob\ntemplate = digits-cuda8\ngpu = 1,"),
     ok("bob", "digits-cuda8", indices=(1,))),
    ("title keys", dict(summary="user=alice template=digits-cuda8 gpus=0,1"),
     ok("alice", "digits-cuda8", indices=(0, 1))),
    # Comments.
    ("comments", dict(description="user: alice # me\ngpus: 2 # both"), ok("alice", gpus=2)),
    ("comment after a range", dict(description="user: bob\ngpus: 0-1 # the two A100s\n"
                                               "template: digits-cuda8 # old CUDA"),
     ok("bob", "digits-cuda8", indices=(0, 1))),
    ("hash is no comment without a blank", dict(description="user: alice\ngpus: #2"),
     refused("gpus: '#2'", "neither a number of GPUs")),
    # Counts, lists and ranges.
    ("count", dict(description="user: alice\ngpus: 2"), ok("alice", gpus=2)),
    ("one named GPU", dict(description="user: alice\ngpus: 2,"), ok("alice", indices=(2,))),
    ("range", dict(description="user: alice\ngpus: 0-1"), ok("alice", indices=(0, 1))),
    ("range and index", dict(description="user: alice\ngpus: 0-2,5"), ok("alice", indices=(0, 1, 2, 5))),
    ("unsorted", dict(description="user: alice\ngpus: 5, 0-2"), ok("alice", indices=(0, 1, 2, 5))),
    ("range with blanks", dict(description="user: alice\ngpus: 0 - 3"), ok("alice", indices=(0, 1, 2, 3))),
    ("backwards range", dict(description="user: alice\ngpus: 3-1"), refused("'3-1'", "runs backwards", "1-3")),
    ("range overlaps", dict(description="user: alice\ngpus: 0-2,2"), refused("names GPU 2 twice")),
    ("no GPU", dict(description="user: alice\ngpus: 0"), refused("gpus: 0 asks for no GPU")),
    ("words for GPUs", dict(description="user: alice\nGPU: A100 please"),
     refused("gpus: 'A100 please' is neither a number of GPUs")),
    # Titles.
    ("short form", dict(summary="alice tensorflow-cuda9 gpus=2 big run"), ok("alice", "tensorflow-cuda9", gpus=2)),
    ("title names one GPU", dict(summary="alice gpus=1,"), ok("alice", indices=(1,))),
    ("title list goes on over a blank", dict(summary="alice gpus=0, 2 sweep"), ok("alice", indices=(0, 2))),
    ("title in brackets", dict(summary="(bob gpus=2)"), ok("bob", gpus=2)),
    ("title typo", dict(summary="alice gpsu=2"), refused("`gpsu=`", "did you mean `gpus=`?")),
    ("title two users", dict(summary="alice and bob"), refused("more than one user")),
    ("title with a colon after the name", dict(summary="alice: fine-tune"), ok("alice")),
    ("title key after a colon", dict(summary="alice:gpus=2"), ok("alice", gpus=2)),
    ("title bad count", dict(summary="alice Gpus=all"), refused("gpus= 'all' is neither")),
    ("description wins", dict(summary="alice gpus=2", description="gpus: 0-1"), ok("alice", indices=(0, 1))),
    # Misspelt keys and names.
    ("template typo", dict(description="user: alice\ntempalte: digits-cuda8"),
     refused("`tempalte:`", "did you mean `template:`?")),
    ("gpus typo", dict(description="user: alice\ngpsu: 2"), refused("`gpsu:`", "did you mean `gpus:`?")),
    ("user typo", dict(description="usr: bob"), refused("`usr:`", "did you mean `user:`?")),
    ("nodes typo", dict(description="user: alice\nnodse: 2"), refused("`nodse:`", "did you mean `nodes:`?")),
    ("CPUs are not booked", dict(description="user: alice\ncpus: 8"), refused("`cpus:`", "did you mean `gpus:`?")),
    ("user name typo", dict(description="user: Alcie"), refused("there is no user 'Alcie'", "did you mean alice?")),
    ("template name typo", dict(description="user: alice\ntemplate: tensorflow-cuda8"),
     refused("there is no template 'tensorflow-cuda8'", "did you mean tensorflow-cuda9?")),
    ("look-alike letter", dict(description="user: \u0430lice"),
     refused("'\\u0430lice' is not a valid user name", "did you mean alice?")),
    ("full-width letter", dict(description="user: \uff41lice"), refused("'\\uff41lice' is not a valid user name")),
    ("two gpus lines", dict(description="user: bob\ngpu: 1\ngpus: 2"), refused("more than one `gpus:` line")),
    ("one gpus line twice", dict(description="user: bob\ngpu: 2\nGPUS: 2"), ok("bob", gpus=2)),
    # The booker's own text stays theirs.
    ("notes and links", dict(description="user: alice\nnote: rerun with lr 0.1\nproject: x\n"
                                         "Goal: train the model\nSee https://wiki.lab.example/gpus:howto\ngpus: 2"),
     ok("alice", gpus=2)),
    ("prose with a colon", dict(description="Note: the GPUs are slow on Mondays\nuser: bob"), ok("bob")),
    # Outlook's X-ALT-DESC and Google's HTML.
    ("outlook html", dict(html="<html><body><p>User:&nbsp;Alice<br>Gpus:&nbsp;2</p></body></html>"),
     ok("alice", gpus=2)),
    ("google html", dict(description="user: bob<br>gpus: 0-1<br>&nbsp;"), ok("bob", indices=(0, 1))),
    ("outlook bold key", dict(html="<p><b>template</b>: digits-cuda8</p><p>user: alice</p>"),
     ok("alice", "digits-cuda8")),
    ("outlook typo", dict(html="<div>tempalte:&nbsp;digits-cuda8</div><div>user: alice</div>"),
     refused("`tempalte:`", "did you mean `template:`?")),
    # Locations, as booking systems and gpubook's availability feed write them.
    ("host gpu1, GPU 1", dict(summary="alice", location="gpu1 GPU 1", host="gpu1"), ok("alice", indices=(1,))),
    ("host gpu1, GPUs 0,1", dict(summary="alice", location="gpu1 GPU 0,1", host="gpu1"),
     ok("alice", indices=(0, 1))),
    ("host gpu-node-3", dict(summary="alice", location="gpu-node-3 GPU 0,1", host="gpu-node-3"),
     ok("alice", indices=(0, 1))),
    ("location range", dict(summary="alice", location="devbox1 GPUs 0-2"), ok("alice", indices=(0, 1, 2))),
    ("location glued", dict(summary="alice", location="GPU0,GPU2"), ok("alice", indices=(0, 2))),
    ("another host's name", dict(summary="alice", location="gpu1 GPU 1"),
     refused("the location 'gpu1 GPU 1' names GPU 1 twice")),
    ("room", dict(summary="alice", location="Room 101"), ok("alice")),
]


@pytest.mark.parametrize(("written", "meant"), [pytest.param(w, m, id=i) for i, w, m in ROWS])
def test_every_booking_text_is_understood_or_refused_by_name(written: dict[str, str], meant: Request | Words) -> None:
    written = dict(written)
    config = on_host(make_config(), written.pop("host", "devbox1"))
    got = asked(occurrence(event(**written), config=config))
    if isinstance(meant, Words):
        assert isinstance(got, str), f"accepted as {got}, but it should be refused"
        for word in meant.words:
            assert word in got, got
    else:
        assert got == meant


def test_the_table_is_wide() -> None:
    assert len(ROWS) >= 40 and len({i for i, _, _ in ROWS}) == len(ROWS)


def test_a_misspelt_key_is_refused_for_the_booker_the_organizer_names() -> None:
    """The organizer decides the booker; the typo is then the reason (a notice goes to them)."""
    one = occurrence(event(description="usr: bob\ntemplate: digits-cuda8", organizer="alice@lab.example"),
                     config=make_config())
    assert isinstance(one, Rejection) and one.user == "alice" and "did you mean `user:`?" in one.reason


def test_nodes_in_any_spelling_on_a_cluster() -> None:
    one = occurrence(event(description="User: Bob\nGPUs: 16\nNode = 2"), config=make_config(), topology=CLUSTER)
    assert asked(one) == ok("bob", gpus=16, nodes=2)


def test_only_words_that_may_be_close_to_a_key_are_matched_at_all() -> None:
    """A line of a longer or shorter word costs one failed match: none of them can be close."""
    import difflib

    from gpubook.scheduler.core.convention import _LONGEST, _SHORTEST, _SPELLINGS, CLOSE

    for spelling in _SPELLINGS:
        longer = spelling + "x" * (_LONGEST + 1 - len(spelling))
        assert difflib.SequenceMatcher(None, longer, spelling).ratio() < CLOSE
        assert all(difflib.SequenceMatcher(None, spelling[:_SHORTEST - 1], s).ratio() < CLOSE for s in _SPELLINGS)
    longest = max(_SPELLINGS, key=len)
    assert difflib.SequenceMatcher(None, longest + "x" * (_LONGEST - len(longest)), longest).ratio() >= CLOSE


def test_a_description_full_of_other_words_names_a_typo_among_its_first_ones_only() -> None:
    """Guesses are bounded (MAX_GUESSES), so a hostile description of them costs what it did before."""
    from gpubook.scheduler.core.convention import MAX_GUESSES

    others = "".join(f"{chr(97 + i // 26)}{chr(97 + i % 26)}q: x\n" for i in range(MAX_GUESSES - 1))
    config = make_config()
    named = asked(occurrence(event(description=f"user: bob\n{others}tempalte: x"), config=config))
    assert "did you mean `template:`?" in str(named)
    late = asked(occurrence(event(description=f"user: bob\n{others}zzq: x\ntempalte: x"), config=config))
    assert late == ok("bob")


@pytest.mark.parametrize("number", [0, 1, 3, 12])
@pytest.mark.parametrize("after", ["", " tensorflow-cuda9", " run"])
def test_one_number_and_a_comma_reads_alike_in_the_title_and_the_description(number: int, after: str) -> None:
    """`N,` is GPU N alone wherever it is written (the module docstring says why)."""
    config = make_config()
    titled = asked(occurrence(event(summary=f"alice gpus={number},{after}"), config=config))
    described = asked(occurrence(event(summary=f"alice{after}", description=f"gpus: {number},"), config=config))
    assert titled == described
    assert isinstance(titled, Request) and titled.gpu_indices == (number,)


# --- the reference page ---------------------------------------------------------------------


def _reference():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("convention_reference", ROOT / "tools" / "convention_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_booking_convention_reference_is_generated_from_the_parser() -> None:
    page = ROOT / "docs" / "reference" / "booking-convention.md"
    assert page.read_text() == _reference().render(), \
        "docs/reference/booking-convention.md is stale: run python tools/convention_reference.py --write"


def test_the_reference_lists_every_key_and_the_guide_links_it() -> None:
    from gpubook.scheduler.core.convention import KEYS

    text = _reference().render()
    for key in KEYS:
        assert f"| `{key.name}` |" in text
    assert "refused: " in text and "did you mean" in text
    assert "(../reference/booking-convention.md)" in (ROOT / "docs" / "guides" / "booking.md").read_text()


# --- what gpubook writes reads back as itself --------------------------------------------------


def test_the_guides_examples_read_as_the_guide_says() -> None:
    guide = (ROOT / "docs" / "guides" / "booking.md").read_text()
    described = guide.split("### In the description", 1)[1].split("```", 2)[1]
    assert described.strip() == "user: alice\ntemplate: tensorflow-cuda9\ngpus: 2"
    config = make_config()
    assert asked(occurrence(event(description=described), config=config)) == ok("alice", "tensorflow-cuda9", gpus=2)
    assert asked(occurrence(event(summary="alice tensorflow-cuda9 gpus=2"), config=config)) == \
        ok("alice", "tensorflow-cuda9", gpus=2)
    assert asked(occurrence(event(summary="alice fine-tuning run gpus=1"), config=config)) == ok("alice")
    located = guide.split("### In the location", 1)[1].split("###", 1)[0]
    for location, indices in [("gpu 1", (1,)), ("GPU0,GPU2", (0, 2)), ("devbox1 GPUs 0, 2", (0, 2)),
                              ("GPUs 0-3", (0, 1, 2, 3))]:
        assert f"`{location}`" in located
        assert asked(occurrence(event(summary="alice", location=location), config=config)) == \
            ok("alice", indices=indices)


def test_the_demos_bookings_read_as_the_demo_means_them() -> None:
    now = datetime(2026, 11, 23, 12, tzinfo=UTC)
    config = make_config()
    read = {}
    for text in demo_events(now, "alice"):
        one = occurrence(text, config=config)
        read[one.uid] = asked(one)
    assert read["demo-now@gpubook"] == ok("alice")
    assert read["demo-weekly@gpubook"] == ok("alice", gpus=2)
    assert read["demo-clash@gpubook"] == ok("bob", indices=(0, 1))
    assert read["demo-long@gpubook"] == ok("bob")
    assert str(read["demo-stranger@gpubook"]).startswith("mallory@elsewhere.example is not a known user")


NAME = st.from_regex(r"[a-z][a-z0-9_-]{0,11}", fullmatch=True)
TEMPLATE = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,15}", fullmatch=True)
HOST = st.one_of(st.sampled_from(["gpu1", "GPU0", "gpu-node-3", "gpus2", "devbox1", "gpu", "node7.lab.example"]),
                 st.from_regex(r"[A-Za-z0-9][A-Za-z0-9.-]{0,15}", fullmatch=True))
GPUS = st.sets(st.integers(min_value=0, max_value=15), min_size=1, max_size=8).map(lambda s: tuple(sorted(s)))
# Words the availability feed's own title holds: a user or template of that name would be read in it.
FEED_WORDS = {"busy", "gpu", "gpus"}


def config_for(users: list[str], host: str) -> Config:
    return parse({
        "host": {"name": host, "timezone": "Europe/Paris"},
        "calendar": [{"url": CALENDAR, "gpus": "all"}],
        "defaults": {"template": "debian-ssh", "gpus": 1, "max_hours": 72, "warn_minutes": 15},
        "users": {name: {"uid": 2000 + i} for i, name in enumerate(users)},
    }, Path("/etc/gpubook/gpubook.toml"))


def spelled(indices: tuple[int, ...], ranges: bool) -> str:
    """GPU indices as a booker writes them: `0,2`, `1,` for one, `0-3,5` with ranges."""
    if len(indices) == 1:
        return f"{indices[0]},"
    if not ranges:
        return ",".join(map(str, indices))
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(users=st.lists(NAME, min_size=1, max_size=3, unique=True), template=TEMPLATE,
       gpus=st.one_of(st.integers(min_value=1, max_value=16), GPUS), ranges=st.booleans(),
       form=st.sampled_from(["plain", "google html", "outlook html", "title"]), data=st.data())
@pytest.mark.slow  # a second or more: out of the fast lane
def test_a_booking_written_the_way_the_guide_shows_reads_back_as_itself(
        users: list[str], template: str, gpus: int | tuple[int, ...], ranges: bool, form: str,
        data: st.DataObject) -> None:
    user = data.draw(st.sampled_from(users))
    assume(template not in users and template != "debian-ssh")
    value = str(gpus) if isinstance(gpus, int) else spelled(gpus, ranges)
    lines = [f"user: {user}", f"template: {template}", f"gpus: {value}"]
    written = {"plain": dict(description="\n".join(lines)),
               "google html": dict(description="<br>".join(lines)),
               "outlook html": dict(html="<html><body>" + "".join(f"<p>{line}</p>" for line in lines)
                                    + "</body></html>"),
               "title": dict(summary=f"{user} {template} gpus={value}")}[form]
    one = occurrence(event(**written), config=config_for(users, "devbox1"),
                     templates=frozenset({"debian-ssh", template}))
    expected = ok(user, template, gpus=gpus) if isinstance(gpus, int) else ok(user, template, indices=gpus)
    assert asked(one) == expected


@pytest.mark.slow  # a second or more: out of the fast lane
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(users=st.lists(NAME, min_size=1, max_size=3, unique=True), host=HOST, gpus=GPUS, data=st.data())
def test_the_availability_feeds_event_reads_back_as_the_booking_it_shows(
        users: list[str], host: str, gpus: tuple[int, ...], data: st.DataObject) -> None:
    """free.ics writes `HOST GPU 0,1` as the location and `busy: GPU 0,1 (alice)` for alice: read
    as a booking, it is alice's on those GPUs, whatever the host is called (gpu1, gpu-node-3)."""
    assume(not FEED_WORDS & set(users))
    user = data.draw(st.sampled_from(users))
    block = Block(host=LOCAL, gpus=gpus, start=START, end=START + timedelta(hours=2), booking="b1", user=user)
    written = feed([block], host_name=host, viewer=user, now=START).decode()
    one = occurrence(written, config=config_for(users, host))
    assert asked(one) == ok(user, indices=gpus)
