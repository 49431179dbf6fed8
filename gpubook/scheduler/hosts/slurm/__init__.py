"""The Slurm backend: bookings placed on a Slurm cluster (issue 14).

`parse` reads scontrol's listings, `sync` decides (pure) which reservation commands bring Slurm
in step with gpubook's plan, `cluster` runs them. gpubook's plan stays the decider of who gets
which node and how many GPUs; Slurm enforces it: an advance reservation per booking on its
nodes, and (to come) the booking's job inside it asking for its GPUs as GRES.
"""

from gpubook.scheduler.hosts.slurm.cluster import Scontrol, SlurmCluster, SlurmError, SlurmUnreachable, Synced

__all__ = ["Scontrol", "SlurmCluster", "SlurmError", "SlurmUnreachable", "Synced"]
