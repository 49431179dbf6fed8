#!/usr/bin/env python3
"""What gpubook's GPU container costs against bare metal (issue 4, section 6).

Measures, on the GPU test host (after `source .bundle/podman-on-gpuhost.sh .bundle`):
- ResNet-50 training on synthetic data (PyTorch + torchvision from /opt/torch), images/s, bare
  metal versus inside a gpubook container (host-rootfs image, driver injected by runtime.nvidia,
  /opt/torch bound read-only), alternating bare/container for --pairs pairs (the order swaps
  every pair so that drift, e.g. clocks warming up, cancels); reported: the median of the
  per-pair ratios container/bare and the overhead it means;
- with --gpus 2: the same for 1 and 2 GPUs (DDP over NCCL), and the 2-GPU scaling
  (images/s on 2 GPUs / on 1) bare versus container;
- start of a GPU container to its first CUDA kernel: wall time from just before `podman run`
  to the end of a no-op kernel launched through the CUDA driver API (ctypes, no PyTorch import
  in the way), against the same program started bare;
- with --udocker-account NAME: udocker as a third place in the same rounds (gpubook's udocker
  engine, R1 with the host's runc, run as that ordinary account through bench/udocker_place.py;
  the host's root file system made into one udocker container once, run afresh each time); its
  ratios against bare metal are reported beside podman's. The source tree must be readable by
  the account (tests/gpu/run_udocker_gpu.sh makes the account and such a copy).

Every measurement is a fresh process (and container). Prints the figures, writes JSON to --out.
`--selftest` checks the arguments, imports and statistics on a machine without a GPU.

Usage on the GPU host, from the repository root:
    PYTHONPATH=. python3 bench/gpu_overhead.py --gpus 1 --out bench-gpu1.json
    PYTHONPATH=. python3 bench/gpu_overhead.py --gpus 2 --out bench-gpu2.json
    PYTHONPATH=. python3 bench/gpu_overhead.py --gpus 1 --udocker-account gpubook-ud --out bench-ud.json
"""

from __future__ import annotations

# Only the standard library at module level: the same file runs as the worker inside the
# container (and in mp.spawn children), where gpubook's packages are not present.
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONTAINER_BENCH = "/gpubook-bench"
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast must stay off on the test hosts
UDOCKER_CONTAINER = "gpubook-bench-hostroot"

NOOP_PTX = (
    b".version 7.0\n.target sm_50\n.address_size 64\n"
    b".visible .entry gpubook_noop()\n{\n\tret;\n}\n\0"
)


# ---------------------------------------------------------------------------------------------
# Workers (bare metal, or inside the container)


def first_kernel() -> None:
    """Launch one no-op kernel through the driver API; print when it finished (wall clock)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")

    def check(status: int, what: str) -> None:
        if status != 0:
            raise SystemExit(f"{what} failed with CUDA error {status}")

    check(cuda.cuInit(0), "cuInit")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    check(
        cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(NOOP_PTX)), "cuModuleLoadData"
    )
    check(
        cuda.cuModuleGetFunction(ctypes.byref(function), module, b"gpubook_noop"),
        "cuModuleGetFunction",
    )
    u = ctypes.c_uint
    check(
        cuda.cuLaunchKernel(function, u(1), u(1), u(1), u(1), u(1), u(1), u(0), None, None, None),
        "cuLaunchKernel",
    )
    check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
    print(json.dumps({"kernel_done": time.time()}), flush=True)


def _train_rank(rank: int, world: int, options: dict, port: int) -> None:
    import torch
    import torchvision

    distributed = world > 1
    if distributed:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    torch.cuda.set_device(rank)
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    batch = options["batch"]
    images = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device="cuda")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=options["amp"]):
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()

    for _ in range(options["warmup"]):
        step()
    torch.cuda.synchronize()
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(options["steps"]):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    rate = torch.tensor([batch * options["steps"] / elapsed], device="cuda")
    if distributed:
        dist.all_reduce(rate)  # the sum of every rank's images/s
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"images_per_s": rate.item(), "gpus": world}), flush=True)


def train(gpus: int, options: dict) -> None:
    if gpus == 1:
        _train_rank(0, 1, options, 0)
        return
    import torch.multiprocessing as mp

    mp.spawn(_train_rank, args=(gpus, options, options["port"]), nprocs=gpus)


# ---------------------------------------------------------------------------------------------
# Parent: runs workers bare and in containers, alternating


def last_json(output: str) -> dict:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no result in the worker's output:\n{output[-3000:]}")


def median_ratio(bare: list[float], container: list[float]) -> float:
    return statistics.median(c / b for b, c in zip(bare, container, strict=True))


def worker_args(options: argparse.Namespace, gpus: int, port: int) -> list[str]:
    return [
        "--worker",
        "train",
        "--gpus",
        str(gpus),
        "--steps",
        str(options.steps),
        "--warmup",
        str(options.warmup),
        "--batch",
        str(options.batch),
        "--port",
        str(port),
    ] + ([] if options.amp else ["--no-amp"])


class Runner:
    """Starts one measurement, bare or in a container, and returns its JSON result."""

    def __init__(self, options: argparse.Namespace) -> None:
        sys.path.insert(0, str(REPO / "tests" / "kits"))
        sys.path.insert(0, str(REPO))
        import hostroot  # noqa: PLC0415 - the GPU-host helpers; absent from the container

        from gpubook.runtime import nvidia  # noqa: PLC0415

        self.hostroot, self.nvidia, self.options = hostroot, nvidia, options
        self.driver = nvidia.discover()
        preparing = self.prepare_udocker() if options.udocker_account else None
        self.image = options.image or hostroot.ensure_host_image()
        if preparing is not None:
            preparing()
        self.cache_dir = Path(options.cache_dir)
        self.port = 29600

    def as_account(self, argv: list[str]) -> list[str]:
        """argv run as the udocker account, with this tree (and the bundle's site) importable."""
        import pwd  # noqa: PLC0415

        account = pwd.getpwnam(self.options.udocker_account)
        path = os.environ.get("PYTHONPATH", "")
        return ["runuser", "-u", account.pw_name, "--", "env", "-i", f"HOME={account.pw_dir}",
                f"USER={account.pw_name}", f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}",
                f"PYTHONPATH={REPO}{os.pathsep + path if path else ''}", "PYTHONDONTWRITEBYTECODE=1",
                sys.executable, str(HERE / "udocker_place.py"), *argv]

    def prepare_udocker(self):
        """Start making the udocker container from a tar of the host's root (beside podman's import
        of the same); returns the wait for it."""
        tar = subprocess.Popen(self.hostroot.host_tar_argv(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        started = time.monotonic()
        made = subprocess.Popen(self.as_account(["prepare", UDOCKER_CONTAINER, "--runc", self.options.udocker_runc]),
                                stdin=tar.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert tar.stdout is not None
        tar.stdout.close()

        def wait() -> None:
            out, err = made.communicate(timeout=900)
            tar.wait()
            if made.returncode != 0:
                raise RuntimeError(f"making the udocker container failed: {out[-1000:]} {err[-2000:]}")
            print(f"udocker container {UDOCKER_CONTAINER} made from the host's root in "
                  f"{time.monotonic() - started:.0f} s", flush=True)

        return wait

    def injection(self, gpus: int):
        return self.nvidia.inject(self.driver, list(range(gpus)), cache_dir=self.cache_dir)

    def container_argv(self, gpus: int, command: list[str]) -> list[str]:
        extra = [
            "-v",
            "/opt/torch:/opt/torch:ro",
            "-v",
            f"{HERE}:{CONTAINER_BENCH}:ro",
            "--shm-size=8g",
        ]
        for name, value in WORKER_ENV.items():
            extra += ["-e", f"{name}={value}"]
        return self.hostroot.run_argv(
            self.image, command, injection=self.injection(gpus), extra=extra
        )

    def udocker_argv(self, gpus: int, command: list[str]) -> list[str]:
        mounts = ["--mount", "/opt/torch:/opt/torch:ro", "--mount", f"{HERE}:{CONTAINER_BENCH}:ro"]
        env = [f"--env={name}={value}" for name, value in WORKER_ENV.items()]
        return self.as_account(["run", UDOCKER_CONTAINER, "--runc", self.options.udocker_runc, "--gpus", str(gpus),
                                "--shm-size=8g", *mounts, *env, "--", *command])

    def bare_env(self, gpus: int) -> dict[str, str]:
        return os.environ | WORKER_ENV | {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}

    def _run(self, argv: list[str], env: dict[str, str] | None) -> tuple[dict, float]:
        started = time.time()
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=self.options.run_timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{argv[:6]}… exit {result.returncode}:\n{result.stdout[-2000:]}\n"
                f"{result.stderr[-3000:]}"
            )
        return last_json(result.stdout), started

    def train(self, where: str, gpus: int) -> float:
        self.port += 1
        args = worker_args(self.options, gpus, self.port)
        if where == "bare":
            result, _ = self._run(
                [self.options.torch_python, str(HERE / "gpu_overhead.py"), *args],
                self.bare_env(gpus),
            )
        else:
            command = [self.options.torch_python, f"{CONTAINER_BENCH}/gpu_overhead.py", *args]
            place = self.udocker_argv if where == "udocker" else self.container_argv
            result, _ = self._run(place(gpus, command), None)
        return float(result["images_per_s"])

    def startup(self, where: str) -> float:
        if where == "bare":
            result, started = self._run(
                ["python3", str(HERE / "gpu_overhead.py"), "--worker", "first-kernel"],
                self.bare_env(1),
            )
        elif where == "udocker":  # from just before `udocker run`, as the account (not runuser's start)
            command = ["python3", f"{CONTAINER_BENCH}/gpu_overhead.py", "--worker", "first-kernel"]
            result, _ = self._run(self.udocker_argv(1, command), None)
            started = float(result["started"])
        else:
            command = ["python3", f"{CONTAINER_BENCH}/gpu_overhead.py", "--worker", "first-kernel"]
            result, started = self._run(self.container_argv(1, command), None)
        return float(result["kernel_done"]) - started


def rounds(places: tuple[str, ...], count: int) -> list[tuple[str, ...]]:
    """The order of the places in each round: rotated every round, so drift cancels."""
    return [places[r % len(places):] + places[:r % len(places)] for r in range(count)]


def alternate(runner: Runner, gpus: int, pairs: int, places: tuple[str, ...] = ("bare", "container")) -> dict:
    rates: dict[str, list[float]] = {where: [] for where in places}
    for pair, order in enumerate(rounds(places, pairs)):
        for where in order:
            rate = runner.train(where, gpus)
            rates[where].append(rate)
            print(
                f"  {gpus} GPU(s) round {pair + 1}/{pairs} {where:9s}: {rate:8.1f} images/s",
                flush=True,
            )
    return summary(rates)


def summary(rates: dict[str, list[float]]) -> dict:
    bare, container = rates["bare"], rates["container"]
    ratio = median_ratio(bare, container)
    result = {
        "bare_images_per_s": bare,
        "container_images_per_s": container,
        "ratios": [c / b for b, c in zip(bare, container, strict=True)],
        "median_ratio": ratio,
        "overhead_percent": (1 - ratio) * 100,
    }
    if "udocker" in rates:
        udocker = rates["udocker"]
        result |= {
            "udocker_images_per_s": udocker,
            "udocker_ratios": [u / b for b, u in zip(bare, udocker, strict=True)],
            "udocker_median_ratio": median_ratio(bare, udocker),
            "udocker_overhead_percent": (1 - median_ratio(bare, udocker)) * 100,
        }
    return result


def machine_facts(runner: Runner) -> dict:
    return {
        "host": platform.node(),
        "driver": runner.driver.version,
        "gpus": [{"index": g.index, "name": g.name, "uuid": g.uuid} for g in runner.driver.gpus],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "image": runner.image,
    }


def measure(options: argparse.Namespace) -> dict:
    runner = Runner(options)
    if len(runner.driver.gpus) < options.gpus:
        raise SystemExit(f"--gpus {options.gpus}: this host has {len(runner.driver.gpus)} GPU(s)")
    result: dict = {
        "machine": machine_facts(runner),
        "settings": {
            k: getattr(options, k)
            for k in ("gpus", "pairs", "steps", "warmup", "batch", "amp", "startup_runs")
        },
    }
    print(
        f"driver {runner.driver.version}; GPUs: "
        + ", ".join(g.name or "?" for g in runner.driver.gpus)
    )
    places = ("bare", "container", "udocker") if options.udocker_account else ("bare", "container")
    starts: dict[str, list[float]] = {where: [] for where in places}
    for order in rounds(places, options.startup_runs):
        for where in order:
            seconds = runner.startup(where)
            starts[where].append(seconds)
            print(f"  start to first CUDA kernel, {where:9s}: {seconds:.3f} s", flush=True)
    result["startup"] = {
        "bare_s": starts["bare"],
        "container_s": starts["container"],
        "bare_median_s": statistics.median(starts["bare"]),
        "container_median_s": statistics.median(starts["container"]),
    }
    if "udocker" in starts:
        result["startup"] |= {"udocker_s": starts["udocker"], "udocker_median_s": statistics.median(starts["udocker"])}
    result["train_1gpu"] = alternate(runner, 1, options.pairs, places)
    if options.gpus == 2:
        result["train_2gpu"] = alternate(runner, 2, options.pairs, places)
        one, two = result["train_1gpu"], result["train_2gpu"]
        scaling_bare = statistics.median(two["bare_images_per_s"]) / statistics.median(
            one["bare_images_per_s"]
        )
        scaling_container = statistics.median(two["container_images_per_s"]) / statistics.median(
            one["container_images_per_s"]
        )
        result["scaling_2gpu"] = {
            "bare": scaling_bare,
            "container": scaling_container,
            "difference_percent": (scaling_container / scaling_bare - 1) * 100,
        }
        if "udocker_images_per_s" in two:
            scaling_udocker = statistics.median(two["udocker_images_per_s"]) / statistics.median(
                one["udocker_images_per_s"]
            )
            result["scaling_2gpu"] |= {"udocker": scaling_udocker,
                                       "udocker_difference_percent": (scaling_udocker / scaling_bare - 1) * 100}
    result["targets"] = targets(result)
    return result


def targets(result: dict) -> dict:
    met = {
        "overhead_1gpu_within_0.5_percent": abs(result["train_1gpu"]["overhead_percent"]) <= 0.5,
        "container_start_to_first_kernel_within_2_s": result["startup"]["container_median_s"]
        <= 2.0,
    }
    if "train_2gpu" in result:
        met["overhead_2gpu_within_0.5_percent"] = (
            abs(result["train_2gpu"]["overhead_percent"]) <= 0.5
        )
        met["scaling_within_1_percent"] = abs(result["scaling_2gpu"]["difference_percent"]) <= 1.0
    return met


def report(result: dict) -> list[str]:
    machine = result["machine"]
    names = ", ".join(g["name"] or "?" for g in machine["gpus"])
    lines = [
        f"machine: {machine['host']}, {len(machine['gpus'])} x {names}, "
        f"driver {machine['driver']}, "
        f"{machine['date']}"
    ]
    start = result["startup"]
    lines.append(
        f"start to first CUDA kernel (median): bare {start['bare_median_s']:.3f} s, "
        f"container {start['container_median_s']:.3f} s"
        + (f", udocker {start['udocker_median_s']:.3f} s" if "udocker_median_s" in start else "")
    )
    for key in ("train_1gpu", "train_2gpu"):
        if key in result:
            r = result[key]
            lines.append(
                f"ResNet-50 {key[6]} GPU(s): "
                f"bare median {statistics.median(r['bare_images_per_s']):.1f}, "
                f"container median {statistics.median(r['container_images_per_s']):.1f} images/s; "
                f"median ratio {r['median_ratio']:.4f} (overhead {r['overhead_percent']:+.2f} %)"
            )
            if "udocker_images_per_s" in r:
                lines.append(
                    f"ResNet-50 {key[6]} GPU(s), udocker: median {statistics.median(r['udocker_images_per_s']):.1f} "
                    f"images/s; median ratio to bare {r['udocker_median_ratio']:.4f} "
                    f"(overhead {r['udocker_overhead_percent']:+.2f} %)"
                )
    if "scaling_2gpu" in result:
        s = result["scaling_2gpu"]
        lines.append(
            f"2-GPU scaling: bare {s['bare']:.3f}, container {s['container']:.3f} "
            f"({s['difference_percent']:+.2f} %)"
            + (f"; udocker {s['udocker']:.3f} ({s['udocker_difference_percent']:+.2f} %)" if "udocker" in s else "")
        )
    lines.append(
        "targets: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in result["targets"].items())
    )
    return lines


# ---------------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=1)
    parser.add_argument("--pairs", type=int, default=5, help="bare/container pairs (>= 5)")
    parser.add_argument("--steps", type=int, default=80, help="timed training steps per run")
    parser.add_argument(
        "--warmup", type=int, default=15, help="untimed steps first (cuDNN autotuning)"
    )
    parser.add_argument("--batch", type=int, default=128, help="images per GPU per step")
    parser.add_argument(
        "--no-amp", dest="amp", action="store_false", help="fp32 instead of bf16 autocast"
    )
    parser.add_argument("--startup-runs", type=int, default=5)
    parser.add_argument(
        "--image", help="container image (default: the host-rootfs test image, made if missing)"
    )
    parser.add_argument("--torch-python", default="/opt/torch/.venv/bin/python3")
    parser.add_argument("--cache-dir", default="/tmp/gpubook-bench-nvidia")
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds per measurement")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    parser.add_argument("--udocker-account", help="also measure udocker, run as this ordinary account")
    parser.add_argument("--udocker-runc", default="/opt/pm/runc-wrap", help="the host's runc, for udocker")
    parser.add_argument(
        "--selftest",
        "--dry-run",
        dest="selftest",
        action="store_true",
        help="check arguments, imports and statistics; no GPU needed",
    )
    parser.add_argument("--worker", choices=("train", "first-kernel"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29600, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker is None:
        if options.pairs < 5:
            parser.error("--pairs must be at least 5 (the issue asks for >= 5 alternating pairs)")
        if min(options.steps, options.batch, options.startup_runs) < 1 or options.warmup < 0:
            parser.error(
                "--steps, --batch and --startup-runs must be positive, --warmup not negative"
            )
    return options


def selftest(options: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "tests" / "kits"))
    import hostroot  # noqa: PLC0415

    from gpubook.runtime import nvidia  # noqa: PLC0415

    assert median_ratio([100.0, 200.0, 300.0], [99.0, 200.0, 303.0]) == 1.0
    assert rounds(("bare", "container", "udocker"), 3) == [
        ("bare", "container", "udocker"), ("container", "udocker", "bare"), ("udocker", "bare", "container")]
    three = summary({"bare": [100.0, 200.0], "container": [99.0, 200.0], "udocker": [100.0, 198.0]})
    assert three["udocker_median_ratio"] == 0.995 and three["median_ratio"] == 0.995
    assert last_json('noise\n{"images_per_s": 5}\n') == {"images_per_s": 5}
    fake = {"startup": {"container_median_s": 1.0}, "train_1gpu": {"overhead_percent": 0.3}}
    assert targets(fake) == {
        "overhead_1gpu_within_0.5_percent": True,
        "container_start_to_first_kernel_within_2_s": True,
    }
    args = worker_args(options, options.gpus, 29601)
    assert parse(args).worker == "train"
    print(
        f"selftest ok: worker argv {' '.join(args)}; image {options.image or hostroot.HOST_IMAGE}; "
        f"GPU here: {hostroot.unavailable() or 'yes'}; "
        f"library folder {nvidia.CONTAINER_LIBRARY_DIR}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    if options.worker == "first-kernel":
        first_kernel()
        return 0
    if options.worker == "train":
        train(
            options.gpus,
            {
                "steps": options.steps,
                "warmup": options.warmup,
                "batch": options.batch,
                "amp": options.amp,
                "port": options.port,
            },
        )
        return 0
    if options.selftest:
        return selftest(options)
    sys.path.insert(0, str(REPO / "tests" / "kits"))
    import hostroot  # noqa: PLC0415

    reason = hostroot.unavailable()
    if reason:
        print(f"gpu_overhead: cannot measure here: {reason}")
        return 2
    result = measure(options)
    print("\n".join(report(result)))
    if options.out:
        options.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {options.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
