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
