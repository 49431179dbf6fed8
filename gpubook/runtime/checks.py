"""`gpubook doctor`'s findings: one `Check` per thing looked at, each failure with its fix.

Neutral ground: the driver checks (runtime.gpus), the engine preflights (runtime.engines) and the
scheduler's own checks all return `Check`s, and none of them needs the others to do so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None  # one sentence, when not ok


def format_checks(checks: Sequence[Check]) -> tuple[list[str], int]:
    """One line per check (and its fix); exit code 1 if any failed."""
    lines = []
    for check in checks:
        if check.ok:
            lines.append(f"ok    {check.name}: {check.detail}")
        else:
            lines.append(f"FAIL  {check.name}: {check.detail}")
            if check.fix:
                lines.append(f"      fix: {check.fix}")
    return lines, 1 if any(not c.ok for c in checks) else 0
