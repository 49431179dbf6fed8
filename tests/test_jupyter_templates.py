"""Today's templates (PyTorch on CUDA 12, a CUDA 12 base) against the driver, the jupyter option, and
what a start adds to the running block. Template files are data here: no image is pulled.

The start is the real StartHandler with a real State (SQLite) and the real WriteBack's outcome; the
host is a tiny class meeting the Host protocol that says what the entrypoint said about JupyterLab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpubook.runtime.booking import jupyter, launch, ssh
from gpubook.runtime.engines import ContainerInfo, ExecResult, container_name
from gpubook.runtime.nvidia import cuda
from gpubook.runtime.templates.catalog import load_all, load_template
from gpubook.scheduler.apply.handlers import StartHandler
from gpubook.scheduler.apply.memory import Journal, Recall
from gpubook.scheduler.core import decide
from gpubook.scheduler.core.bookings import Booking
from gpubook.scheduler.core.plan import LOCAL, Accepted
from gpubook.scheduler.hosts import Started, StartRequest
from gpubook.scheduler.outbox.writeback import Remarks, WriteBack, start_lines
from gpubook.scheduler.state import State, notes
from tests.kits.pass_kit import make_config

NOW = datetime(2026, 11, 23, 12, tzinfo=UTC)
TODAY = ("pytorch-cuda12", "cuda12-base")


def test_todays_templates_load_beside_the_historical_ones() -> None:
    loaded = load_all()
    assert loaded.errors == {}
    torch, base = loaded.templates["pytorch-cuda12"], loaded.templates["cuda12-base"]
    assert torch.image == "nvcr.io/nvidia/pytorch:25.06-py3" and torch.cuda == "12.9"
    assert base.image == "nvidia/cuda:12.9.1-base-ubuntu24.04" and base.cuda == "12.9"
    # Neither image has sshd: the overlay (apt-get, Ubuntu 24.04) adds it.
    assert not torch.has_sshd and not base.has_sshd
    assert torch.jupyter and not base.jupyter
    for old in ("tensorflow-cuda8", "tensorflow-cuda9", "digits-cuda8", "digits-cuda9", "cuda8-base",
                "cuda9-base"):
        assert not loaded.templates[old].jupyter


@pytest.mark.parametrize("name", TODAY)
@pytest.mark.parametrize(("driver", "verdict"), [
    ("470.256.02", "refused"),  # the CUDA 11 family's last branch: no CUDA 12 at all
    ("520.61.05", "refused"),
    ("525.60.13", "limited"),  # the CUDA 12 family's first driver: minor version compatibility
    ("535.247.01", "limited"),
    ("575.51.03", "full"),  # CUDA 12.9's own GA driver
    ("580.95.05", "full"),
])
def test_cuda_12_templates_against_drivers(name: str, driver: str, verdict: str) -> None:
    template = load_all().templates[name]
    assert template.cuda is not None
    [check] = cuda.validate_against_driver([(name, template.cuda)], driver)
    if verdict == "refused":
        assert check.problem == (f"the template needs CUDA 12.9, which needs NVIDIA driver 525.60.13 or newer; "
                                 f"this host has {driver}")
    else:
        assert check.problem is None
        assert (check.note is not None) is (verdict == "limited")
        if check.note:
            assert "575.51.03" in check.note and "minor version compatibility" in check.note


def test_jupyter_must_be_true_or_false(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text('image = "debian:12"\ncuda = "none"\njupyter = "yes"\n')
    with pytest.raises(Exception, match=r"lab.toml: jupyter: must be true or false"):
        load_template(path)
    path.write_text('image = "debian:12"\ncuda = "none"\njupyter = true\n')
    assert load_template(path).jupyter


def test_booking_spec_asks_the_entrypoint_for_jupyter_only_when_the_template_does(tmp_path: Path) -> None:
    from gpubook.runtime.data.storage import DataFolders

    torch = load_all().templates["pytorch-cuda12"]
    probe = ssh.load_probe_key(tmp_path / "probe")
    key = ssh.HostKey(folder=tmp_path, public="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJZ")
    folders = DataFolders(user="alice", input=tmp_path, output=tmp_path, home=None)
    booked = launch.Tenancy(booking_id="b1", user="alice", uid=2001, gid=2001, ssh_keys=(), port=2201,
                                     end=NOW)
    files = launch.HostFiles(probe_key=probe, cache_dir=tmp_path, host_key=key, folders=folders)
    specs = [launch.booking_spec(template, booked, files)
             for template in (torch, replace(torch, jupyter=False))]
    assert (jupyter.ENV, "1") in specs[0].env
    assert jupyter.ENV not in dict(specs[1].env)
    assert all("--ip" not in " ".join(spec.command) for spec in specs)


class Lab:
    """A host meeting the Host protocol whose start reports what the entrypoint said of JupyterLab."""

    def __init__(self, lab: jupyter.Availability | None, driver_version: str | None = None) -> None:
        self.name: str = LOCAL
        self.gpus: tuple[int, ...] = (0, 1)
        self.driver_version, self.lab = driver_version, lab

    def start(self, request: StartRequest) -> Started:
        info = ContainerInfo(name=container_name(request.booking_id), id="c1", state="running", image="i",
                             booking_id=request.booking_id, user="alice", gpus=request.gpus, end=request.end,
                             spec_hash="h", port=request.port, template=request.template.name, host=LOCAL,
                             host_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJZ")
        return Started(info=info, seconds_to_ssh=0.1, jupyter=self.lab)

    def list(self) -> list[ContainerInfo]:
        return []

    def stop(self, name: str, grace: float) -> None: ...

    def exec(self, name: str, argv: Sequence[str], *, timeout: float | None = None) -> ExecResult:
        return ExecResult(0, "", "")

    def inspect(self, name: str) -> ContainerInfo | None:
        return None


def start_and_block(tmp_path: Path, host: Lab, template: str) -> tuple[str, ...]:
    """Start one booking of `template` through the real handler; the lines its running block gets."""
    config = make_config(tmp_path)
    state = State(tmp_path / "state.sqlite")
    templates = load_all()
    recall = Recall()
    handler = StartHandler(config, hosts={LOCAL: host}, state=state, templates=templates, recall=recall,
                           journal=Journal(state))
    booking = Booking(id="b1", uid="b1", user="alice", template=template, gpu_count=1, gpu_indices=None,
                      start=NOW, end=NOW + timedelta(hours=2), created=None, dtstamp=None,
                      calendar_url="http://127.0.0.1:9/lab/devbox1/", href="b1.ics", summary="")
    accepted = Accepted(booking=booking, gpus=(0,), warn_at=NOW + timedelta(hours=1))
    change = handler(decide.Start(accepted), now=NOW)
    assert change.running is not None and state.note(booking.id, notes.REFUSED.key) is None
    outcome = WriteBack(config, state).outcome(accepted, change.running, None,
                                               remarks=Remarks(refused={}, failures={}, notes={}), now=NOW,
                                               extra=state.notes(notes.RUNNING_LINES.key))
    assert outcome is not None
    return outcome.lines


def test_running_block_says_how_to_reach_jupyterlab_without_its_token(tmp_path: Path) -> None:
    lines = start_and_block(tmp_path, Lab(jupyter.Availability(True)), "pytorch-cuda12")
    port = int(lines[0].split()[2])
    assert lines[0] == f"ssh -p {port} alice@devbox1"
    assert f"jupyter: ssh -N -L 8888:/run/gpubook/jupyter/socket -p {port} alice@devbox1" in lines
    assert any(line.startswith("jupyter url: ") and "cat /run/gpubook/jupyter/url" in line for line in lines)
    assert not any("token=" in line for line in lines)  # the calendar is the whole lab's to read


def test_image_without_jupyterlab_is_said_not_failed(tmp_path: Path) -> None:
    said = jupyter.Availability(False, "not available in this image (no jupyter-lab on its PATH)")
    lines = start_and_block(tmp_path, Lab(said), "pytorch-cuda12")
    assert "jupyter: not available in this image (no jupyter-lab on its PATH)" in lines
    assert not any("ssh -N -L" in line for line in lines)


def test_templates_without_jupyter_add_nothing_and_limits_are_said(tmp_path: Path) -> None:
    assert start_and_block(tmp_path, Lab(None), "debian-ssh")[3:] == ()  # ssh, until, known_hosts only
    (tmp_path / "b").mkdir()
    limited = start_and_block(tmp_path / "b", Lab(None, driver_version="535.247.01"), "cuda12-base")
    assert limited[3:] == ("cuda 12.9: runs through CUDA minor version compatibility (CUDA 12.9 shipped with "
                           "575.51.03): JIT of newer PTX and the newest driver features are unavailable",)


def test_a_cuda_12_booking_on_a_470_driver_is_refused_at_its_start(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    state = State(tmp_path / "state.sqlite")
    recall = Recall()
    handler = StartHandler(config, hosts={LOCAL: Lab(None, driver_version="470.256.02")}, state=state,
                           templates=load_all(), recall=recall, journal=Journal(state))
    booking = Booking(id="b2", uid="b2", user="alice", template="pytorch-cuda12", gpu_count=1, gpu_indices=None,
                      start=NOW, end=NOW + timedelta(hours=2), created=None, dtstamp=None,
                      calendar_url="http://127.0.0.1:9/lab/devbox1/", href="b2.ics", summary="")
    handler(decide.Start(Accepted(booking=booking, gpus=(0,), warn_at=NOW)), now=NOW)
    assert state.note("b2", notes.REFUSED.key) == ("the template needs CUDA 12.9, which needs NVIDIA driver "
                                                   "525.60.13 or newer; this host has 470.256.02")


def test_start_lines_never_hold_a_token() -> None:
    torch = load_all().templates["pytorch-cuda12"]
    lines = start_lines(torch, jupyter.Availability(True), driver_version=None, port=2201, user="alice",
                        host="devbox1")
    assert len(lines) == 2 and all("token=" not in line for line in lines)


class _Captured(WriteBack):
    """The real WriteBack, keeping what its calendar lane would send instead of sending it."""

    written: list[tuple[str, ...]]

    def _send(self, calendar, job):  # type: ignore[no-untyped-def, override]
        self.written.append(job.outcome.lines)


def test_a_starts_own_write_back_carries_its_jupyter_line(tmp_path: Path) -> None:
    """The write queued by the start itself (as soon as its SSH answered) holds the start's lines,
    so the pass's write after it has nothing new to send (one write, not a second with the lines)."""
    config = make_config(tmp_path)
    state = State(tmp_path / "state.sqlite")
    recall = Recall()
    handler = StartHandler(config, hosts={LOCAL: Lab(jupyter.Availability(True))}, state=state,
                           templates=load_all(), recall=recall, journal=Journal(state))
    booking = Booking(id="b1", uid="b1", user="alice", template="pytorch-cuda12", gpu_count=1, gpu_indices=None,
                      start=NOW, end=NOW + timedelta(hours=2), created=None, dtstamp=None,
                      calendar_url="http://127.0.0.1:9/lab/devbox1/", href="b1.ics", summary="")
    accepted = Accepted(booking=booking, gpus=(0,), warn_at=NOW + timedelta(hours=1))
    change = handler(decide.Start(accepted), now=NOW)
    writeback = _Captured(config, state)
    writeback.written = []
    assert change.running is not None
    writeback.wake(accepted, containers=[change.running], etag=None, now=NOW)  # it reads State's records and notes
    assert writeback.settle(10)
    ((lines),) = writeback.written
    assert any(line.startswith("jupyter: ssh -N -L 8888:/run/gpubook/jupyter/socket") for line in lines)
