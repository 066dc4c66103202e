"""Errors meant for the person at the keyboard.

A :class:`ReprlabError` is a problem with the input (a config key, a file, a device, a model that is not
available, a run folder in the wrong state), not a bug. The CLI prints its message alone and exits with
status 2; ``--debug`` or ``REPRLAB_DEBUG=1`` shows the traceback. Anything else is a bug and keeps its
traceback. Each subclass also derives from the builtin a caller would expect (``ValueError``,
``FileNotFoundError``...), so ``except ValueError`` around library calls keeps working.
"""

from __future__ import annotations


class ReprlabError(Exception):
    """Base of every user-facing reprlab error; ``hint`` is the fix, printed on its own line."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable for every subclass
        return str(self.args[0]) if self.args else ""


class ConfigError(ReprlabError, ValueError):
    """An unknown key, a wrong type, a value out of range or a malformed override in a config."""


class RecipeError(ReprlabError, KeyError):
    """An unknown recipe or a malformed recipe file."""


class DataError(ReprlabError, ValueError):
    """A missing, unreadable, empty or malformed input file or dataset; the message names the file."""


class DataFileMissingError(DataError, FileNotFoundError):
    """An input file or folder that does not exist; the message names it."""


class DeviceError(ReprlabError, ValueError):
    """A device that does not exist on this machine."""


class ModelNotAvailableError(ReprlabError, OSError):
    """A model id that is neither a local folder, a packaged alias nor in the local Hugging Face cache."""


class RunFolderError(ReprlabError, FileExistsError):
    """A run folder in a state that does not allow the requested action (exists, missing, not a run)."""


class RunLockedError(RunFolderError):
    """Another live process is writing to this run folder."""


class CheckpointError(ReprlabError, ValueError):
    """A checkpoint that cannot be used: damaged, unverifiable, or in the old pickle format; names the file."""


class WriteError(ReprlabError, OSError):
    """A run folder (or another output) cannot be written: a full disk, a read-only folder, no permission."""
