"""The project's errors: one base class, so a command-line tool can tell a user's problem from a bug.

Every ``SmartInfError`` message names what is wrong (the config key, the path, the numbers) and the fix, in one
line; ``smartinf-train`` and the other tools print it as ``error: ...`` without a traceback (``HYDRA_FULL_ERROR=1``
shows it). Each subclass also derives from the builtin a caller would catch (``ValueError`` for settings,
``OSError`` for storage), so ``except ValueError`` keeps working. A bug raises a builtin and keeps its traceback.
"""

from __future__ import annotations


class SmartInfError(Exception):
    """A problem the user can fix; the message says how."""


class ConfigError(SmartInfError, ValueError):
    """A setting (config key, argument, model structure) that cannot work as given."""


class SetupError(SmartInfError, RuntimeError):
    """The machine lacks something the settings ask for (an OpenCL platform, a compiled op, a free lock)."""


class StorageError(SmartInfError, OSError):
    """A path that cannot hold what it must (not a directory, not writable, too small, a short transfer)."""


class HostMemoryError(SmartInfError, MemoryError):
    """The run does not fit the host memory it may use."""


class MissingPathError(StorageError, FileNotFoundError):
    """A path the settings name does not exist, or holds nothing usable."""


class NotWritableError(StorageError, PermissionError):
    """A directory the run must write to refuses writes."""


class ShortReadError(StorageError, EOFError):
    """A file holds fewer bytes than the read needs (truncated or never written): never read as zeros."""
