"""The provenance card (issue 37, part 3): its two lines in the ended block, its nulls, and its
file in the booker's output folder, written without following anything the booker planted."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from gpubook.runtime.booking import provenance
from gpubook.runtime.booking.provenance import Card, GpuFacts
from gpubook.runtime.booking.provenance_file import ProvenanceFileError, main, write, write_into
from gpubook.runtime.templates.catalog import load_template
from gpubook.scheduler.hosts import Started, StartRequest
from gpubook.scheduler.outbox.writeback import Remarks, WriteBack
from gpubook.scheduler.state import State, notes
from tests.kits.pass_kit import HOLD, NOW, Machine, bookings, event, make_config, make_pass, running

START = datetime(2026, 11, 23, 9, 0, 12, tzinfo=UTC)
END = datetime(2026, 11, 23, 17, 0, tzinfo=UTC)
ID = "sha256:" + "ab12" * 16
DIGEST = "sha256:" + "cd34" * 16


def h100_card(**changes: Any) -> Card:
    card = Card(booking="b1", user="alice", template="pytorch-cuda12", template_version="3",
                template_sha256="ef" * 32, image="nvcr.io/nvidia/pytorch:24.03-py3", image_id=ID,
                image_digest=DIGEST, cuda_image="12.4.0.041", cudnn_image="9.0.0.306", driver="550.54.15",
                cuda_driver="12.4",
                gpus=(GpuFacts(0, "NVIDIA H100 80GB HBM3", "GPU-8a1b2c3d-0000-1111-2222-333344445555", False),
                      GpuFacts(1, "NVIDIA H100 80GB HBM3", "GPU-33f00000-0000-1111-2222-333344445555", False)),
                mps=False, started=START, ended=END)
    return Card(**{**card.__dict__, **changes})


def test_the_two_lines_say_what_ran_on_what_and_when() -> None:
    first, second = provenance.lines(h100_card(), zone=ZoneInfo("Europe/Berlin"), kept=True)
    assert first == ("provenance: image sha256:cd34cd34cd34… (pytorch-cuda12 3); driver 550.54.15 (CUDA 12.4); "
                     "image CUDA 12.4.0.041, cuDNN 9.0.0.306; GPUs 0,1 NVIDIA H100 80GB HBM3 "
                     "(GPU-8a1b2c3d…, GPU-33f00000…), MIG off, MPS off")
    assert second == ("provenance: ran from 2026-11-23 10:00:12 +0100 to 2026-11-23 18:00:00 +0100; "
                      "the whole card: /data/output/.gpubook/provenance.json")


def test_a_cpu_booking_of_a_template_without_cuda_leaves_out_what_it_cannot_know() -> None:
    """No GPU, no driver, no CUDA declared, an image with no manifest digest recorded: nothing is
    invented; the image id stands for the image."""
    card = Card(booking="b1", user="alice", template="debian-ssh", image="localhost/gpubook/debian-ssh:12",
                image_id=ID, started=START, ended=END)
    first, second = provenance.lines(card, zone=UTC, kept=False)
    assert first == "provenance: image sha256:ab12ab12ab12… (debian-ssh); no GPU"
    assert second == "provenance: ran from 2026-11-23 09:00:12 +0000 to 2026-11-23 17:00:00 +0000"
    data = card.to_json(zone=UTC)
    assert data["image"] == {"reference": "localhost/gpubook/debian-ssh:12", "id": ID, "digest": None,
                             "cuda": None, "cudnn": None}
    assert data["host"] == {"driver": None, "cuda": None}
    assert data["gpus"] == [] and data["mig"] is None and data["mps"] is None
    assert data["template"] == {"name": "debian-ssh", "version": None, "sha256": None}


def test_an_unknown_start_or_end_is_said_so_and_null_in_the_card() -> None:
    card = h100_card(started=None, ended=None, image_id=None, image_digest=None)
    first, second = provenance.lines(card, zone=UTC, kept=False)
    assert first.startswith("provenance: image nvcr.io/nvidia/pytorch:24.03-py3 (pytorch-cuda12 3);")
    assert second == "provenance: ran from unknown to unknown"
    assert card.to_json(zone=UTC)["start"] is None and card.to_json(zone=UTC)["end"] is None


def test_gpus_of_different_models_and_mig_on_any_of_them() -> None:
    card = h100_card(gpus=(GpuFacts(0, "NVIDIA A100-SXM4-40GB", "GPU-1", True), GpuFacts(2, "Tesla V100", None, None)))
    first, _ = provenance.lines(card, zone=UTC, kept=False)
    assert first.endswith("; GPUs 0 NVIDIA A100-SXM4-40GB, 2 Tesla V100 (GPU-1), MIG on, MPS off")
    assert card.to_json(zone=UTC)["mig"] is True


def test_no_control_character_or_overlong_text_reaches_the_lines() -> None:
    """A GPU name or a template version is text from outside gpubook's code: control characters
    (ESC, a newline that would make a line of its own in the block) go, and the lines are bounded."""
    card = h100_card(gpus=(GpuFacts(0, "Evil\x1b[31m\nGPU" + "x" * 500, "GPU-\r\n1", None),),
                     template_version="3\u202e")
    for line in provenance.lines(card, zone=UTC, kept=True):
        assert line.isprintable() and "\x1b" not in line and len(line) <= provenance.LINE_KEPT
    text = json.dumps(card.to_json(zone=UTC), ensure_ascii=True)
    assert "\\u001b" not in text and "\\n" not in text and "\\u202e" not in text


def test_the_image_declares_its_cuda_and_cudnn_in_its_environment() -> None:
    env = ["PATH=/usr/bin", "NVIDIA_REQUIRE_CUDA=cuda>=12.4", "CUDA_VERSION=12.4.1", "NV_CUDNN_VERSION=9.1.0.70-1"]
    assert provenance.image_versions(env) == ("12.4.1", "9.1.0.70-1")
    assert provenance.image_versions(["CUDNN_VERSION=8.9.7.29"]) == (None, "8.9.7.29")
    assert provenance.image_versions(["CUDA_VERSION=$(rm -rf /)", "CUDNN_VERSION="]) == (None, None)
    assert provenance.image_versions([]) == (None, None)


def test_digests_and_nvml_versions() -> None:
    assert provenance.repo_digest(["docker.example/x@" + DIGEST]) == DIGEST
    assert provenance.repo_digest([]) is None
    assert provenance.cuda_driver_text(12040) == "12.4"
    assert provenance.cuda_driver_text(11080) == "11.8"
    assert provenance.cuda_driver_text(None) is None


def test_the_card_survives_state_as_json() -> None:
    card = h100_card(notes=("NVML: unavailable",))
    assert Card.from_json(json.loads(json.dumps(card.to_json(zone=UTC)))) == card
    assert Card.from_json(card.to_json(zone=ZoneInfo("Asia/Tokyo"))).started == START


def test_a_template_has_a_version_and_the_digest_of_its_file(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('image = "localhost/x:1"\ncuda = "none"\nversion = 3\n')
    template = load_template(path)
    assert template.version == "3"
    assert template.sha256 is not None and len(template.sha256) == 64
    path.write_text('image = "localhost/x:1"\ncuda = "none"\nversion = "a b\\u001b"\n')
    with pytest.raises(Exception, match="version"):
        load_template(path)


# -- provenance.json in the booker's output folder ------------------------------------------------


def test_the_card_goes_into_a_gpubook_folder_the_booker_reads(tmp_path: Path) -> None:
    output = tmp_path / "output"
    output.mkdir()
    write_into(output, b'{"schema": 1}\n')
    card = output / ".gpubook" / "provenance.json"
    assert card.read_bytes() == b'{"schema": 1}\n'
    assert card.stat().st_mode & 0o777 == 0o644 and (output / ".gpubook").stat().st_mode & 0o777 == 0o755
    write_into(output, b"again\n")  # a second end (a booking that ran twice) replaces it
    assert card.read_bytes() == b"again\n"
    assert sorted(os.listdir(output / ".gpubook")) == ["provenance.json"]  # no temporary file left


def test_a_planted_gpubook_symlink_is_refused_and_nothing_is_written_elsewhere(tmp_path: Path) -> None:
    output, elsewhere = tmp_path / "output", tmp_path / "daemon-config"
    output.mkdir()
    elsewhere.mkdir()
    (output / ".gpubook").symlink_to(elsewhere)
    with pytest.raises(ProvenanceFileError, match="not a plain folder"):
        write_into(output, b"card\n")
    assert os.listdir(elsewhere) == []
    (output / ".gpubook").unlink()
    (output / ".gpubook").symlink_to(tmp_path / "not-there")  # dangling: not made through either
    with pytest.raises(ProvenanceFileError):
        write_into(output, b"card\n")
    assert not (tmp_path / "not-there").exists()


def test_a_planted_provenance_json_symlink_is_replaced_never_written_through(tmp_path: Path) -> None:
    output, victim = tmp_path / "output", tmp_path / "other-bookers-file"
    (output / ".gpubook").mkdir(parents=True)
    victim.write_text("theirs\n")
    (output / ".gpubook" / "provenance.json").symlink_to(victim)
    write_into(output, b"card\n")
    assert victim.read_text() == "theirs\n"
    card = output / ".gpubook" / "provenance.json"
    assert not card.is_symlink() and card.read_bytes() == b"card\n"


def test_a_gpubook_file_or_output_symlink_is_refused(tmp_path: Path) -> None:
    output = tmp_path / "output"
    output.mkdir()
    (output / ".gpubook").write_text("a file of the booker's\n")
    with pytest.raises(ProvenanceFileError):
        write_into(output, b"card\n")
    assert (output / ".gpubook").read_text() == "a file of the booker's\n"
    (tmp_path / "link").symlink_to(output)
    with pytest.raises(ProvenanceFileError, match="plain folder"):
        write_into(tmp_path / "link", b"card\n")


def test_the_program_form_refuses_with_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """As `podman unshare` runs it: the card on standard input; a refusal is exit status 3."""
    output = tmp_path / "output"
    output.mkdir()
    (output / ".gpubook").symlink_to(tmp_path)
    monkeypatch.setattr("sys.stdin", type("In", (), {"buffer": type("B", (), {"read": lambda self, n: b"x"})()})())
    assert main([str(output)]) == 3
    assert "not a plain folder" in capsys.readouterr().err
    assert main([]) == 2


def test_the_program_runs_through_an_owner_prefix(tmp_path: Path) -> None:
    """`owner_argv` (rootless podman: `podman unshare`) runs the same program; `env` stands in for it."""
    output = tmp_path / "output"
    output.mkdir()
    write(output, b"card\n", owner_argv=["env"])
    assert (output / ".gpubook" / "provenance.json").read_bytes() == b"card\n"
    (tmp_path / "elsewhere").mkdir()
    os.unlink(output / ".gpubook" / "provenance.json")
    os.rmdir(output / ".gpubook")
    (output / ".gpubook").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ProvenanceFileError, match="not a plain folder"):
        write(output, b"card\n", owner_argv=["env"])
    assert os.listdir(tmp_path / "elsewhere") == []


# -- a pass: the start keeps the card, the end completes it ---------------------------------------


class CardMachine(Machine):
    """A host whose start knows a card and whose end writes provenance.json into `output` with the
    real writer (as LocalHost does, as the daemon's own user here)."""

    def __init__(self, output: Path) -> None:
        super().__init__()
        self.output = output
        self.written: list[dict[str, Any]] = []

    def start(self, request: StartRequest) -> Started:
        started = super().start(request)
        card = Card(booking=request.booking_id, user=request.booker.name, template=request.template.name,
                    image=request.template.image, image_id=ID, started=NOW)
        return Started(info=started.info, seconds_to_ssh=0.0, provenance=card.to_json(zone=UTC))

    def write_provenance(self, user: str, card: Card) -> bool:
        self.written.append(card.to_json(zone=UTC))
        write_into(self.output, json.dumps(card.to_json(zone=UTC)).encode())
        return True


@pytest.mark.parametrize("planted", [False, True])
def test_the_end_completes_the_card_and_the_ended_block_gets_its_lines(tmp_path: Path, planted: bool) -> None:
    """A booking that runs and ends: its card has its start and end, provenance.json has it, and the
    ended block has the two lines. With a `.gpubook` symlink planted by the booker the end still
    completes (stopped, recorded, its ended block written) and nothing lands where the link points."""
    config = make_config(tmp_path)
    output, elsewhere = tmp_path / "output", tmp_path / "elsewhere"
    output.mkdir()
    elsewhere.mkdir()
    if planted:
        (output / ".gpubook").symlink_to(elsewhere)
    end = NOW + timedelta(hours=1)
    with State(tmp_path / "state.sqlite") as state:
        occurrences = bookings(config, event("x", NOW, end))
        machine = CardMachine(output)
        passes = make_pass(config, machine, state)
        written: list[Any] = []

        def send(calendar: object, job: Any) -> None:  # what the calendar lane would write, kept
            written.append(job.outcome)
            state.write_back_done(job.item.id, status=job.key, etag=None, at=job.now)

        passes.writeback._send = send  # type: ignore[method-assign]
        try:
            passes.run(occurrences, now=NOW, etags={}, write_back=False)
            for future in list(passes.busy.values()):
                future.result(HOLD)
            assert "x" in notes.PROVENANCE.read({"provenance": state.notes("provenance")})
            passes.run(occurrences, now=end, etags={})  # the stop, and the ended block written after it
            for future in list(passes.busy.values()):
                future.result(HOLD)
            assert passes.writeback.settle(HOLD)
        finally:
            passes.close()
        ended = [outcome for outcome in written if outcome is not None and outcome.status == "ended"]
        assert ended and all(outcome.lines[-2].startswith("provenance: image") for outcome in ended), written
        assert machine.containers == {}  # stopped, whatever became of the card
        (record,) = state.containers(booking_id="x")
        assert record.stopped_at == end
        lines = dict(notes.ENDED_LINES.read({"ended-lines": state.notes("ended-lines")}))["x"]
        assert lines[0].startswith("provenance: image sha256:ab12ab12ab12… (debian-ssh); no GPU")
        assert lines[1].startswith("provenance: ran from 2026-11-23 12:00:00 +0000 to 2026-11-23 13:00:00 +0000")
        plan = make_pass(config, Machine(), state).plan(occurrences, [], now=end)
        outcome = WriteBack(config, state).outcome(
            plan.accepted[0], None, [record], remarks=Remarks(refused={}, failures={}, notes={}, ended={"x": lines}),
            now=end)
        assert outcome is not None and outcome.status == "ended" and outcome.lines[-2:] == lines
    assert machine.written and machine.written[0]["end"] == end.isoformat()
    if planted:
        assert os.listdir(elsewhere) == [] and (output / ".gpubook").is_symlink()
    else:
        data = json.loads((output / ".gpubook" / "provenance.json").read_text())
        assert data["start"] == NOW.isoformat() and data["end"] == end.isoformat()
        assert data["image"]["id"] == ID and data["template"]["name"] == "debian-ssh"


def test_a_running_booking_has_no_ended_lines(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with State(tmp_path / "state.sqlite") as state:
        (booking,) = bookings(config, event("x", NOW, NOW + timedelta(hours=1)))
        plan = make_pass(config, Machine(), state).plan([booking], [], now=NOW)
        info = running("x", (0,), end=NOW + timedelta(hours=1))
        outcome = WriteBack(config, state).outcome(plan.accepted[0], info, [], remarks=Remarks(
            refused={}, failures={}, notes={}, ended={"x": ("provenance: x", "provenance: y")}), now=NOW)
        assert outcome is not None and not any(line.startswith("provenance") for line in outcome.lines)


# -- what NVML tells (a stand-in pynvml: no GPU here) ---------------------------------------------


class FakeNvml:
    """pynvml's calls that `nvml.provenance` makes; GPU 1 refuses the MIG query, as a board without MIG does."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        pass

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlSystemGetDriverVersion(self) -> bytes:  # noqa: N802
        return b"550.54.15"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:  # noqa: N802
        return 12040

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:  # noqa: N802
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return f"GPU-{handle:08x}-0000"

    def nvmlDeviceGetMigMode(self, handle: int) -> tuple[int, int]:  # noqa: N802
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return (1, 1)


def test_nvml_tells_the_driver_its_cuda_and_each_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubook.runtime.nvidia import nvml

    monkeypatch.setitem(__import__("sys").modules, "pynvml", FakeNvml())
    seen = nvml.provenance([0, 1])
    assert (seen.driver_version, seen.cuda_driver_version, seen.problem) == ("550.54.15", 12040, None)
    assert seen.gpus == ((0, "NVIDIA H100 80GB HBM3", "GPU-00000000-0000", True),
                         (1, "NVIDIA H100 80GB HBM3", "GPU-00000001-0000", None))


def test_without_nvml_the_facts_are_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubook.runtime.nvidia import nvml

    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import fails: not installed
    seen = nvml.provenance([0])
    assert (seen.driver_version, seen.cuda_driver_version, seen.gpus) == (None, None, ())
    assert seen.problem and "not installed" in seen.problem


# -- what the engine's image inspect tells (LocalHost.provenance) ---------------------------------


class InspectingEngine:
    """Just what LocalHost.provenance asks an engine that inspects images (images.ImageEngine)."""

    name = "podman"

    def __init__(self, env: tuple[str, ...], digests: tuple[str, ...] = ()) -> None:
        self.env, self.digests = env, digests
        self.asked: list[str] = []

    def image_facts(self, image: str) -> Any:
        from gpubook.runtime.templates.images import ImageFacts

        self.asked.append(image)
        return ImageFacts(id="ab12" * 16, size=1, digests=self.digests, created="", env=self.env)

    def image_exists(self, image: str) -> bool:
        return True

    def pull(self, image: str, **_: Any) -> None:
        pass

    def tag(self, image: str, target: str) -> None:
        pass

    def remove_image(self, image: str) -> None:
        pass


def test_the_start_reads_the_image_and_template_and_leaves_gpus_unknown_without_a_driver(tmp_path: Path) -> None:
    import paramiko

    from gpubook.runtime.templates.catalog import Template
    from gpubook.scheduler.hosts import Booker
    from gpubook.scheduler.hosts.local import LocalHost

    engine = InspectingEngine(("CUDA_VERSION=12.4.1", "NV_CUDNN_VERSION=9.1.0.70"), ("nvcr.io/nvidia/x@" + DIGEST,))
    host = LocalHost(engine=engine, gpus=(0, 1), driver_version=None,  # type: ignore[arg-type]
                     probe_key=paramiko.ECDSAKey.generate(bits=256), cache_dir=tmp_path)
    template = Template(name="x", path=tmp_path / "x.toml", image="nvcr.io/nvidia/x:1", cuda="12.4", version="3",
                        sha256="ef" * 32)
    request = StartRequest(booking_id="b1", booker=Booker("alice", 2001, 2001), template=template, gpus=(0,),
                           port=2200, end=END)
    card = host.provenance(request, started=START)
    assert engine.asked == ["nvcr.io/nvidia/x:1"]  # the template's own image, not gpubook's overlay of it
    assert (card.image_id, card.image_digest, card.cuda_image, card.cudnn_image) == (ID, DIGEST, "12.4.1", "9.1.0.70")
    assert (card.template_version, card.template_sha256, card.started) == ("3", "ef" * 32, START)
    assert (card.driver, card.cuda_driver, card.gpus, card.mps) == (None, None, (), None)  # no driver: unknown
