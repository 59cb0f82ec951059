"""The set-up scripts as a user meets them: `source scripts/env.sh` in an interactive shell."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sourcing_env_sh_leaves_the_shell_options_alone():
    """README: `source scripts/env.sh` puts oobleck-hpc on PATH. A failing command afterwards
    must not close the user's interactive shell (no `set -e` leaking from the script), and the
    virtual environment comes first on PATH. (The environment exists when the tests run, so
    this only checks it.)"""
    out = subprocess.run(["bash", "-ic", f"source {ROOT}/scripts/env.sh; false; echo still-here; "
                          "echo \"opts=$-\"; command -v oobleck-hpc"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = out.stdout.splitlines()
    assert "still-here" in lines, out
    opts = next(x for x in lines if x.startswith("opts="))
    assert "e" not in opts.removeprefix("opts="), opts
    assert lines[-1] == str(ROOT / ".venv" / "bin" / "oobleck-hpc"), out
