"""The simulator in a fresh interpreter: importing it loads none of the heavy packages (torch,
h5py, mpi4py, submitit, matplotlib). Starts a process, so not in tests/unit/ (test_sim.py)."""

from __future__ import annotations

import subprocess
import sys


def test_simulator_imports_nothing_heavy():
    code = ("import sys, oobleck_hpc.sim, oobleck_hpc.sim.cli, oobleck_hpc.sim.planner_backend, "
            "oobleck_hpc.sim.scenario, oobleck_hpc.sim.report; "
            "print([m for m in ('torch', 'h5py', 'mpi4py', 'submitit', 'matplotlib') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]"
