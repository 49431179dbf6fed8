"""The real PodmanEngine and DockerEngine with only `_process` replaced by a recorder (the argv they
would run, and the answers a registry would give), and an image preparer over one
(tests/test_images_prepare.py, tests/test_metrics.py)."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpubook.runtime.engines import EngineOptions, EngineSettings
from gpubook.runtime.engines.docker import DockerEngine
from gpubook.runtime.engines.podman import PodmanEngine
from gpubook.runtime.templates import images
from gpubook.runtime.templates.catalog import Template, load_template
from gpubook.scheduler.hosts.images import ImagePreparer
from tests.kits.pass_kit import HOLD


class Answers:
    """What the recorder answers: nothing present until pulled; pulls wait for `release`."""

    def __init__(self) -> None:
        self.argv: list[list[str]] = []
        self.present: set[str] = set()
        self.release = threading.Event()
        self.release.set()
        self.pull_fails: str | None = None  # the engine's error message, or None: pulls work
        self.tagged_early = False  # the image is present while the pull still runs
        self.warm = threading.Event()  # the warm-up's `create` waits for it
        self.warm.set()
        self.auth_seen: list[str] = []

    def answer(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.argv.append(list(args))
        ok = subprocess.CompletedProcess(list(args), 0, "", "")
        if "pull" in args:
            if "--config" in args:  # Docker: the credentials exist while the pull runs
                self.auth_seen.append((Path(args[args.index("--config") + 1]) / "config.json").read_text())
            if self.tagged_early and not self.pull_fails:  # podman names the image, then ends the pull
                self.present.add(args[-1])
            self.release.wait(HOLD)
            if self.pull_fails:
                return subprocess.CompletedProcess(list(args), 125, "", self.pull_fails)
            self.present.add(args[-1])
            return ok
        if args[:2] == ["image", "exists"]:
            return subprocess.CompletedProcess(list(args), 0 if args[2] in self.present else 1, "", "")
        if args[:2] == ["image", "inspect"]:
            found = args[2] in self.present
            data = [{"Id": "abc", "Size": 1000, "RepoDigests": [], "Created": ""}] if found else []
            return subprocess.CompletedProcess(list(args), 0 if found else 1, json.dumps(data), "")
        if args[0] == "unshare":  # rootless podman's namespace: the daemon user's subordinate ids
            return subprocess.CompletedProcess(list(args), 0, "0 1000 1\n1 100000 65536\n", "")
        if args[0] == "create" and args[args.index("--name") + 1].startswith("gpubook-warm-"):
            self.warm.wait(HOLD)
        if args[0] == "build":
            self.present.add(args[args.index("--tag") + 1])
        if args[0] == "info":
            return subprocess.CompletedProcess(list(args), 0, "/tmp\n", "")
        return ok


class RecordingPodman(PodmanEngine):
    answers: Answers

    def pull_scratch(self) -> Path | None:
        return None  # no progress followed: no skopeo asked about registries that are not there

    def _process(self, args: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                 exclusive: bool = False) -> subprocess.CompletedProcess[str]:
        return self.answers.answer(args)


class RecordingDocker(DockerEngine):
    answers: Answers

    def _process(self, args: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                 exclusive: bool = False) -> subprocess.CompletedProcess[str]:
        return self.answers.answer(args)


def recording(kind: type[RecordingPodman] | type[RecordingDocker] = RecordingPodman) -> RecordingPodman:
    name = "podman" if kind is RecordingPodman else "docker"
    engine = kind(EngineSettings(name=name), EngineOptions())
    engine.answers = Answers()
    return engine  # type: ignore[return-value]


def lab_preparer(tmp_path: Path, engine: RecordingPodman) -> tuple[Template, threading.Semaphore, ImagePreparer]:
    """A registry template, and a preparer over `engine` that releases `done` after each preparation."""
    path = tmp_path / "lab.toml"
    path.write_text('image = "registry.example/lab/x:1"\ncuda = "none"\nhas_sshd = true\n')
    done = threading.Semaphore(0)
    preparer = ImagePreparer(engine=engine, ledger=images.Ledger(tmp_path / "images.json"), on_done=done.release)
    return load_template(path), done, preparer
