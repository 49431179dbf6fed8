"""`gpubook report` over a month of generated bookings, written through State's accounting methods
as the passes and the sampler write them; every figure checked against hand-computed values.

The month (November 2026, UTC), host devbox1 with GPUs 0-3, samples every 600 s:

| booking | user  | template   | GPUs    | time                       | in window | util        | login |
| a1      | alice | debian-ssh | 0,1     | 11-02 09:00 - 17:00        | 8 h x 2   | 50 %, 0 %   | yes   |
| a2      | alice | pytorch    | 2       | 11-10 00:00 - 11-11 00:00  | 24 h      | 25 %        | no    |
| b1      | bob   | debian-ssh | 3       | 10-31 12:00 - 11-01 12:00  | 12 h      | 100 %       | yes   |
| b2      | bob   | pytorch    | 0,1,2,3 | 11-30 20:00 - 12-01 04:00  | 4 h x 4   | 10 %        | no    |
| c1      | carol | debian-ssh | 1       | 11-16 10:00 - 12:00        | 2 h       | 75 %        | yes   |
| z1      | alice | debian-ssh | 0       | 12-02 10:00 - 12:00        | none      |             |       |

booked: alice 16 + 24 = 40, bob 12 + 16 = 28, carol 2 (70). used: alice 48 x 600 s x 0.5 = 4 h +
144 x 600 s x 0.25 = 6 h -> 10; bob 72 x 600 s x 1.0 = 12 h (the 72 samples of October 31 are
outside) + 24 x 4 x 600 s x 0.1 = 1.6 h -> 13.6; carol 12 x 600 s x 0.75 = 1.5 (25.1). No-shows:
a2 (b2 ends after the window). Rejected: two "GPU N is not present", one unknown user (a fourth is
in December).
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.scheduler.commands import cli
from gpubook.scheduler.commands import report as report_command
from gpubook.scheduler.outbox import report
from gpubook.scheduler.state import BookedRow, RejectedRow, Sample, State

ROOT = Path(__file__).resolve().parents[1]
START, END = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)
NOW = datetime(2026, 12, 5, tzinfo=UTC)
STEP = 600.0


def at(month: int, day: int, hour: int = 0) -> datetime:
    return datetime(2026, month, day, hour, tzinfo=UTC)


BOOKINGS = (
    BookedRow(booking_id="a1", user="alice", template="debian-ssh", host="devbox1", gpus=(0, 1),
              start=at(11, 2, 9), end=at(11, 2, 17)),
    BookedRow(booking_id="a2", user="alice", template="pytorch", host="devbox1", gpus=(2,),
              start=at(11, 10), end=at(11, 11)),
    BookedRow(booking_id="b1", user="bob", template="debian-ssh", host="devbox1", gpus=(3,),
              start=at(10, 31, 12), end=at(11, 1, 12)),
    BookedRow(booking_id="b2", user="bob", template="pytorch", host="devbox1", gpus=(0, 1, 2, 3),
              start=at(11, 30, 20), end=at(12, 1, 4)),
    BookedRow(booking_id="c1", user="carol", template="debian-ssh", host="devbox1", gpus=(1,),
              start=at(11, 16, 10), end=at(11, 16, 12)),
    BookedRow(booking_id="z1", user="alice", template="debian-ssh", host="devbox1", gpus=(0,),
              start=at(12, 2, 10), end=at(12, 2, 12)),
)
REJECTIONS = (
    RejectedRow(booking_id="r1", user="bob", reason="GPU 3 is not present on devbox1 (0, 1, 2)",
                start=at(11, 5, 9), end=at(11, 5, 10)),
    RejectedRow(booking_id="r2", user="carol", reason="GPU 2 is not present on devbox1 (0 and 1)",
                start=at(11, 20, 9), end=at(11, 20, 10)),
    RejectedRow(booking_id="r3", user="dave", reason="'dave' is not a known user of devbox1",
                start=at(11, 21, 9), end=at(11, 21, 10)),
    RejectedRow(booking_id="r4", user="alice", reason="'alice' may not use template 'x' (allowed: debian-*)",
                start=at(12, 3, 9), end=at(12, 3, 10)),
)
UTILISATION = {("a1", 0): 50.0, ("a1", 1): 0.0, ("a2", 2): 25.0, ("b1", 3): 100.0, ("b2", 0): 10.0, ("b2", 1): 10.0,
               ("b2", 2): 10.0, ("b2", 3): 10.0, ("c1", 1): 75.0}


def samples_of(booking: BookedRow) -> list[list[Sample]]:
    """Rounds every STEP seconds over the booking's time, a sample per GPU, as the sampler writes them."""
    rounds, moment = [], booking.start
    while moment < booking.end:
        rounds.append([Sample(at=moment, host="devbox1", gpu=gpu, booking_id=booking.booking_id,
                              utilisation=UTILISATION[(booking.booking_id, gpu)], memory_used_mib=1024,
                              memory_total_mib=81920, seconds=STEP) for gpu in booking.gpus])
        moment += timedelta(seconds=STEP)
    return rounds


@pytest.fixture
def month(tmp_path: Path) -> Path:
    """The state database of the month, written through the accounting methods."""
    path = tmp_path / "state" / "state.sqlite"
    with State(path) as state:
        # A pass before a1 moved: its row is updated, not doubled; a cancelled future booking goes.
        moved = replace(BOOKINGS[0], end=at(11, 2, 20))
        cancelled = BookedRow(booking_id="gone", user="alice", template="pytorch", host="devbox1", gpus=(0,),
                              start=at(11, 3), end=at(11, 4))
        state.record_bookings(accepted=[moved, cancelled], rejected=[], now=at(11, 1), complete=True)
        state.record_bookings(accepted=BOOKINGS[:1], rejected=[], now=at(11, 2), complete=True)
        # Later passes see the rest (a pass of an incomplete reading forgets nothing).
        state.record_bookings(accepted=BOOKINGS, rejected=REJECTIONS, now=at(10, 31), complete=False)
        for booking in BOOKINGS[:5]:
            for one_round in samples_of(booking):
                state.record_samples(one_round)
        idle = [Sample(at=at(11, 20, 8) + timedelta(seconds=STEP * n), host="devbox1", gpu=0, booking_id=None,
                       utilisation=90.0, memory_used_mib=0, memory_total_mib=81920, seconds=STEP) for n in range(6)]
        state.record_samples(idle)
        for booking_id, user, moment in (("a1", "alice", at(11, 2, 9)), ("b1", "bob", at(10, 31, 13)),
                                         ("c1", "carol", at(11, 16, 11))):
            state.record_login(booking_id, user=user, at=moment)
        state.record_login("a1", user="alice", at=at(11, 2, 15))  # a later login changes nothing
    return path


def rows(result: report.Report) -> dict[str, report.Row]:
    return {row.key: row for row in result.rows}


def test_by_user_matches_the_hand_computed_figures(month: Path) -> None:
    with State(month) as state:
        assert state.logins()["a1"] == at(11, 2, 9)
        assert "gone" not in {b.booking_id for b in state.booked_between(START, END)}
        result = report.build(state, start=START, end=END, now=NOW, by="user")
    by = rows(result)
    assert list(by) == ["alice", "bob", "carol", "dave"]
    alice, bob, carol, dave = by["alice"], by["bob"], by["carol"], by["dave"]
    assert (alice.bookings, alice.booked_hours, alice.no_shows, alice.rejected) == (2, 40.0, 1, 0)
    assert alice.used_hours == pytest.approx(10.0) and alice.idle_share == pytest.approx(0.75)
    assert (bob.bookings, bob.booked_hours, bob.no_shows, bob.rejected) == (2, 28.0, 0, 1)
    assert bob.used_hours == pytest.approx(13.6) and bob.idle_share == pytest.approx(1 - 13.6 / 28)
    assert (carol.bookings, carol.booked_hours, carol.no_shows, carol.rejected) == (1, 2.0, 0, 1)
    assert carol.used_hours == pytest.approx(1.5) and carol.idle_share == pytest.approx(0.25)
    assert (dave.bookings, dave.booked_hours, dave.used_hours, dave.idle_share, dave.rejected) == (0, 0, 0, None, 1)
    total = result.total
    assert (total.bookings, total.booked_hours, total.no_shows, total.rejected) == (5, 70.0, 1, 3)
    assert total.used_hours == pytest.approx(25.1) and total.idle_share == pytest.approx(1 - 25.1 / 70)
    assert result.rejections == (("GPU N is not present on devbox1", 2), ("… is not a known user of devbox1", 1))
    assert result.weeks == tuple(START + timedelta(days=7 * n) for n in range(5))
    assert result.weekly_booked == {"alice": (16.0, 24.0, 0.0, 0.0, 0.0), "bob": (12.0, 0.0, 0.0, 0.0, 16.0),
                                    "carol": (0.0, 0.0, 2.0, 0.0, 0.0)}
    assert result.weekly_used == {user: pytest.approx(values) for user, values in {
        "alice": (4.0, 6.0, 0, 0, 0), "bob": (12.0, 0, 0, 0, 1.6), "carol": (0, 0, 1.5, 0, 0)}.items()}
    gpu0, gpu3 = result.daily_utilisation["devbox1:0"], result.daily_utilisation["devbox1:3"]
    assert gpu0[1] == pytest.approx(50.0) and gpu0[19] == pytest.approx(90.0) and gpu0[29] == pytest.approx(10.0)
    assert gpu0[0] is None and gpu3[0] == pytest.approx(100.0)  # b1's October samples are outside
    assert result.daily_utilisation["devbox1:1"][1] == pytest.approx(0.0)


def test_by_gpu_and_by_template(month: Path) -> None:
    with State(month) as state:
        gpus = rows(report.build(state, start=START, end=END, now=NOW, by="gpu"))
        templates = rows(report.build(state, start=START, end=END, now=NOW, by="template"))
    expected = {"devbox1:0": (2, 12.0, 4.4, 0), "devbox1:1": (3, 14.0, 1.9, 0), "devbox1:2": (2, 28.0, 6.4, 1),
                "devbox1:3": (2, 16.0, 12.4, 0)}
    assert {k: (r.bookings, r.booked_hours, pytest.approx(r.used_hours), r.no_shows) for k, r in gpus.items()} \
        == {k: (b, h, pytest.approx(u), n) for k, (b, h, u, n) in expected.items()}
    assert all(row.rejected is None for row in gpus.values())
    assert (templates["debian-ssh"].booked_hours, templates["pytorch"].booked_hours) == (30.0, 40.0)
    assert templates["debian-ssh"].used_hours == pytest.approx(17.5)
    assert templates["pytorch"].used_hours == pytest.approx(7.6)
    assert (templates["debian-ssh"].no_shows, templates["pytorch"].no_shows) == (0, 1)


def test_a_window_reaching_past_now_counts_booked_hours_up_to_now(month: Path) -> None:
    with State(month) as state:
        result = report.build(state, start=START, end=END, now=at(11, 10, 12), by="user")
        assert state.gpu_hours_booked_by_user(now=at(11, 10, 12)) == {"alice": 16.0 + 12.0, "bob": 24.0}
        assert state.gpu_hours_booked_by_user(now=NOW) == {"alice": 42.0, "bob": 56.0, "carol": 2.0}
        # all time: b1's October samples count
        assert state.gpu_hours_used_by_user() == pytest.approx({"alice": 10.0, "bob": 27.2, "carol": 1.5})
    assert result.until == at(11, 10, 12)
    assert rows(result)["alice"].booked_hours == 16.0 + 12.0
    assert rows(result)["alice"].no_shows == 0  # a2 has not ended yet


@pytest.mark.slow  # a second or more: out of the fast lane
def test_the_command_writes_a_table_csv_png_and_html(month: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, month.parent)
    printed: list[str] = []
    outputs = report_command.Outputs(csv=tmp_path / "r.csv", png=tmp_path / "r.png", html=tmp_path / "r.html")
    assert report_command.run(start_text="2026-11-01", end_text="2026-12-01", outputs=outputs, now=NOW,
                              config_path=str(config), print_line=printed.append) == 0
    text = "\n".join(printed)
    assert "rejected requests: 3" in text and "GPU N is not present on devbox1" in text
    total = next(line for line in printed if line.startswith("total"))
    assert total.split() == ["total", "5", "70.0", "25.1", "64", "%", "1", "3"]
    parsed = list(csv.DictReader(io.StringIO((tmp_path / "r.csv").read_text())))
    assert [r["user"] for r in parsed] == ["alice", "bob", "carol", "dave", "total"]
    assert float(parsed[1]["used_gpu_hours"]) == pytest.approx(13.6)
    assert float(parsed[0]["idle_share"]) == pytest.approx(0.75) and parsed[3]["idle_share"] == ""
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64,iVBORw0KGgo" in page
    assert "<td>alice</td>" in page


def write_config(folder: Path, state_folder: Path) -> Path:
    path = folder / "gpubook.toml"
    path.write_text('[host]\nname = "devbox1"\ntimezone = "UTC"\n[[calendar]]\nurl = "http://127.0.0.1:9/cal/"\n'
                    f'[gpus]\ncount = 4\n[users.alice]\nuid = 2001\n[daemon]\nstate_dir = "{state_folder}"\n')
    return path


WINDOW = ["--from", "2026-11-01", "--to", "2026-12-01"]


@pytest.mark.parametrize(("args", "says"), [
    (["--from", "2026-11-31", "--to", "2026-12-01"],
     "--from '2026-11-31' is not a date (say e.g. 2026-11-01, 2026-11, today or an ISO 8601 time)"),
    (["--from", "2026-13", "--to", "2026-12-01"],
     "--from '2026-13' is not a month (say e.g. 2026-11-01, 2026-11, today or an ISO 8601 time)"),
    (["--from", "last tuesday"],
     "--from 'last tuesday' is not understood (say e.g. 2026-11-01, 2026-11, today or an ISO 8601 time)"),
    (["--from", "2026-12-01", "--to", "2026-11-01"],
     "--to 2026-11-01 is not after --from 2026-12-01: the window is empty"),
    ([*WINDOW, "--csv", "{tmp}/ok.csv", "--png", "{tmp}/none/r.png"],
     "cannot write the PNG file {tmp}/none/r.png: the folder {tmp}/none does not exist"),
    ([*WINDOW, "--csv", "{tmp}"], "cannot write the CSV file {tmp}: it is a folder"),
])
def test_bad_input_is_one_sentence_and_writes_nothing(month: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str], args: list[str],
                                                      says: str) -> None:
    config = write_config(tmp_path, month.parent)
    given = [a.format(tmp=tmp_path) for a in args]
    assert cli.main(["report", *given, "--config", str(config)]) == cli.EXIT_PROBLEM
    error = capsys.readouterr().err
    assert error == f"gpubook: {says.format(tmp=tmp_path)}\n"
    assert not (tmp_path / "ok.csv").exists()


def test_a_missing_state_database_is_said_and_not_made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, tmp_path / "nothing")
    assert cli.main(["report", "--from", "2026-11-01", "--to", "2026-12-01", "--config", str(config)]) == 1
    assert capsys.readouterr().err == (f"gpubook: no state database at {tmp_path}/nothing/state.sqlite: the daemon "
                                       "has not run with this config (or --config names another [daemon] state_dir)\n")
    assert not (tmp_path / "nothing").exists()


@pytest.mark.slow  # a second or more: out of the fast lane
def test_the_daemon_never_imports_matplotlib() -> None:
    code = ("import sys, gpubook.scheduler.daemon, gpubook.scheduler.commands.cli, "
            "gpubook.scheduler.commands.admin, gpubook.scheduler.outbox.report; "
            "print(sorted(m for m in sys.modules if m.startswith('matplotlib')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"


def test_the_html_page_escapes_what_came_from_a_calendar(tmp_path: Path) -> None:
    """Rejection reasons quote calendar text: in the page it is text, never markup."""
    from gpubook.scheduler.outbox import report_plots

    with State(tmp_path / "state.sqlite") as state:
        hostile = RejectedRow(booking_id="x", user="eve", start=at(11, 3), end=at(11, 4),
                              reason="<img src=x onerror=alert(1)> is not a template on devbox1")
        state.record_bookings(accepted=[], rejected=[hostile], now=at(11, 1), complete=True)
        made = report.build(state, start=START, end=END, now=NOW)
    page = report_plots.html_page(made, picture=b"\x89PNG\r\n\x1a\n")
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert&gt; is not a template" in page


def test_control_characters_of_a_reason_never_reach_the_terminal() -> None:
    assert report.reason_kind("booking \x1b[2J\x1b]0;owned\x07 is refused: details") == \
        "booking \\x1b[2J\\x1b]N;owned\\x07 is refused"


def test_a_short_bookings_hours_show_in_the_table() -> None:
    """A 50 s booking (the GPU host's test) is 0.014 GPU-hours: the table must not say 0.0."""
    short = report.text_row(report.Row("alice", 1, booked_hours=50 / 3600, used_hours=24.9 / 3600, no_shows=0,
                                       rejected=0))
    assert short[2:5] == ("0.014", "0.007", "50 %")
    month = report.text_row(report.Row("bob", 3, booked_hours=25.06, used_hours=0.0, no_shows=3, rejected=None))
    assert month[2:4] == ("25.1", "0.0")


def test_json_gives_the_tables_rows_and_nothing_else_on_stdout(month: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, month.parent)
    printed: list[str] = []
    assert report_command.run(start_text="2026-11-01", end_text="2026-12-01", now=NOW, config_path=str(config),
                              outputs=report_command.Outputs(csv=tmp_path / "r.csv"), print_line=printed.append,
                              as_json=True) == 0
    [text] = printed
    data = json.loads(text)
    assert (data["from"], data["to"], data["by"]) == ("2026-11-01T00:00:00+00:00", "2026-12-01T00:00:00+00:00", "user")
    assert [r["user"] for r in data["rows"]] == ["alice", "bob", "carol", "dave"]
    bob = data["rows"][1]
    assert (bob["bookings"], bob["booked_gpu_hours"], bob["no_shows"], bob["rejected"]) == (2, 28.0, 0, 1)
    assert bob["used_gpu_hours"] == pytest.approx(13.6) and bob["idle_share"] == pytest.approx(1 - 13.6 / 28)
    assert data["rows"][3]["idle_share"] is None
    total = data["total"]
    assert (total["user"], total["bookings"], total["booked_gpu_hours"], total["rejected"]) == ("total", 5, 70.0, 3)
    assert data["rejected"] == 3 and data["rejections"] == {"GPU N is not present on devbox1": 2,
                                                            "… is not a known user of devbox1": 1}
    assert data["gpu_samples"] is True
    assert capsys.readouterr().err == f"wrote {tmp_path / 'r.csv'}\n"  # stdout stays one JSON object
    assert (tmp_path / "r.csv").is_file()


def test_by_project_counts_each_booking_against_the_group_it_was_planned_for(tmp_path: Path) -> None:
    """The project recorded with each accepted booking (schema 10); none: its own row. A booking
    recorded again with another project moves to it."""
    with State(tmp_path / "state.sqlite") as state:
        def row(booking_id: str, user: str, project: str, gpus: tuple[int, ...], day: int) -> BookedRow:
            return BookedRow(booking_id=booking_id, user=user, template="debian-ssh", host="devbox1", gpus=gpus,
                             start=at(11, day, 9), end=at(11, day, 13), project=project)

        state.record_bookings(accepted=[row("v1", "alice", "vision", (0, 1), 2), row("v2", "bob", "nlp", (2,), 3),
                                        row("n1", "carol", "", (3,), 4)], rejected=[], now=at(11, 1), complete=True)
        state.record_bookings(accepted=[row("v2", "bob", "vision", (2,), 3)], rejected=[], now=at(11, 1, 1),
                              complete=False)
        result = report.build(state, start=START, end=END, now=NOW, by="project")
    # vision: 4 h x 2 GPUs + 4 h x 1 GPU = 12; no project: carol's 4 h x 1 GPU.
    assert {r.key: (r.bookings, r.booked_hours, r.rejected) for r in result.rows} == {
        "vision": (2, 12.0, None), report.NO_PROJECT: (1, 4.0, None)}


def test_the_hours_of_bookings_promoted_from_standby_are_reused_hours(month: Path) -> None:
    """Issue 40: a booking that waited on standby and ran on GPUs freed up counts its booked GPU-hours
    as reused; its promotion note outlives its stop (notes.clear_history keeps it for the report)."""
    from gpubook.scheduler.state import notes

    with State(month) as state:
        assert report.build(state, start=START, end=END, now=NOW).reused_hours == 0
        notes.PROMOTED.write(state, "c1", at(11, 16, 10), at=at(11, 16, 10))
        notes.clear_history(state, "c1")  # its stop
        built = report.build(state, start=START, end=END, now=NOW)
    assert built.reused_hours == pytest.approx(2.0)  # c1: 2 h on one GPU
    assert "GPU-hours reused from releases (bookings that waited on standby): 2.0" in report.table(built)
    assert report.to_json(built)["reused_gpu_hours"] == 2.0


def test_a_month_is_a_window_and_today_a_start(month: Path) -> None:
    """Issue 41's times as people type them: `--from 2026-11 --to 2026-11` is the whole of November."""
    zone = UTC
    assert report_command.window("2026-11", "2026-11", zone, now=NOW) == (START, END)
    assert report_command.window("2026-11", None, zone, now=NOW)[0] == START
    assert report_command.window("today", None, zone, now=NOW)[0] == datetime(2026, 12, 5, tzinfo=UTC)
