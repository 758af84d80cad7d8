"""Crash-safe checkpoint directories: staged, hashed, fsynced, published by one rename, verified on load."""

from lightning_smartinf.checkpoint.files import DiskFullError
from lightning_smartinf.checkpoint.manifest import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriter,
    Manifest,
    latest_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointWriter",
    "DiskFullError",
    "Manifest",
    "latest_checkpoint",
    "verify_checkpoint",
]
