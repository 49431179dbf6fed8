"""Evidence in a failure's report: a test that failed because rootless podman refused a start on
its own rootfs ("permission denied" under …/merged/) gets the store probe (tests/kits/store_probe.py)
as a section of its report, once per session (the store is one per account)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.kits import store_probe
from tests.kits.slurm_kit import DEFAULT_USER

_probed: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed or _probed:
        return
    user = DEFAULT_USER if os.geteuid() == 0 else None  # root's tests run podman as that account
    try:
        text = store_probe.describe(report.longreprtext, user)
    except (OSError, KeyError) as error:
        text = f"store probe failed: {error}"
    if text:
        _probed.append(item.nodeid)
        report.sections.append(("store probe", text))
