"""`gpubook images`: what is prepared for which booking (the daemon's last pass), and every image
gpubook pulled or built itself, with sizes and the engine's free space (the images cleanup may
remove; an admin's own images are never listed, nor touched)."""

from __future__ import annotations

import json
import sys
from typing import Any

from gpubook.runtime.templates import images
from gpubook.scheduler import config as config_module
from gpubook.scheduler.outbox.status import image_lines
from gpubook.scheduler.outbox.status_file import STATUS_FILE
from gpubook.scheduler.wiring import make_engine, state_dir


def show(config_path: str, *, as_json: bool = False) -> int:
    config = config_module.load(config_path)
    folder = state_dir(config)
    status_path = folder / STATUS_FILE
    prepared: dict[str, Any] = {}
    if status_path.is_file():
        prepared = json.loads(status_path.read_text()).get("images") or {}
    engine = make_engine(config)
    recorded = []
    free = storage = None
    if isinstance(engine, images.ImageEngine):
        storage = engine.storage_path()
        free = images.free_bytes(engine)
        for entry in images.Ledger(folder / "images.json").entries():
            facts = engine.image_facts(entry.image)
            recorded.append({**entry.__dict__, "size": facts.size if facts else None, "present": facts is not None})
    report = {"preparations": prepared.get("preparations", []), "recorded": recorded, "free_bytes": free,
              "storage": str(storage) if storage else None, "min_free_bytes": int(config.images.min_free_gb * 1e9),
              "prepare_hours": config.images.prepare_hours}
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print("\n".join(render(report)))
    return 0


def render(report: dict[str, Any]) -> list[str]:
    free = report.get("free_bytes")
    lines = [f"Free space: {free / 1e9:.1f} GB in {report.get('storage')}" if free is not None else
             "Free space: unknown (the engine does not say where it stores images)"]
    if report.get("min_free_bytes"):
        lines[0] += f"; gpubook's unused images are removed under {report['min_free_bytes'] / 1e9:g} GB"
    prepared = image_lines({**report, "free_bytes": None}, sizes=True)
    lines += prepared[1:] and [f"Prepared for bookings starting within {report['prepare_hours']:g} h:",
                               *prepared[1:]] or ["Prepared for bookings: none (no daemon pass yet, or no "
                                                  "booking within prepare_hours)"]
    lines.append(f"Pulled or built by gpubook ({len(report['recorded'])}), oldest first:")
    for entry in sorted(report["recorded"], key=lambda e: e["at"]):
        size = f"{entry['size'] / 1e9:.2f} GB" if entry.get("size") else "gone"
        source = f" from {entry['source']}" if entry.get("source") else ""
        lines.append(f"  {entry['image']:<60} {size:>8}  {entry['kind']} {entry['at'][:19]}{source}")
    return lines
