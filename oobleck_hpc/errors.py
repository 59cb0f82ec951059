"""Typed errors shared by every layer of the job.

Each error carries a message that says what happened, the numbers involved and what to do.
Exit codes for the launcher (documented in README, "Exit codes"):

- 0   training finished
- 2   bad input (config, profile, plan): fix the input; never requeue
- 3   unrecoverable error inside training: do not requeue
- 75  fault tolerance exceeded or a pre-timeout/preemption signal: a checkpoint is on disk,
      requeue the job and it resumes from it (EX_TEMPFAIL in sysexits.h)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_UNRECOVERABLE = 3
EXIT_REQUEUE = 75


class OobleckError(Exception):
    """Base class of every error this package raises on purpose."""

    exit_code = EXIT_UNRECOVERABLE


class ConfigError(OobleckError, ValueError):
    """A job file is wrong. The message names the file, the key, the bad value and the fix."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, source: str, key: str, problem: str, fix: str):
        self.source, self.key, self.problem, self.fix = source, key, problem, fix
        super().__init__(f"{source}: key '{key}': {problem}. Fix: {fix}")


class ProfileError(OobleckError, ValueError):
    """A profile file is missing, corrupt, of another schema, or does not match the job."""

    exit_code = EXIT_BAD_INPUT


class PlanningError(OobleckError, ValueError):
    """No plan exists for the inputs (too few nodes, model does not fit, ...)."""

    exit_code = EXIT_BAD_INPUT


class CheckpointError(OobleckError):
    """A checkpoint is missing, partial or corrupt, or a state does not fit the model."""


class GuaranteeExceeded(OobleckError):
    """The failures exceed what the pipeline templates can absorb in place.

    Raised by reconfiguration when some layer has no surviving replica or fewer than n0 nodes are
    left; the job falls back to its last checkpoint and asks to be requeued.
    """

    exit_code = EXIT_REQUEUE
