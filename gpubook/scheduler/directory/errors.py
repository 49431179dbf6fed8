"""The one error of the directory's readers."""

from __future__ import annotations

from gpubook.runtime.errors import GpubookError


class DirectoryError(GpubookError):
    """The directory could not be read (temporary: the last good copy is kept)."""
