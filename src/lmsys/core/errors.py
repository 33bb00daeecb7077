"""The one exception type for mistakes a user can make (bad sizes, no GPU, missing tools).

The CLI prints its message on one line (plus the hint, if any) and exits with code 2, without a
traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class LmsysError(Exception):
    """A user-facing error: one line of message, optionally one line of hint."""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class RunFailed(Exception):
    """A run that failed, already said in one line (the user's code failed in a child process): the CLI
    prints the message and exits 1, as for a crash, without a type name or traceback."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) reached lmsys: unwind (stopping child processes, removing temporary files),
    then exit 128 + the signal number. A BaseException, so `except Exception` blocks let it through."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum
