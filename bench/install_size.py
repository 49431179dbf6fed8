"""The installed size of gpubook: the base install (the daemon) and each extra, as a lab gets them.

    python3 bench/install_size.py [--out bench/results/package-DATE]

Builds the wheel once from the checkout (`pip wheel --no-deps`), then for the base install and each
extra makes a fresh venv from Debian's /usr/bin/python3 in a temporary folder and installs
`gpubook[EXTRA]` from that wheel with `-c constraints.txt` (the locked versions). It prints, per
install, the MiB on disk of the venv's site-packages (allocated blocks, as `du` counts them) and the
number of distributions installed; the empty venv (pip and setuptools only) is the first row, for
comparison. pip needs the package index; its cache makes a second run fast.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLS = ("(empty venv)", "base", "web", "report", "demo", "test")
MIB = 1024 * 1024


def disk_bytes(folder: Path) -> int:
    """Bytes allocated on disk under `folder` (hard links counted once), as `du` counts them."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for path in folder.rglob("*"):
        stat = path.lstat()
        if (stat.st_dev, stat.st_ino) in seen:
            continue
        seen.add((stat.st_dev, stat.st_ino))
        total += stat.st_blocks * 512
    return total


def build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-qq", "--disable-pip-version-check",
                    "-w", str(out), str(ROOT)], check=True)
    (wheel,) = out.glob("gpubook-*.whl")
    return wheel


def measure(install: str, wheel: Path, work: Path) -> dict[str, object]:
    venv = work / install.strip("()").replace(" ", "-")
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    if not install.startswith("("):
        target = str(wheel) if install == "base" else f"gpubook[{install}] @ {wheel.as_uri()}"
        subprocess.run([python, "-m", "pip", "install", "-qq", "--disable-pip-version-check", "-c",
                        str(ROOT / "constraints.txt"), target], check=True)
    code = "import importlib.metadata as m, site; print(site.getsitepackages()[0]); print(len(list(m.distributions())))"
    site_packages, count = subprocess.run([python, "-c", code], capture_output=True, text=True,
                                          check=True).stdout.split()
    return {"install": install, "site_packages_mib": round(disk_bytes(Path(site_packages)) / MIB, 1),
            "distributions": int(count)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write install_size.json and install_size.txt there")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpubook-size-") as folder:
        work = Path(folder)
        wheel = build_wheel(work / "dist")
        rows = [measure(install, wheel, work) for install in INSTALLS]
    python = subprocess.run(["/usr/bin/python3", "--version"], capture_output=True, text=True).stdout.strip()
    header = (f"gpubook {wheel.name}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()} "
              f"({os.cpu_count()} CPUs), {python}, pip install -c constraints.txt")
    lines = [header, f"{'install':<14} {'site-packages MiB':>18} {'distributions':>14}"]
    lines += [f"{row['install']:<14} {row['site_packages_mib']:>18} {row['distributions']:>14}" for row in rows]
    lines.append("distributions include the venv's own pip and setuptools (and gpubook itself where installed)")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "install_size.txt").write_text("\n".join(lines) + "\n")
        (args.out / "install_size.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
