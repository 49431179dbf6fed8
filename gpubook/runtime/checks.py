"""`gpubook doctor`'s findings: one `Check` per thing looked at, each problem with its fix.

Neutral ground: the driver checks (runtime.nvidia.gpus), the engine preflights (runtime.engines) and the
scheduler's own checks all return `Check`s, and none of them needs the others to do so.

A check is ok, WARN or FAIL. A WARN is a check that did not pass but that gpubook works without
(`optional=True`, e.g. the CDI spec): it is shown with its fix and does not fail doctor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None  # one sentence, when not ok
    optional: bool = False  # when not ok: gpubook works without it, so a WARN, not a FAIL

    @property
    def level(self) -> str:
        """OK, WARN or FAIL (the strings "ok", "warn", "fail")."""
        if self.ok:
            return OK
        return WARN if self.optional else FAIL

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level, "detail": self.detail, "fix": self.fix}


def exit_status(checks: Sequence[Check]) -> int:
    """1 if any check failed; warnings alone do not fail."""
    return 1 if any(c.level == FAIL for c in checks) else 0


def format_checks(checks: Sequence[Check]) -> tuple[list[str], int]:
    """One line per check (and its fix); exit code 1 if any failed (WARNs do not count)."""
    lines = []
    for check in checks:
        label = {OK: "ok", WARN: "WARN", FAIL: "FAIL"}[check.level]
        lines.append(f"{label:<5} {check.name}: {check.detail}")
        if not check.ok and check.fix:
            lines.append(f"      fix: {check.fix}")
    return lines, exit_status(checks)
