"""Errors a distributed executor raises when a worker fails (the engine surfaces them as is)."""
from __future__ import annotations

import pickle
import signal
import traceback
from dataclasses import dataclass


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed; the executor can no longer run steps."""


class WorkerDiedError(WorkerError):
    """A worker process or actor is gone (killed, crashed, out of memory)."""


@dataclass
class RemoteFailure:
    """An exception raised inside a worker, in a form that always crosses a process boundary."""

    type_name: str
    message: str
    traceback: str
    pickled: bytes | None = None  # the exception itself, when it pickles

    @classmethod
    def capture(cls, exc: BaseException) -> RemoteFailure:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            pickled = pickle.dumps(exc)
            pickle.loads(pickled)
        except Exception:
            pickled = None
        return cls(type(exc).__name__, str(exc), tb, pickled)

    def to_exception(self, rank: int, method: str) -> BaseException:
        """The original exception where possible (ValueError stays ValueError), else a
        WorkerError; either way it names the rank and carries the remote traceback."""
        where = f"in worker rank {rank} ({method})"
        exc: BaseException | None = None
        if self.pickled is not None:
            try:
                exc = pickle.loads(self.pickled)
            except Exception:
                exc = None
        if not isinstance(exc, Exception):
            return WorkerError(f"worker rank {rank} failed in {method}: {self.type_name}: "
                               f"{self.message}\nremote traceback:\n{self.traceback}")
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised {where}; remote traceback:\n{self.traceback}")
        return exc


def exit_reason(exitcode: int | None) -> str:
    """'exit code 1' or 'killed by SIGKILL' for a process's exit status."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
