"""Typed errors shared by every layer of the job.

Each error carries a message that says what happened, the numbers involved and what to do.
Exit codes for the launcher (documented in README, "Exit codes"):

- 0   training finished
- 1   (kill-node, drain, grow only) the request was made but not confirmed within --wait, or
      the job ended first: look at the run's events
- 2   bad input (config, profile, plan): fix the input; never requeue
- 3   unrecoverable error inside training: do not requeue
- 75  fault tolerance exceeded or a pre-timeout/preemption signal: a checkpoint is on disk,
      requeue the job and it resumes from it (EX_TEMPFAIL in sysexits.h)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNCONFIRMED = 1
EXIT_BAD_INPUT = 2
EXIT_UNRECOVERABLE = 3
EXIT_REQUEUE = 75


class OobleckError(Exception):
    """Base class of every error this package raises on purpose."""

    exit_code = EXIT_UNRECOVERABLE


class RecoveryError(OobleckError):
    """Survivors disagree on the state to resume from: in-place recovery cannot continue."""

    exit_code = EXIT_REQUEUE  # as GuaranteeExceeded: fall back to the last checkpoint


class ConfigError(OobleckError, ValueError):
    """A job file is wrong. The message names the file, the key, the bad value and the fix."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, source: str, key: str, problem: str, fix: str):
        self.source, self.key, self.problem, self.fix = source, key, problem, fix
        super().__init__(f"{source}: key '{key}': {problem}. Fix: {fix}")


class YamlSyntaxError(ConfigError):
    """A job file that is not YAML, told as compilers do: FILE:LINE:COLUMN (from 1), the
    problem, the line with a caret under the place, and the fix."""

    def __init__(self, source: str, line: int, column: int, problem: str, fix: str,
                 snippet: str = ""):
        self.source, self.key, self.problem, self.fix = source, "<file>", problem, fix
        self.line, self.column = line, column
        Exception.__init__(self, f"{source}:{line}:{column}: not valid YAML: {problem}"
                           + (f"\n{snippet}" if snippet else "") + f"\nFix: {fix}")

    @classmethod
    def of(cls, source: str, e) -> YamlSyntaxError:
        """From PyYAML's MarkedYAMLError `e` (its marks count from 0)."""
        mark = e.problem_mark or e.context_mark
        problem = e.problem or e.context or "unreadable"
        opened = ""
        if e.context_mark is not None and e.context and e.problem_mark is not None and \
                (e.context_mark.line, e.context_mark.column) != (e.problem_mark.line,
                                                                 e.problem_mark.column):
            opened = f"{e.context_mark.line + 1}:{e.context_mark.column + 1}"
            problem += f" ({e.context} that begins at {opened})"
        context = e.context or ""
        if "\\t" in problem or "\t" in problem:
            fix = "indent with spaces: YAML does not allow tabs"
        elif "quoted scalar" in context:
            fix = f"close the quote opened at {opened or 'the start of its value'}"
        elif "flow" in context:
            fix = (f"close the bracket opened {'at ' + opened if opened else 'before it'} "
                   "('[' with ']', '{' with '}') or write the list or mapping as indented lines")
        elif "mapping values are not allowed" in problem:
            fix = ("indent this line like the keys beside it (spaces), or quote a value that "
                   "holds ': '")
        else:
            fix = ("correct the YAML there (spaces for indentation, 'key: value' with a space "
                   "after the colon, brackets and quotes closed)")
        snippet = mark.get_snippet() if mark is not None else None
        return cls(source, mark.line + 1 if mark else 0, mark.column + 1 if mark else 0,
                   problem, fix, snippet or "")


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
    left; the job falls back to its last checkpoint and asks to be requeued. `survivors`: the
    nodes still alive when the recovery knows them (the local requeue starts on those).
    """

    exit_code = EXIT_REQUEUE

    def __init__(self, message: str, survivors: tuple[str, ...] | None = None):
        super().__init__(message)
        self.survivors = survivors
