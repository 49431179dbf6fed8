"""The daemon's answers to `gpubook free`, `bookings` and `mine` (outbox/asking.py), from plain
statuses: who a host login is, the page's rule (own by name, others as busy time), the bounds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from gpubook.scheduler.core.plan import LOCAL
from gpubook.scheduler.outbox import asking
from gpubook.scheduler.outbox.status import GpuSummary, HostStatus, RunningBooking, Status
from gpubook.scheduler.outbox.timeline import GpuTimeline, RejectedBooking, Segment

NOW = datetime(2026, 11, 30, 8, tzinfo=UTC)
CONTEXT = asking.Context(host_name="devbox1", timezone="UTC", reach_ahead=timedelta(days=7))


def at(hours: float) -> str:
    return (NOW + timedelta(hours=hours)).isoformat()


def status() -> Status:
    alice = Segment(kind="running", booking="a@t", user="alice", start=at(-1), end=at(2), template="t",
                    title="alice run")
    bob = Segment(kind="booked", booking="b@t", user="bob", start=at(3), end=at(5), template="t", title="bob secret")
    host = HostStatus(name=LOCAL, gpus=GpuSummary(source="config", count=2),
                      running=(RunningBooking(booking="a@t", user="alice", gpus=(0,), state="running", port=2222,
                                              end=at(2), container="c"),),
                      timeline=(GpuTimeline(gpu=0, segments=(alice, bob)), GpuTimeline(gpu=1, segments=(bob,))))
    return Status(hosts=(host,), updated=NOW.isoformat(),
                  rejected=(RejectedBooking(id="r@t", user="bob", start=at(1), end=at(2), reason="bob's quota"),))


def test_a_login_is_the_users_whose_account_it_is_else_whose_name() -> None:
    users = {"alice": SimpleNamespace(login="ada"), "bob": SimpleNamespace(login="bob")}
    assert asking.viewer_of("ada", users).users == {"alice"}
    assert asking.viewer_of("alice", users).users == frozenset()
    assert asking.viewer_of("bob", users).users == {"bob"}
    assert asking.viewer_of(None, users) == asking.Viewer()


def test_bookings_name_the_viewers_own_and_show_the_others_as_busy_time() -> None:
    answer = asking.answer(status(), {"kind": "bookings"}, viewer=asking.Viewer(users=frozenset({"alice"})),
                           context=CONTEXT, now=NOW)
    own, other = answer["bookings"]
    assert (own["id"], own["title"], own["gpus"], own["state"]) == ("a@t", "alice run", [0], "running")
    assert other == {"own": False, "state": "busy", "host": "devbox1", "gpus": [0, 1], "start": at(3), "end": at(5)}
    assert "bob" not in str(answer) and answer["rejected"] == []


def test_mine_has_the_ssh_line_and_nobody_elses_refusal() -> None:
    alice = asking.answer(status(), {"kind": "mine"}, viewer=asking.Viewer(users=frozenset({"alice"})),
                          context=CONTEXT, now=NOW)
    assert [b["ssh"] for b in alice["bookings"]] == ["ssh -p 2222 alice@devbox1"] and alice["rejected"] == []
    bob = asking.answer(status(), {"kind": "mine"}, viewer=asking.Viewer(users=frozenset({"bob"})),
                        context=CONTEXT, now=NOW)
    assert [b["id"] for b in bob["bookings"]] == ["b@t"] and [r["reason"] for r in bob["rejected"]] == ["bob's quota"]
    assert "ssh" not in bob["bookings"][0] and "alice" not in str(bob["bookings"])


def test_free_names_nobody_and_finds_the_slot_after_the_bookings() -> None:
    answer = asking.answer(status(), {"kind": "free", "gpus": 2, "hours": 4}, viewer=asking.Viewer(),
                           context=CONTEXT, now=NOW)
    assert answer["slots"][0]["start"] == at(5) and answer["slots"][0]["placement"] == [["devbox1", [0, 1]]]
    assert "alice" not in str(answer) and "bob" not in str(answer)


def test_a_window_cut_to_what_the_daemon_reads_ahead_says_so() -> None:
    """Issue 41: `free --days 30` against a daemon that reads 7 days ahead showed 7 days, silently."""
    answer = asking.answer(status(), {"kind": "free", "days": 30}, viewer=asking.Viewer(), context=CONTEXT, now=NOW)
    assert answer["capped"] == "--days 30 reaches past what the daemon reads ahead (7 days): shown until then"
    assert datetime.fromisoformat(answer["until"]) == NOW + timedelta(days=7)
    within = asking.answer(status(), {"kind": "free", "days": 3}, viewer=asking.Viewer(), context=CONTEXT, now=NOW)
    assert "capped" not in within


def test_free_from_a_later_time_shows_that_time_on() -> None:
    """`gpubook free --from 'now+4h'`: the stretches and slots from then (GPU 0 busy with bob's booking
    until 5 h, GPU 1 too); a start past what the daemon reads ahead is one sentence."""
    answer = asking.answer(status(), {"kind": "free", "gpus": 1, "hours": 1, "from": at(4)}, viewer=asking.Viewer(),
                           context=CONTEXT, now=NOW)
    assert answer["from"] == at(4) and datetime.fromisoformat(answer["until"]) == NOW + timedelta(days=7)
    assert [g["free"][0][0] for g in answer["hosts"][0]["gpus"]] == [at(5), at(5)]
    assert answer["slots"][0]["start"] == at(5)
    before = asking.answer(status(), {"kind": "free", "from": at(-3)}, viewer=asking.Viewer(), context=CONTEXT,
                           now=NOW)
    assert before["from"] == NOW.isoformat()  # never before now
    with pytest.raises(asking.AskError, match="is past what gpubook reads ahead .7 days"):
        asking.answer(status(), {"kind": "free", "from": at(24 * 8)}, viewer=asking.Viewer(), context=CONTEXT, now=NOW)


def test_free_from_a_later_time_is_printed_from_then(capsys: pytest.CaptureFixture[str]) -> None:
    """The terminal's table of a daemon's `free --from` answer: headed with its start, each GPU's stretches
    from then on (busy at 3.5 h: bob's booking until 5 h), never "now"."""
    from gpubook.scheduler.commands.ask import print_free

    print_free(asking.answer(status(), {"kind": "free", "hours": 1, "from": at(3.5)}, viewer=asking.Viewer(),
                             context=CONTEXT, now=NOW))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Free GPUs of devbox1 from today 11:30, times in UTC"), lines
    assert lines[1:3] == ["  GPU 0  busy at today 11:30; free from today 13:00",
                          "  GPU 1  busy at today 11:30; free from today 13:00"], lines
    assert "now" not in "\n".join(lines[1:]), lines


@pytest.mark.parametrize("request_", [{"kind": "shell"}, {"kind": "free", "gpus": 0}, {"kind": "free", "hours": "4"},
                                      {"kind": "free", "days": 10_000}, {"kind": "bookings", "from": "yesterday"},
                                      {"kind": "bookings", "from": "2026-11-30T10:00"}])
def test_a_bad_request_is_one_sentence(request_: dict) -> None:
    with pytest.raises(asking.AskError):
        asking.answer(status(), request_, viewer=asking.Viewer(), context=CONTEXT, now=NOW)


def test_more_gpus_than_the_host_has_is_one_sentence() -> None:
    with pytest.raises(asking.AskError, match="--gpus 3: devbox1 has 2 GPUs per host at most; ask for 2 or fewer"):
        asking.answer(status(), {"kind": "free", "gpus": 3}, viewer=asking.Viewer(), context=CONTEXT, now=NOW)


def test_before_the_first_pass_the_answer_says_so() -> None:
    with pytest.raises(asking.AskError, match="first pass"):
        asking.answer(None, {"kind": "mine"}, viewer=asking.Viewer(), context=CONTEXT, now=NOW)


def test_mine_shows_each_bookings_project(capsys: pytest.CaptureFixture[str]) -> None:
    """The project travels from the plan's segment to `gpubook mine`'s answer and its printed row."""
    from dataclasses import replace

    from gpubook.scheduler.commands.ask import print_mine

    base = status()
    host = base.hosts[0]
    lanes = tuple(replace(lane, segments=tuple(replace(s, project="vision") if s.user == "bob" else s
                                               for s in lane.segments)) for lane in host.timeline)
    with_project = replace(base, hosts=(replace(host, timeline=lanes),))
    bob = asking.answer(with_project, {"kind": "mine"}, viewer=asking.Viewer(users=frozenset({"bob"})),
                        context=CONTEXT, now=NOW)
    assert [b["project"] for b in bob["bookings"]] == ["vision"]
    print_mine(bob)
    assert "bob secret  project vision  [booked]" in capsys.readouterr().out
    alice = asking.answer(with_project, {"kind": "mine"}, viewer=asking.Viewer(users=frozenset({"alice"})),
                          context=CONTEXT, now=NOW)
    assert [b["project"] for b in alice["bookings"]] == [None]  # counted against no group
