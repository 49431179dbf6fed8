"""A Slurm booking's runtime: the job step running the container on a node, podman's pause process."""
