"""Diagnostics (warnings, debug detail, "cannot write X") go through `logging`, one logger per
module (`logging.getLogger(__name__)`), to stderr; the console story a user watches (steps,
recoveries, `done: ...`) is printed, not logged. The level is set once per process:
`oobleck-hpc --log-level LEVEL` sets it and exports it as OOBLECK_LOG_LEVEL, so the agents and
workers the launchers start (they inherit the environment) log at the same level."""

from __future__ import annotations

import logging
import os
import sys

LOG_LEVEL_ENV = "OOBLECK_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure(default: str, level: str | None = None, fmt: str = "%(message)s") -> None:
    """Log to stderr at `level` (exported to child processes) or else at OOBLECK_LOG_LEVEL, or
    else at this process's `default`."""
    if level is not None:
        os.environ[LOG_LEVEL_ENV] = level
    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV) or default, format=fmt,
                        stream=sys.stderr)
