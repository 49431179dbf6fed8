"""State's errors: GpubookErrors, so that the pass handles them per booking."""

from __future__ import annotations

from gpubook.runtime.errors import GpubookError


class StateError(GpubookError):
    """The state database cannot be used (a newer schema, an unwritable folder, no free port)."""


class StateUnavailable(StateError):
    """A read or write failed (locked by another process, read-only, full disk, damaged): the one
    booking or step that needed it fails this time and is tried again; the pass goes on."""

    temporary = True
