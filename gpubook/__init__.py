"""gpubook: GPU bookings from a shared calendar become containers on exactly the booked GPUs.

The version below is the one version source: pyproject.toml reads it, `gpubook --version` prints
it, and each release is the git tag `v<version>` with its entry in CHANGES.md.
"""

__version__ = "0.3.0.dev0"
