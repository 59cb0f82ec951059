"""Stop requests from Slurm or a person: signals that only set a flag the training loop reads at
its next step boundary (checkpoint/resume.py then checkpoints and leaves with errors.EXIT_REQUEUE, and the
launcher requeues the job)."""

from __future__ import annotations

import signal
from typing import Any


class StopSignals:
    """Signal handlers that only record the request; the loop acts at its next step boundary
    (a handler that saved or exited inside a collective would hang the other ranks).

    SIGUSR2: the pre-timeout warning (sbatch --signal=USR2@<s>, submitit's default).
    SIGTERM: preemption or scancel (Slurm sends SIGKILL KillWait seconds later, 30 s by default).
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __bool__(self) -> bool:
        return self.reason is not None

    @classmethod
    def install(cls, signals: tuple[int, ...] = (signal.SIGUSR2, signal.SIGTERM)) -> StopSignals:
        """Install the handlers (from the main thread) and return the flag object."""
        stop = cls()
        for signum in signals:
            stop._previous[signum] = signal.signal(signum, stop._handle)
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.reason is None:
            self.signum = signum
            self.reason = f"received {signal.Signals(signum).name}"

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

