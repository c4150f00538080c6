"""Errors a user can fix, and what to tell them.

A `UserError` carries what is wrong (`message`) and what to do about it (`hint`). The
`specdec` command prints it as one line, `specdec: error: <message>; <hint>`, and exits
with status 2 (no traceback unless `specdec --debug` or `SPECDEC_DEBUG=1`). Raise one
where the cause is known (a model not pulled, an unknown pair, a gateway that cannot be
reached) rather than letting the CLI guess from a message.
"""

from __future__ import annotations

import signal

EXIT_ADDRESS_IN_USE = 98
"""The `specdec` exit status when a port it was to bind is taken (errno EADDRINUSE, 98 on
Linux): a launcher that chose the port itself (`specdec_cli.launch`) picks another and
starts the service again; any other error to fix exits with 2."""


def exit_status(returncode: int) -> str:
    """How a child process ended, for a message: `exit status N`, or for a negative returncode
    (subprocess's convention: killed by signal -returncode) the signal by name, e.g.
    `signal SIGILL (Illegal instruction)`, so a crash reads as a crash, not as `-4`."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"signal {-returncode}"
    return f"signal {sig.name} ({signal.strsignal(sig)})"


class UserError(Exception):
    """An error the user can fix: `message` says what is wrong, `hint` what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        text = f"{message}; {hint}" if hint else message
        super().__init__(text)  # one argument: str() and pickling keep the whole text
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class ModelNotFoundError(UserError, FileNotFoundError):
    """A model reference that is not a folder, not a known pair or role, or not pulled yet.

    A FileNotFoundError too, for callers that catch that."""
