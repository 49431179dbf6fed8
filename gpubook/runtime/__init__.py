"""gpubook's runtime: how a booking's container runs; `runtime` never imports `scheduler` (the scheduler
decides *when*, the runtime knows *how*).

Its rooms: `engines/` (podman, Docker, udocker), `nvidia/` (the GPUs, the driver's files and their
injection), `templates/` (templates and their images), `booking/` (one booking's container, its SSH,
booking.json and provenance), `data/` (the booker's folders and the SFTP service) and `slurm/` (a
Slurm job step). Beside them, what every room shares: errors, names, mounts, private files, plug-ins,
ports, cgroups, the network's checks, doctor's `Check` and the crash points.
"""
