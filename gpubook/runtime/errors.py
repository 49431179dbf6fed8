"""The one exception tree of gpubook (scheduler imports it from here; runtime never imports scheduler).

Subsystems of scheduler root their own errors here too: the calendar sources' CalendarError and
CalendarDataError live in gpubook/scheduler/sources/errors.py.

Temporary errors are worth a retry after a delay (a server that did not answer); permanent ones are
reported once and skipped (a malformed template). The CLI turns each into one line and an exit code.
"""

from __future__ import annotations


class GpubookError(Exception):
    """Root of every error gpubook reports to a person."""

    temporary: bool = False


class ConfigError(GpubookError):
    """The daemon's configuration is invalid; the message lists every problem found."""


class TemplateError(GpubookError):
    """A container template is missing or invalid."""


class EngineError(GpubookError):
    """A container engine refused or failed; carries the engine's own message."""

    temporary = True


class DriverError(GpubookError):
    """The NVIDIA driver or its files could not be found or used."""


class StorageError(GpubookError):
    """A booker's data folders cannot be made or used safely (bad name, missing root, escape)."""


PREPARING_IMAGE = "preparing image "  # how a `Preparing` sentence about an image begins


class Preparing(GpubookError):
    """Not an error of the booking: something it needs is being made in the background (its image);
    the booking is held with this sentence as its note and started once that is ready."""

    temporary = True
