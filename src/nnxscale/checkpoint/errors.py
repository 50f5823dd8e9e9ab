"""The errors a checkpoint directory raises: each names the problem and the fix."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored as asked; the message names the problem and the fix."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No complete checkpoint where one was expected."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint whose arrays, or data, differ from what the restore asks for."""


class CorruptCheckpointError(CheckpointError):
    """A step whose files do not hold what its record says was saved: damaged, truncated,
    copied in from another run, or written without checksums. `restore()` falls back past it."""


class SaveError(CheckpointError):
    """A save that did not happen; the message says why, and what was kept."""


class SkippedCheckpointWarning(UserWarning):
    """`restore()` passed over newer steps that did not verify, to restore an older one."""
