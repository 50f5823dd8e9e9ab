"""Checkpoints: Orbax saves restored onto any mesh, their records, integrity, many processes."""

from nnxscale.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    NoCheckpointError,
    SaveError,
    SkippedCheckpointWarning,
)
from nnxscale.checkpoint.records import (
    FALL_BACK,
    FILE_ROLES,
    PARTIAL,
    Record,
    array_index,
    check_data,
    check_matches,
    file_role,
    record_from,
    record_of,
    restored_options,
    sealed,
)
from nnxscale.checkpoint.restoring import (
    check_target,
    chunks_read,
    restore_target,
    state_to_restore,
)
from nnxscale.checkpoint.store import (
    MONITORING_TOOL,
    SaveTimes,
    finish_at_program_end,
    orbax_manager,
)

__all__ = [
    "FALL_BACK",
    "FILE_ROLES",
    "MONITORING_TOOL",
    "PARTIAL",
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "NoCheckpointError",
    "Record",
    "SaveError",
    "SaveTimes",
    "SkippedCheckpointWarning",
    "array_index",
    "check_data",
    "check_matches",
    "check_target",
    "chunks_read",
    "file_role",
    "finish_at_program_end",
    "orbax_manager",
    "record_from",
    "record_of",
    "restore_target",
    "restored_options",
    "sealed",
    "state_to_restore",
]
