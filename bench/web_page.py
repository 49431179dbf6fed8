"""The status page's figures with a busy week, and its screenshots. Prints the figures with the machine.

    PYTHONPATH=. python bench/web_page.py size [--bookings 1000]   # status file, page, JSON; build and serve times
    PYTHONPATH=. python bench/web_page.py shots [--out docs/images]  # web-day.png and web-week.png

size: `--bookings` one-GPU bookings on 8 GPUs from a week back to a week ahead (the past half
ended, from State's records), 50 refused: the time to build the timelines (hosts_status) and
write the status file as the daemon does after each pass; the file's size; the page's and the JSON
endpoint's size and time through waitress (median of 20); Chromium's time from load to drawn.
shots: a small lab's day (4 GPUs: ended, running, held, booked, refused, a problem), served and
photographed by headless Chromium in Europe/Paris.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402

from gpubook.runtime.engines import ContainerInfo, container_name  # noqa: E402
from gpubook.scheduler.core.plan import Plan  # noqa: E402
from gpubook.scheduler.outbox import status  # noqa: E402
from gpubook.scheduler.state.records import ContainerRecord  # noqa: E402
from tests.kits.web_kit import (  # noqa: E402
    accepted,
    booking,
    browser,
    ended_records,
    generated_plan,
    now_utc,
    rejection,
    rendered,
    served,
    status_of,
    web_config,
)


def machine() -> str:
    cores = len(__import__("os").sched_getaffinity(0))
    memory = int(Path("/proc/meminfo").read_text().split()[1]) / 1024 / 1024
    return f"{platform.platform(terse=True)}, {cores} cores, {memory:.0f} GiB"


def size(bookings: int) -> None:
    now = now_utc()
    plan = generated_plan(now, bookings=bookings)
    records = ended_records(plan, now=now)
    builds = []
    for _ in range(5):
        began = time.perf_counter()
        report = status_of(plan, now=now, records=records)
        text = json.dumps(report.to_json(), indent=2)
        builds.append(time.perf_counter() - began)
    segments = sum(len(lane.segments) for lane in report.main.timeline)
    print(f"machine: {machine()}")
    print(f"{bookings} bookings ({segments} timeline segments, {len(report.rejected)} refused): status built and "
          f"serialised in {1000 * statistics.median(builds):.0f} ms (median of 5); file {len(text) / 1024:.0f} KiB")
    with tempfile.TemporaryDirectory() as folder, served(web_config(Path(folder)), report) as url:
        for path in ("/", "/api/status"):
            times, size_bytes = [], 0
            for _ in range(20):
                began = time.perf_counter()
                answer = requests.get(url + path, timeout=30)
                times.append(time.perf_counter() - began)
                size_bytes = len(answer.content)
            print(f"GET {path}: {size_bytes / 1024:.0f} KiB in {1000 * statistics.median(times):.0f} ms (median of 20)")
        with browser() as driver:
            began = time.perf_counter()
            rendered(driver, url + "/")
            loaded = time.perf_counter() - began
            began = time.perf_counter()
            driver.find_element("css selector", '.views button[data-view="week"]').click()
            week = time.perf_counter() - began
            drawn = len(driver.find_elements("css selector", ".timeline .seg"))
    print(f"Chromium (headless): page loaded and drawn in {1000 * loaded:.0f} ms; week view ({drawn} segments) "
          f"drawn in {1000 * week:.0f} ms")


def lab_day() -> status.Status:
    """A small lab's day for the screenshots."""
    now = now_utc().replace(minute=0, second=0)
    hour = timedelta(hours=1)
    made = {
        "alice-train@lab": (booking("alice-train@lab", user="alice", start=now - 3 * hour, end=now + 2 * hour,
                                    template="pytorch-cuda12"), (0, 1)),
        "bob-notebook@lab": (booking("bob-notebook@lab", user="bob", start=now - hour, end=now + hour,
                                     template="jupyter"), (2,)),
        "carol-eval@lab": (booking("carol-eval@lab", user="carol", start=now + 3 * hour, end=now + 6 * hour), (2, 3)),
        "dave-held@lab": (booking("dave-held@lab", user="dave", start=now - hour / 2, end=now + 3 * hour), (3,)),
        "erin-tomorrow@lab": (booking("erin-tomorrow@lab", user="erin", start=now + 20 * hour, end=now + 30 * hour),
                              (0,)),
        "alice-sweep@lab": (booking("alice-sweep@lab", user="alice", start=now + 50 * hour, end=now + 70 * hour),
                            (0, 1, 2, 3)),
        "frank-early@lab": (booking("frank-early@lab", user="frank", start=now - 8 * hour, end=now - 4 * hour), (0,)),
    }
    plan = Plan(accepted=tuple(accepted(b, *gpus) for b, gpus in sorted(made.values(), key=lambda x: x[0].start)),
                rejected=(rejection("gina-big@lab", user="gina", start=now + 4 * hour,
                                    reason="gina may book at most 2 GPUs; this booking asks for 4"),
                          rejection("hal-clash@lab", user="hal", start=now + 3 * hour,
                                    reason="GPU 2 is taken by carol-eval@lab at that time")), next_wakeup=None)
    running = [ContainerInfo(name=container_name(i), id="c", state="running", image="i", booking_id=i,
                             user=made[i][0].user, gpus=made[i][1], end=made[i][0].end, spec_hash="h", port=2200 + n,
                             template=made[i][0].template, start=made[i][0].start)
               for n, i in enumerate(("alice-train@lab", "bob-notebook@lab"))]
    frank = made["frank-early@lab"][0]
    records = [ContainerRecord(id=1, booking_id=frank.id, name=container_name(frank.id), user="frank", gpu_count=1,
                               started_at=frank.start, stopped_at=frank.end, exit_reason="ended", restarts=0)]
    report = status_of(plan, now=now_utc(), gpus=4, containers=running, ports={},
                       held={"dave-held@lab": "GPU 3 still used by a container that is stopping"}, records=records)
    return status.Status(**{**report.__dict__, "problems": (
        "holiday-calendar.ics: not a booking: no DTEND and no DURATION",)})


def shots(out: Path) -> None:
    with tempfile.TemporaryDirectory() as folder, served(web_config(Path(folder)), lab_day()) as url, \
            browser(width=1200, height=1400) as driver:
        rendered(driver, url + "/")
        driver.save_screenshot(str(out / "web-day.png"))
        # At the weekend this week is mostly past: the next one shows what is booked.
        view = "next" if now_utc().astimezone(ZoneInfo("Europe/Paris")).weekday() >= 5 else "week"
        driver.find_element("css selector", f'.views button[data-view="{view}"]').click()
        driver.save_screenshot(str(out / "web-week.png"))
    print(f"wrote {out / 'web-day.png'} and {out / 'web-week.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["size", "shots"])
    parser.add_argument("--bookings", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "images")
    args = parser.parse_args()
    if args.what == "size":
        size(args.bookings)
    else:
        shots(args.out)


if __name__ == "__main__":
    main()
