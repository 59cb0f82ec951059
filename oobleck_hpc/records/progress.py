"""The run's progress as the current plan's rank 0 reports it: the console (a tqdm bar on a TTY,
a log line every `log_every` steps otherwise) and the metrics file (one JSON line per committed
step, each exactly once whoever dies). Used by the worker's run loop (oobleck_hpc/train.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from oobleck_hpc.polling import wait_until


@dataclass
class Progress:
    """The run as the current plan's rank 0 reports it: a tqdm bar on a TTY, a log line every
    `log_every` steps otherwise, and one JSON line per committed step in the metrics file
    (steps numbered from 1, as on the console and in the events). Every rank records its
    committed steps (the same values everywhere); only the current plan's rank 0 (`active`: it
    changes when a node is lost) writes and prints. The metrics file holds every step committed
    by this attempt exactly once and in order, whoever dies: a writer appends, under a lock on
    the file, the steps it kept after the last one the file's tail records for this attempt
    (the previous writer may have died between committing a step and writing it), only if it
    kept the next one -- a process that joined the run late (`joined`: a worker restarted
    after a crash, a spare) lacks the steps before it, and a rank 0 restarted so leaves them to
    the others: every rank appends so once after each recovery (a new generation) and after
    the last step. Each line names its run and attempt (oobleck_hpc/records/runs.py): a
    requeued attempt appends the steps it replays after its checkpoint with its own number."""

    total: int
    log_every: int
    metrics: Path | None
    run: str = ""
    attempt: int = 0
    active: bool = False
    joined: bool = False
    """This process joined the running attempt (it kept no step before it joined)."""
    bar: object = None
    losses: list[float] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0
    _rows: deque = field(default_factory=lambda: deque(maxlen=KEEP_ROWS))
    _printed: int = -1
    _generation: int | None = None

    def __post_init__(self) -> None:
        if self.metrics is not None:
            self.metrics.parent.mkdir(parents=True, exist_ok=True)

    def record(self, results, plan_id: str, generation: int, active: bool) -> None:
        """Steps committed on this rank (driver.step()'s list), on plan `plan_id`."""
        for r in results:
            self.losses.append(r.loss)
            self.samples += r.samples
            self.seconds += r.seconds
            self._rows.append({"step": r.step + 1, "loss": r.loss, "samples": r.samples,
                               "seconds": r.seconds, "grad_norm": r.grad_norm, "lr": r.lr,
                               "plan": plan_id, "generation": generation, "time": time.time(),
                               "run": self.run, "attempt": self.attempt})
        if active and not self.active and self.bar is None and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=len(self.losses) - len(results),
                            unit="step", dynamic_ncols=True)
        self.active = active
        recovered = self._generation is not None and generation != self._generation
        self._generation = generation
        if not active:
            if recovered:
                self._append_missing()  # (the writer may lack the steps before it joined)
            return
        for row in self._append_missing():
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)
            elif row["step"] % self.log_every == 0 or row["step"] == self.total:
                print(f"step {row['step']}/{self.total}  loss {row['loss']:.4f}  "
                      f"{row['samples'] / max(row['seconds'], 1e-9):.1f} samples/s", flush=True)

    def finish(self) -> None:
        """Every rank, after the last step: write what the file lacks (the writer may have died
        after the last commit, before writing it)."""
        self._append_missing()
        if self.bar is not None:
            self.bar.close()

    def _append_missing(self) -> list[dict]:
        """Under an exclusive lock on the file: append the kept steps after the last one it
        records for this attempt, if the next one is kept here (class docstring; a torn last
        line, from a writer killed mid-write, is ended first). Returns the rows written
        (without a file: the rows not reported yet)."""
        if self.metrics is None:
            new = [row for row in self._rows if row["step"] > self._printed]
        else:
            with open(self.metrics, "a+b") as f:
                _lock(f, LOCK_WAIT_S)
                end = f.seek(0, os.SEEK_END)
                f.seek(max(0, end - TAIL_BYTES))
                tail = f.read()
                if tail and not tail.endswith(b"\n"):
                    f.write(b"\n")
                last = _last_step_in(tail, self.run, self.attempt)
                new = [row for row in self._rows if row["step"] > last]
                if new and (last or self.joined) and new[0]["step"] != last + 1:
                    new = []  # a gap: the steps before are the others' to write
                f.write("".join(json.dumps(row) + "\n" for row in new).encode())
        if new:
            self._printed = new[-1]["step"]
        return new


TAIL_BYTES = 8192
"""How much of the metrics file's end is read to find the last step it records."""


LOCK_WAIT_S = 5.0
"""Longest wait for the metrics file's lock: a writer frozen (SIGSTOP) while holding it must
not stop the others; after that they write without it."""


def _lock(f, wait_s: float) -> None:
    import fcntl

    def locked() -> bool:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    try:
        wait_until(locked, wait_s, "the metrics file's lock", every_s=0.01)
    except TimeoutError:
        pass  # its holder is frozen: write without it (LOCK_WAIT_S)


def _last_step_in(tail: bytes, run: str, attempt: int) -> int:
    """The step of the last complete JSON line of attempt (`run`, `attempt`) in `tail` (0: none:
    the attempt wrote nothing yet, or earlier lines of the file are another attempt's)."""
    for line in reversed(tail.split(b"\n")):
        try:
            row = json.loads(line)
            if (row.get("run", ""), row.get("attempt", 0)) == (run, attempt):
                return int(row["step"])
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return 0


KEEP_ROWS = 1000
"""Committed steps a rank keeps for the metrics file in case it becomes the writer."""
